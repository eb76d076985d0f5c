"""Function-call parsers: assistant text → tool calls plus the problems found on the way.

Chosen by name in the recipe (`rollout.parser`). Written here rather than taken from SGLang's
FunctionCallParser because that import costs a GPU-pinned torch, and it silently drops calls to
unknown tools; here every malformed call becomes an error the model is told about.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from agentrl.types import ToolCall


@dataclass
class ParsedTurn:
    """The calls found in one assistant turn, in order, one message per malformed call, and the
    text outside the blocks that parsed into calls (what templates that render `tool_calls`
    themselves put in `content`; a malformed block stays in it, as the model wrote it)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""


OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them.

    A block ends where its JSON object ends, if `</tool_call>` follows it, so arguments that
    contain the closing tag themselves (code that prints it) are read whole; otherwise at the next
    `</tool_call>`. A block with no closing tag before the next `<tool_call>` (or the end) is an
    error of its own, and the calls after it are still read."""
    turn, pieces, cursor = ParsedTurn(), [], 0
    while (start := text.find(OPEN, cursor)) >= 0:
        body_at = start + len(OPEN)
        end, body = _block_end(text, body_at)
        if end is None:  # never closed: left in the content, as the model wrote it
            turn.errors.append(f"a {OPEN} was opened but never closed with {CLOSE}")
            pieces.append(text[cursor:body])
            cursor = body
            continue
        call, error = _call_from_json(text[body_at:body].strip())
        if call is not None:
            turn.calls.append(call)
            pieces.append(text[cursor:start])
        else:
            turn.errors.append(error)
            pieces.append(text[cursor:end])
        cursor = end
    turn.content = ("".join(pieces) + text[cursor:]).strip()
    return turn


def _block_end(text: str, body_at: int) -> tuple[int | None, int]:
    """(where the block ends, where its body ends), or (None, where the next block opens)."""
    at = len(text) - len(text[body_at:].lstrip())
    try:
        _, json_end = _DECODER.raw_decode(text, at)
        after = len(text) - len(text[json_end:].lstrip())
        if text.startswith(CLOSE, after):
            return after + len(CLOSE), json_end
    except (ValueError, RecursionError):
        pass
    close, reopen = text.find(CLOSE, body_at), text.find(OPEN, body_at)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close + len(CLOSE), close
    return None, reopen if reopen >= 0 else len(text)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a number")
    return value


# NaN and Infinity: Python reads them, JSON has none; nor has it numbers past a float's range, which
# Python reads as inf.
_DECODER = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)


def strict_json(text: str) -> Any:
    """`text` as JSON, or a ValueError where Python's reader would take what JSON has not: NaN,
    Infinity, a number past a float's range, an integer of thousands of digits, or a lone surrogate
    escape (half a pair, which no UTF-8 text holds). Nesting beyond the recursion limit raises
    RecursionError."""
    value = _DECODER.decode(text)
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"a lone surrogate escape, {e.object[e.start]!r}") from None
    return value


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    try:
        data: Any = _DECODER.decode(body)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at position {e.pos}): {body[:200]}"
    except (ValueError, RecursionError) as e:  # an integer of 5000 digits, arrays nested 1000 deep, NaN
        return None, f"the tool call is not valid JSON ({json_limit(e)}): {body[:200]}"
    if not isinstance(data, dict):
        return None, "the tool call must be a JSON object with 'name' and 'arguments'"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, "the tool call has no 'name'"
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        try:
            arguments = _DECODER.decode(arguments)
        except (ValueError, RecursionError):
            return None, f"the arguments of '{name}' are a string that is not a JSON object"
    if arguments is None:  # a call of a tool without parameters, as some models write it
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f"the arguments of '{name}' must be a JSON object"
    if nesting_depth(arguments) > MAX_ARGUMENT_DEPTH:  # JSON parses far deeper than a chat template renders
        return None, f"the arguments of '{name}' are nested more than {MAX_ARGUMENT_DEPTH} levels deep"
    try:  # a \ud83d escape alone decodes to half a surrogate pair, which no text (nor a UTF-8 file) can hold
        json.dumps([name, arguments], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return None, f"the tool call is not valid JSON (a lone surrogate escape, {e.object[e.start]!r}): {body[:200]}"
    return ToolCall(name=name, arguments=arguments), ""


MAX_ARGUMENT_DEPTH = 64


def nesting_depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def json_limit(error: ValueError | RecursionError) -> str:
    """Python's reason for refusing JSON that is well-formed but past one of its limits."""
    return "nested too deeply" if isinstance(error, RecursionError) else str(error).split(";")[0]


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    if name not in PARSERS:
        raise KeyError(name)
    return PARSERS[name]
