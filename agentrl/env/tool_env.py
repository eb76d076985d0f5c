"""ToolEnv: one episode's tool instances, and the turn from parsed calls to tool messages.

Everything that can go wrong with a tool (an unknown name, bad arguments, an exception, a hang,
garbage or a megabyte of output, more calls than allowed) becomes a tool message the model reads
and a counted metric; nothing here raises into the episode loop.

Counters: every call the model made counts in `tool_calls` (those over the per-turn limit too, as
errors), and `tool_errors` counts the calls among them that did not return a result, so
`tool_errors / tool_calls` is at most 1. Failures of `create`, `reward` and `release`, which no call
made, count in `tool_lifecycle_errors`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

from agentrl.tools.base import Tool, ToolResult, argument_problem, as_text, finite_number, tool_name
from agentrl.tools.parsers import ParsedTurn
from agentrl.types import Task, ToolCall


@dataclass
class ToolLimits:
    timeout_s: float = 10.0
    max_calls_per_turn: int = 4


class ToolEnv:
    """Created per episode; call `start`, then `run_turn` per assistant turn, then `finish`."""

    def __init__(self, tools: list[Tool], limits: ToolLimits, truncate: Callable[[str], tuple[str, bool]]):
        self.tools = {tool_name(t): t for t in tools}
        self.limits = limits
        self.truncate = truncate  # text → (text within the token budget, whether it was cut)
        self.instance_ids: dict[str, str] = {}
        self.metrics: dict[str, float] = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0,
                                          "tool_lifecycle_errors": 0, "parse_errors": 0, "tool_truncations": 0,
                                          "tool_invalid_results": 0, "tool_latency_s": 0.0}
        self.step_rewards: list[float] = []

    async def start(self, episode_id: str, task: Task) -> None:
        for name, t in self.tools.items():
            kwargs = {"ground_truth": task.answer, **task.tool_kwargs.get(name, {})}
            try:
                self.instance_ids[name] = await asyncio.wait_for(
                    t.create(f"{episode_id}/{name}", **kwargs), self.limits.timeout_s) or f"{episode_id}/{name}"
            except Exception:  # a tool that cannot start is reported at its first call
                self.metrics["tool_lifecycle_errors"] += 1

    async def run_turn(self, parsed: ParsedTurn) -> list[dict[str, Any]]:
        """Tool messages answering one assistant turn: calls in order, then parse errors."""
        self.metrics["parse_errors"] += len(parsed.errors)
        allowed = parsed.calls[: self.limits.max_calls_per_turn]
        # return_exceptions: gather then returns only when every call has ended, so nothing after
        # it (the next turn, release) overlaps a call still running. Cancelling this turn cancels
        # the calls and still waits for them.
        results = await asyncio.gather(*(self._run_call(c) for c in allowed), return_exceptions=True)
        messages = [{"role": "tool", "name": c.name, "content": self._unexpected(c, r)
                     if isinstance(r, BaseException) else r} for c, r in zip(allowed, results)]
        for call in parsed.calls[self.limits.max_calls_per_turn:]:
            self._count(call.name, "calls")
            self._count(call.name, "errors")
            messages.append({"role": "tool", "name": call.name, "content":
                             f"Error: not run; at most {self.limits.max_calls_per_turn} tool calls per turn."})
        for error in parsed.errors:
            messages.append({"role": "tool", "name": "parse_error", "content": f"Error: {error}"})
        return messages

    async def _run_call(self, call: ToolCall) -> str:
        """The text the model reads for one call; whatever happens, never raises."""
        self._count(call.name, "calls")
        problem = self._check_call(call)
        if problem:
            self._count(call.name, "errors")
            return f"Error: {problem}"
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(
                self.tools[call.name].execute(self.instance_ids[call.name], call.arguments), self.limits.timeout_s)
            text = self._result_text(call.name, result)
        except asyncio.TimeoutError:
            self.metrics["tool_timeouts"] += 1
            self._count(call.name, "errors")
            return f"Error: {call.name} did not finish within {self.limits.timeout_s:g} s."
        except Exception as e:
            self._count(call.name, "errors")
            return _failure(call.name, e)
        finally:
            latency = time.perf_counter() - started
            self.metrics["tool_latency_s"] += latency
            self.metrics[f"tool/{call.name}/latency_s"] = self.metrics.get(f"tool/{call.name}/latency_s", 0.0) + latency
        return text

    def _unexpected(self, call: ToolCall, error: BaseException) -> str:
        """The message for a call that ended past `_run_call`'s own handling (a tool raising
        CancelledError, which is no Exception)."""
        self._count(call.name, "errors")
        return _failure(call.name, error)

    def _count(self, name: str, what: str) -> None:
        """Run totals (tool_calls, tool_errors) and per-tool counts (tool/<name>/calls, .../errors)."""
        self.metrics[f"tool_{what}"] += 1
        if name in self.tools:  # unknown names stay out of the per-tool keys: the model invents them
            key = f"tool/{name}/{what}"
            self.metrics[key] = self.metrics.get(key, 0.0) + 1

    def _check_call(self, call: ToolCall) -> str | None:
        if call.name not in self.tools:
            return f"unknown tool '{call.name}'; available: {', '.join(sorted(self.tools)) or 'none'}."
        if call.name not in self.instance_ids:
            return f"{call.name} could not be started for this episode."
        return argument_problem(self.tools[call.name], call.arguments)

    def _result_text(self, name: str, result: Any) -> str:
        """A tool's return value as message text within the token budget. A reward or metric that
        is not a finite number is dropped and counted (tool_invalid_results); the text still goes
        to the model."""
        text = as_text(result.text if isinstance(result, ToolResult) else result)
        if isinstance(result, ToolResult):
            reward = finite_number(result.reward)
            if result.reward is not None and reward is None:
                self.metrics["tool_invalid_results"] += 1
            elif reward is not None:
                self.step_rewards.append(reward)
            for key, value in (result.metrics.items() if isinstance(result.metrics, dict) else ()):
                number = finite_number(value)
                if number is None or not isinstance(key, str):
                    self.metrics["tool_invalid_results"] += 1
                    continue
                self.metrics[key] = self.metrics.get(key, 0.0) + number
        text, cut = self.truncate(text)
        self.metrics["tool_truncations"] += int(cut)
        return text

    async def finish(self) -> float:
        """Release every instance; returns the sum of the tools' final rewards."""
        total = 0.0
        for name, instance_id in self.instance_ids.items():
            t = self.tools[name]
            try:  # a failing reward() must not skip release(): that would leak the instance's state
                reward = await asyncio.wait_for(t.reward(instance_id), self.limits.timeout_s)
                number = finite_number(reward)
                if reward is not None and number is None:
                    self.metrics["tool_invalid_results"] += 1
                total += number or 0.0
            except Exception:
                self.metrics["tool_lifecycle_errors"] += 1
            try:
                await asyncio.wait_for(t.release(instance_id), self.limits.timeout_s)
            except Exception:
                self.metrics["tool_lifecycle_errors"] += 1
        return total


def _failure(name: str, error: BaseException) -> str:
    detail = _describe(error)
    return f"Error: {name} failed: {type(error).__name__}{': ' + detail if detail else ''}"


def _describe(error: BaseException) -> str:
    try:
        return as_text(str(error))
    except Exception:  # noqa: BLE001 - a plug-in's exception may fail to print
        return "<unprintable>"
