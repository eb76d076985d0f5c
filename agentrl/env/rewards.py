"""Outcome rewards: functions `(task, messages) -> float` named in the recipe as `module:attr`."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from agentrl.errors import ConfigError
from agentrl.tools.builtin.gsm8k import answer_matches, ground_truth_number, parse_number
from agentrl.tools.loader import resolve_reference
from agentrl.tools.parsers import parse_hermes
from agentrl.types import Task

RewardFn = Callable[[Task, list[dict[str, Any]]], float]


def final_answer_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last assistant message, or "" when that message called tools: structured
    calls, a call block in its text (one cut off by the length limit, or malformed and answered
    by a tool message as an error) are not an answer. An episode that ran out of turns or context
    while calling tools gave none, and must not score on the numbers in its calls' arguments.
    Nor is a message the token limit cut off (`truncated`, as the episode loop marks it): "The
    total is 120" cut after "12" is no answer of 12. Content given as parts (OpenAI's list of `{"type": "text", "text": ...}`) is their text."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if message.get("role") != "assistant":
            continue
        if message.get("truncated"):
            return ""
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text") or "" for part in content
                              if isinstance(part, dict) and part.get("type") == "text")
        content = content if isinstance(content, str) else ""
        answered_by_tool = i + 1 < len(messages) and messages[i + 1].get("role") == "tool"
        parsed = parse_hermes(content)
        if message.get("tool_calls") or answered_by_tool or parsed.calls or parsed.errors:
            return ""
        return content
    return ""


def gsm8k_reward(task: Task, messages: list[dict[str, Any]]) -> float:
    """1.0 when the last number of the final assistant message equals the '#### answer', else 0.0."""
    if not task.answer:
        return 0.0
    truth = ground_truth_number(task.answer)
    submitted = parse_number(final_answer_text(messages))
    if truth is None or submitted is None:
        return 0.0
    return 1.0 if answer_matches(submitted, truth, 1e-6) else 0.0


def load_reward_fn(ref: str | None) -> RewardFn | None:
    if ref is None:
        return None
    try:
        fn = resolve_reference(ref, group="agentrl.rewards")
    except ValueError as e:
        raise ConfigError(f"reward.function: {e}") from None
    if not callable(fn):
        raise ConfigError(f"reward.function: '{ref}' is not callable")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ConfigError(f"reward.function: '{ref}' is async; a reward function is called as "
                          f"reward(task, messages) -> float. A judge that awaits belongs in an interaction "
                          f"(rollout.interaction_config), whose score reward.interaction_scores adds")
    try:  # found before any model loads, not after a whole rollout whose every episode failed
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ConfigError(f"reward.function: '{ref}' must take (task, messages), not "
                          f"{inspect.signature(fn)}") from None
    except ValueError:  # no signature to read (some builtins): it is called as it is
        pass
    return fn
