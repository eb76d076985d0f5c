"""ToolEnv: one episode's tool instances, and the turn from parsed calls to tool messages.

Everything that can go wrong with a tool (an unknown name, bad arguments, an exception, a hang,
garbage or a megabyte of output, more calls than allowed) becomes a tool message the model reads
and a counted metric; nothing here raises into the episode loop.

Counters: every call the model made counts in `tool_calls` (those over the per-turn limit too, as
errors), and `tool_errors` counts the calls among them that did not return a result, so
`tool_errors / tool_calls` is at most 1. Failures of `create`, `reward` and `release`, which no call
made, count in `tool_lifecycle_errors`. Every call into a tool goes through `call_plugin`: its
timeout fires even for a tool that ignores cancellation, and a tool's `SystemExit`, own
`CancelledError` or other BaseException of its own fails that call only. A tool's metric may not
reuse a counter's name (those above, and `tool/<name>/...`) or one the episode sets
(`types.EPISODE_METRICS`: `error`, `turns`, `outcome_reward`, ...): it is dropped and counted in
`tool_invalid_results`.

Malformed call blocks are answered one message each up to the per-turn call limit, and the rest
in one message: a turn of 60 empty `<tool_call>{}</tool_call>` blocks used to add 60 error messages
to the context (each longer than the block it answers).
"""

from __future__ import annotations

import asyncio
import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from agentrl.finite import finite_number
from agentrl.tools.base import REWARD_LIMIT, Tool, ToolResult, argument_problem, as_text, tool_name
from agentrl.tools.parsers import ParsedTurn
from agentrl.tools.threads import CallTimeout, call_plugin, failure_text
from agentrl.types import EPISODE_METRICS, Task, ToolCall


@dataclass
class ToolLimits:
    timeout_s: float = 10.0
    max_calls_per_turn: int = 4
    parallel_calls: bool = True  # a turn's calls run at once; False: one after another, in the order written


