"""The calculator's AST whitelist and the Hermes call parser on golden strings."""

from __future__ import annotations

import re

import pytest

from agentrl.tools.builtin.calculator import calculator, evaluate
from agentrl.tools.parsers import parse_hermes


@pytest.mark.parametrize("expr,value", [("1234 * 5678", 7006652), ("(2 + 3) * 4 - 6 / 4", 18.5), ("-2 ** 3", -8),
                                        ("7 // 2 + 7 % 2", 4), ("1,234 × 2", 2468), ("2^10", 1024),
                                        ("(1,000 + 2,000,000) * 2", 4002000), ("1,234.5 * 2", 2469)])
def test_evaluate(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr,message", [
    ("__import__('os').system('true')", "is not allowed"), ("x + 1", "'x' is not allowed"),
    ("2 ** 1000", "exponent 1000 is larger than 64"), ("1 / 0", "division by zero"),
    ("1 +", "cannot parse"), ("9" * 600, "longer than 500"), ("(10 ** 60) * (10 ** 60)", "out of range"),
    ("1e99 ** 4", "result out of range"),
    # any comma but a thousands separator: all of them were deleted, and '2,5' computed as 25
    *((e, f"cannot parse '{e}': a comma only separates thousands (1,234); write a decimal point as '.'")
      for e in ("2,5 * 4", "3,4,5", "12,34 * 2", "1,2345", "1,234,5")),
])
def test_evaluate_refuses(expr, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        evaluate(expr)


def test_calculator_tool_formats_and_reports_errors():
    assert calculator("10 / 4") == "2.5" and calculator("10 / 2") == "5"
    # No float noise shown as digits (1e30 was 1000000000000000019884624838656), none hidden by
    # rounding (110000002.75 was 110000002.8), none shown of the float's own (0.1 + 0.2).
    assert [calculator(e) for e in ("1e30", "1e16 + 1", "2 ** 52 * 1.0", "110000002.75 * 1", "0.1 + 0.2", "1 / 3")] == [
        "1e+30", "1e+16", "4503599627370496", "110000002.75", "0.3", "0.333333333333333"]
    assert calculator("1e99 ** 4") == "Error: result out of range"
    assert calculator("open('f')") == "Error: 'open('f')' is not allowed; use numbers, + - * / // % ** and ()"
    assert calculator.schema["function"]["parameters"]["required"] == ["expression"]
    assert "return" not in calculator.schema["function"]


def test_two_calls_with_text_around():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
            'and\n<tool_call>{"name": "check_answer", "arguments": "{\\"answer\\": \\"6\\"}"}</tool_call> done')
    turn = parse_hermes(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2*3"}),
                                                            ("check_answer", {"answer": "6"})]
    assert turn.errors == []


@pytest.mark.parametrize("body,error", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON (Expecting ',' delimiter"),
    ('["calculator"]', "must be a JSON object with 'name' and 'arguments'"),
    ('{"arguments": {}}', "has no 'name'"),
    ('{"name": "calculator", "arguments": [1]}', "arguments of 'calculator' must be a JSON object"),
    ('{"name": "calculator", "arguments": "nope"}', "a string that is not a JSON object"),
])
def test_malformed_calls_become_errors(body, error):
    turn = parse_hermes(f"ok <tool_call>{body}</tool_call>")
    assert turn.calls == [] and len(turn.errors) == 1 and error in turn.errors[0]


def test_missing_arguments_default_to_empty_and_unclosed_tag_is_an_error():
    turn = parse_hermes('<tool_call>{"name": "now"}</tool_call> then <tool_call>{"name": "x"')
    assert [(c.name, c.arguments) for c in turn.calls] == [("now", {})]
    assert turn.errors == ["a <tool_call> was opened but never closed with </tool_call>"]


def test_plain_text_has_no_calls():
    assert parse_hermes("The answer is 4.").calls == [] and parse_hermes("The answer is 4.").errors == []


@pytest.mark.parametrize("body,error", [
    # The message quotes the call's first 200 characters.
    ('{"name": "calculator", "arguments": ' + "[" * 3000 + "]" * 3000 + "}",
     'the tool call is not valid JSON (nested too deeply): {"name": "calculator", "arguments": ' + "[" * 164),
    ('{"name": "calculator", "arguments": {"expression": ' + "7" * 5000 + "}}",
     "the tool call is not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has "
     '5000 digits): {"name": "calculator", "arguments": {"expression": ' + "7" * 149),
    ('{"name": "calculator", "arguments": "' + "[" * 3000 + '"}',
     "the arguments of 'calculator' are a string that is not a JSON object"),
])
def test_json_past_pythons_limits_becomes_an_error(body, error):
    turn = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert turn.calls == [] and turn.errors == [error]


def test_a_block_ends_where_its_json_ends_so_arguments_may_hold_the_closing_tag():
    text = 'Run it. <tool_call>{"name": "python", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call> then stop.'
    turn = parse_hermes(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [("python", {"code": "print('</tool_call>')"})]
    assert turn.errors == [] and turn.content == "Run it.  then stop."


def test_an_unclosed_block_does_not_swallow_the_calls_after_it():
    broken = '<tool_call>{"name": "calculator", "arg\n'
    turn = parse_hermes(broken + '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "1+1"})]
    assert turn.errors == ["a <tool_call> was opened but never closed with </tool_call>"]
    assert turn.content == broken.strip()  # the unclosed block stays in the text, as written


@pytest.mark.parametrize("body,arguments,error", [
    ('{"name": "now", "arguments": null}', {}, None),  # a tool without parameters, as some models call it
    ('{"name": "calculator", "arguments": {"expression": NaN}}', None,
     'the tool call is not valid JSON (NaN is not JSON): {"name": "calculator", "arguments": {"expression": NaN}}'),
    ('{"name": "calculator", "arguments": "{\\"x\\": Infinity}"}', None,
     "the arguments of 'calculator' are a string that is not a JSON object"),
    # Past a float's range Python reads inf, which a trajectory file (JSON) cannot hold.
    ('{"name": "calculator", "arguments": {"x": -1e999}}', None,
     'the tool call is not valid JSON (-1e999 is too large for a number): {"name": "calculator", "arguments": {"x": -1e999}}'),
    # Half an escaped emoji decodes to a lone surrogate, which no UTF-8 file can hold: it used to abort the
    # whole run when the trajectory was written. Both halves are an emoji like any other.
    ('{"name": "calculator", "arguments": {"expression": "2+2 \\ud83d"}}', None,
     "the tool call is not valid JSON (a lone surrogate escape, '\\ud83d'): "
     '{"name": "calculator", "arguments": {"expression": "2+2 \\ud83d"}}'),
    ('{"name": "calculator", "arguments": "{\\"expression\\": \\"\\\\ude00\\"}"}', None,
     "the tool call is not valid JSON (a lone surrogate escape, '\\ude00'): "
     '{"name": "calculator", "arguments": "{\\"expression\\": \\"\\\\ude00\\"}"}'),
    ('{"name": "calculator", "arguments": {"expression": "\\ud83d\\ude00"}}', {"expression": "\U0001F600"}, None),
])
def test_null_arguments_and_numbers_json_has_not(body, arguments, error):
    turn = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert [c.arguments for c in turn.calls] == ([arguments] if arguments is not None else [])
    assert turn.errors == ([error] if error else [])


@pytest.mark.parametrize("expr", ["1e999", "1e999 - 1e999", "-1e101 + 1"])
def test_numbers_past_the_magnitude_cap_are_refused_not_turned_into_inf_or_nan(expr):
    assert calculator(expr) == "Error: a number is out of range (larger than 1e+100)"
