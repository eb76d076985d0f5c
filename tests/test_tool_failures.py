"""Misbehaving tools and malformed calls become tool messages and metrics; the episode goes on."""

from __future__ import annotations

import asyncio
import json

from agentrl.env.tool_env import ToolLimits
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.base import tool
from agentrl.tools.builtin.calculator import calculator
from agentrl.tools.parsers import parse_hermes
from agentrl.types import Task
from tests.conftest import ScriptedEngine

FINAL = "The answer is 42."


@tool
def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Ignored.
    """
    raise RuntimeError(f"boom: {reason}")


@tool
async def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke up"


@tool
def flood(size: int) -> str:
    """Returns a lot of text.

    Args:
        size: Characters.
    """
    return "x" * size


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run(tokenizer, first_turn: str, **settings):
    engine = ScriptedEngine(tokenizer, [first_turn, FINAL])
    settings.setdefault("tool_limits", ToolLimits(timeout_s=0.3, max_calls_per_turn=2))
    runner = EpisodeRunner(engine, tokenizer, [calculator, explode, sleepy, flood], parse_hermes,
                           EpisodeSettings(max_tool_output_tokens=64, **settings))
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    # The episode went on to the final answer and ended normally, with an exact trainable tail.
    assert traj.finish == "stop" and traj.metrics["turns"] == 2
    assert traj.messages[-1] == {"role": "assistant", "content": FINAL}
    assert traj.loss_mask[-len(engine.turns[1]):] == [1] * len(engine.turns[1])
    return traj, [m for m in traj.messages if m["role"] == "tool"]


def test_raising_tool(tokenizer):
    traj, tools = run(tokenizer, call("explode", reason="r1"))
    assert tools[0]["content"] == "Error: explode failed: RuntimeError: boom: r1"
    assert traj.metrics["tool_errors"] == 1 and traj.metrics["tool_calls"] == 1


def test_tool_past_its_timeout(tokenizer):
    traj, tools = run(tokenizer, call("sleepy", seconds=5))
    assert tools[0]["content"] == "Error: sleepy did not finish within 0.3 s."
    assert traj.metrics["tool_timeouts"] == 1 and traj.metrics["tool_errors"] == 1
    assert traj.metrics["episode_s"] < 3  # the 5 s sleep was abandoned


def test_megabyte_of_output_is_truncated_in_tokens(tokenizer):
    traj, tools = run(tokenizer, call("flood", size=1_000_000))
    text = tools[0]["content"]
    assert text.endswith("\n[output truncated to 64 tokens]")
    body = text[: -len("\n[output truncated to 64 tokens]")]
    assert len(tokenizer(body, add_special_tokens=False)["input_ids"]) <= 64 and set(body) == {"x"}
    assert traj.metrics["tool_truncations"] == 1 and traj.metrics["tool_errors"] == 0
    assert len(traj.token_ids) < 1000


def test_broken_json_in_tool_call(tokenizer):
    traj, tools = run(tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"\n</tool_call>')
    assert tools[0]["name"] == "parse_error"
    assert tools[0]["content"].startswith("Error: the tool call is not valid JSON (")
    assert traj.metrics["parse_errors"] == 1 and traj.metrics["tool_calls"] == 0


def test_unknown_tool_and_bad_arguments(tokenizer):
    traj, tools = run(tokenizer, call("search", query="x") + call("calculator", expr="1+1"))
    assert tools[0]["content"] == "Error: unknown tool 'search'; available: calculator, explode, flood, sleepy."
    assert tools[1]["content"] == "Error: bad arguments for calculator: 'expression' is a required property."
    assert traj.metrics["tool_errors"] == 2


def test_calls_over_the_per_turn_limit_get_an_error(tokenizer):
    traj, tools = run(tokenizer, call("calculator", expression="1+1") * 3)
    assert [t["content"] for t in tools] == ["2", "2", "Error: not run; at most 2 tool calls per turn."]
    assert traj.metrics["tool_calls"] == 2 and traj.metrics["tool_errors"] == 1


def test_garbage_return_value_becomes_text(tokenizer):
    @tool
    def weird(n: int) -> dict:
        """Returns a dict.

        Args:
            n: A number.
        """
        return {"n": n, "items": [1, 2]}

    engine = ScriptedEngine(tokenizer, [call("weird", n=3), FINAL])
    runner = EpisodeRunner(engine, tokenizer, [weird], parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    assert traj.messages[2]["content"] == '{"n": 3, "items": [1, 2]}' and traj.finish == "stop"


def test_engine_failure_ends_episode_with_error(tokenizer):
    class BrokenEngine(ScriptedEngine):
        async def generate(self, token_ids, sampling):
            raise RuntimeError("engine down")

    runner = EpisodeRunner(BrokenEngine(tokenizer, []), tokenizer, [calculator], parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    assert traj.finish == "error" and traj.error == "RuntimeError: engine down"
    assert sum(traj.loss_mask) == 0
