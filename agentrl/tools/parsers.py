"""Function-call parsers: assistant text → tool calls plus the problems found on the way.

Chosen by name in the recipe (`rollout.parser`). Written here rather than taken from SGLang's
FunctionCallParser because that import costs a GPU-pinned torch, and it silently drops calls to
unknown tools; here every malformed call becomes an error the model is told about.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from agentrl.types import ToolCall


@dataclass
class ParsedTurn:
    """The calls found in one assistant turn, in order, one message per malformed call, and the
    text outside the call blocks (what templates that render `tool_calls` themselves put in
    `content`)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""


_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them."""
    turn = ParsedTurn()
    for match in _HERMES_RE.finditer(text):
        call, error = _call_from_json(match.group(1).strip())
        if call is not None:
            turn.calls.append(call)
        else:
            turn.errors.append(error)
    tail = _HERMES_RE.sub("", text)
    turn.content = tail.strip()
    if "<tool_call>" in tail:
        turn.errors.append("a <tool_call> was opened but never closed with </tool_call>")
    return turn


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    try:
        data: Any = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at position {e.pos}): {body[:200]}"
    except (ValueError, RecursionError) as e:  # an integer of 5000 digits, arrays nested 1000 deep
        return None, f"the tool call is not valid JSON ({_json_limit(e)}): {body[:200]}"
    if not isinstance(data, dict):
        return None, "the tool call must be a JSON object with 'name' and 'arguments'"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, "the tool call has no 'name'"
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None, f"the arguments of '{name}' are a string that is not a JSON object"
    if not isinstance(arguments, dict):
        return None, f"the arguments of '{name}' must be a JSON object"
    return ToolCall(name=name, arguments=arguments), ""


def _json_limit(error: ValueError | RecursionError) -> str:
    """Python's reason for refusing JSON that is well-formed but past one of its limits."""
    return "nested too deeply" if isinstance(error, RecursionError) else str(error).split(";")[0]


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    if name not in PARSERS:
        raise KeyError(name)
    return PARSERS[name]