class ToolEnv:
    """Created per episode; call `start`, then `run_turn` per assistant turn, then `finish`."""

    def __init__(self, tools: list[Tool], limits: ToolLimits, truncate: Callable[[str], tuple[str, bool]]):
        self.tools = {tool_name(t): t for t in tools}
        self.limits = limits
        self.truncate = truncate  # text → (text within the token budget, whether it was cut)
        self.instance_ids: dict[str, str] = {}
        self.start_errors: dict[str, str] = {}  # why a tool could not be started, shown at its first call
        self.metrics: dict[str, float] = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0,
                                          "tool_lifecycle_errors": 0, "parse_errors": 0, "tool_truncations": 0,
                                          "tool_invalid_results": 0, "tool_latency_s": 0.0}
        self.counters = frozenset(self.metrics) | EPISODE_METRICS  # names a tool's metrics may not take
        self.step_rewards: list[float] = []

    async def start(self, episode_id: str, task: Task) -> None:
        for name, t in self.tools.items():
            # A copy per episode: a tool that changes what it was given (a cart it fills) must not
            # hand that to the group's other episodes and to the task's later steps.
            kwargs = copy.deepcopy({"ground_truth": task.answer, **task.tool_kwargs.get(name, {})})
            instance_id = f"{episode_id}/{name}"
            try:
                self.instance_ids[name] = await call_plugin(t.create(instance_id, **kwargs), self.limits.timeout_s,
                                                            f"the tool '{name}' (create)") or instance_id
            except asyncio.CancelledError:  # the episode is cancelled: what the create made is still freed
                await self._quietly(t.release(instance_id))
                raise
            except Exception as e:  # a tool that cannot start is reported at its first call
                self.metrics["tool_lifecycle_errors"] += 1
                self.start_errors[name] = (f"TimeoutError: no answer within {self.limits.timeout_s:g} s"
                                           if isinstance(e, CallTimeout) else failure_text(e))
                # What a failed create made before it failed is the tool's to free, as after any episode.
                await self._quietly(t.release(instance_id))

    async def run_turn(self, parsed: ParsedTurn) -> list[dict[str, Any]]:
        """Tool messages answering one assistant turn: calls in order, then parse errors."""
        self.metrics["parse_errors"] += len(parsed.errors)
        allowed = parsed.calls[: self.limits.max_calls_per_turn]
        # return_exceptions: gather then returns only when every call has ended, so nothing after
        # it (the next turn, release) overlaps a call still running. Cancelling this turn cancels
        # the calls and still waits for them.
        if self.limits.parallel_calls:
            results = await asyncio.gather(*(self._run_call(c) for c in allowed), return_exceptions=True)
        else:  # a stateful tool's second call sees what the first did ("write the file", then "run it")
            results = []
            for c in allowed:
                results += await asyncio.gather(self._run_call(c), return_exceptions=True)
        messages = [{"role": "tool", "name": c.name, "content": self._unexpected(c, r)
                     if isinstance(r, BaseException) else r} for c, r in zip(allowed, results)]
        for call in parsed.calls[self.limits.max_calls_per_turn:]:
            self._count(call.name, "calls")
            self._count(call.name, "errors")
            messages.append({"role": "tool", "name": call.name, "content":
                             f"Error: not run; at most {self.limits.max_calls_per_turn} tool calls per turn."})
        shown = parsed.errors[: self.limits.max_calls_per_turn]
        for error in shown:
            messages.append({"role": "tool", "name": "parse_error", "content": f"Error: {error}"})
        if len(parsed.errors) > len(shown):
            messages.append({"role": "tool", "name": "parse_error", "content":
                             f"Error: {len(parsed.errors) - len(shown)} more malformed tool calls were not read; "
                             f"at most {self.limits.max_calls_per_turn} are answered per turn."})
        for message in messages:  # results, and errors too: an exception's message can be a megabyte
            message["content"], cut = self.truncate(message["content"])
            self.metrics["tool_truncations"] += int(cut)
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
            # A copy: a tool that edits its arguments in place must not rewrite the recorded call.
            arguments = copy.deepcopy(call.arguments)
            result = await call_plugin(self.tools[call.name].execute(self.instance_ids[call.name], arguments),
                                       self.limits.timeout_s, f"the tool '{call.name}' (execute)")
            text = self._result_text(call.name, result)
        except CallTimeout:
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
        """The message for a call that ended past `_run_call`'s own handling: a BaseException
        `call_plugin` does not convert (KeyboardInterrupt on this thread)."""
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
            return f"{call.name} could not be started for this episode ({self.start_errors[call.name]})."
        return argument_problem(self.tools[call.name], call.arguments)

    def _result_text(self, name: str, result: Any) -> str:
        """A tool's return value as message text (run_turn cuts it to the token budget). A metric
        that is not a finite number, or a reward that is not one within REWARD_LIMIT, is dropped
        and counted (tool_invalid_results); the text still goes to the model."""
        text = as_text(result.text if isinstance(result, ToolResult) else result)
        if isinstance(result, ToolResult):
            dropped = result.dropped  # by a tool server, before the result came here
            self.metrics["tool_invalid_results"] += dropped if isinstance(dropped, int) and dropped > 0 else 0
            reward = finite_number(result.reward, REWARD_LIMIT)
            if result.reward is not None and reward is None:
                self.metrics["tool_invalid_results"] += 1
            elif reward is not None:
                self.step_rewards.append(reward)
            for key, value in (result.metrics.items() if isinstance(result.metrics, dict) else ()):
                number = finite_number(value)
                named = isinstance(key, str) and key not in self.counters and not key.startswith("tool/")
                total = self.metrics.get(key, 0.0) + number if named and number is not None else math.nan
                if not math.isfinite(total):  # no number, a taken name, or a sum that overflows (NaN once averaged)
                    self.metrics["tool_invalid_results"] += 1
                    continue
                self.metrics[key] = total
        return text

    async def finish(self) -> float:
        """Release every instance; returns the sum of the tools' final rewards. Each instance is
        released whatever its reward() or another tool's release() did, and when the episode is
        cancelled meanwhile, the instances not released yet still are before the cancellation
        goes on."""
        total = 0.0
        pending = list(self.instance_ids.items())
        try:
            while pending:
                name, instance_id = pending[0]
                t = self.tools[name]
                try:
                    reward = await call_plugin(t.reward(instance_id), self.limits.timeout_s,
                                               f"the tool '{name}' (reward)")
                    number = finite_number(reward, REWARD_LIMIT)
                    if reward is not None and number is None:
                        self.metrics["tool_invalid_results"] += 1
                    total += number or 0.0
                except Exception:
                    self.metrics["tool_lifecycle_errors"] += 1
                pending.pop(0)  # from here on its release has begun
                self.metrics["tool_lifecycle_errors"] += not await self._quietly(t.release(instance_id))
        except asyncio.CancelledError:
            for name, instance_id in pending:
                await self._quietly(self.tools[name].release(instance_id))
            raise
        return total

    async def _quietly(self, coro: Any) -> bool:
        """Run a release; whether it succeeded (it never raises but for this episode's cancellation)."""
        try:
            await call_plugin(coro, self.limits.timeout_s)
            return True
        except Exception:
            return False


def _failure(name: str, error: BaseException) -> str:
    return f"Error: {name} failed: {as_text(failure_text(error))}"
