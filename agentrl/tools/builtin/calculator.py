"""Arithmetic for agents, evaluated on a whitelisted AST: never `eval`, bounded in size.

Python's `ast` does the parsing; only numbers, + - * / // % ** and parentheses are allowed, and
exponents and intermediate magnitudes are capped so a model cannot make the process hang.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from agentrl.tools.base import tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e100
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")


def evaluate(expression: str) -> int | float:
    """Value of an arithmetic expression; ValueError with a reason the model can act on."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    # Thousands separators go ('1,234 * 2'); any other comma stays and fails to parse: '2,5' (a
    # decimal comma) or '3,4,5' read as 25 or 345 would be a wrong number, not an error.
    text = _THOUSANDS.sub(lambda m: m[0].replace(",", ""), expression)
    if "," in text:
        raise ValueError(f"cannot parse {expression!r}: a comma only separates thousands (1,234); write a "
                         "decimal point as '.'")
    text = text.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not abs(node.value) <= MAX_MAGNITUDE:  # also NaN; `1e999` reads as inf
            raise ValueError(f"a number is out of range (larger than {MAX_MAGNITUDE:g})")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:  # float arithmetic past 1.8e308, e.g. 1e99 ** 4
            raise ValueError("result out of range") from None
        if isinstance(value, complex) or not abs(value) <= MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"'{ast.unparse(node)}' is not allowed; use numbers, + - * / // % ** and ()")


def format_number(value: int | float) -> str:
    """An int as its digits; a float to 15 significant digits (all a float holds without its
    rounding noise showing: 0.1 + 0.2 is 0.3), written without a point when it is a whole number
    a float holds exactly (below 2**53). 1e30 is '1e+30', not the 31 digits of the nearest float."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.15g}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(1234 * 5678) + 9".
    """
    try:
        return format_number(evaluate(expression))
    except ValueError as e:
        return f"Error: {e}"
