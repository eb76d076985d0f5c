"""Tool failures that used to escape their call: an exception's megabyte message, a cancelled
release, rewards too large for float32 training, a plug-in that exits or interrupts, a tolerance
that marks every answer wrong, a lone surrogate in a tool server's error, arguments nested deeper
than a chat template renders. Each now stays a tool message, a counted metric or a named error.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from fastapi.testclient import TestClient

from agentrl.env.gsm8k import GSM8KInteraction
from agentrl.errors import ConfigError
from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.finite import finite_number
from agentrl.rollout.chat import ChatRenderer
from agentrl.rollout.episode import checked_total, outcome_reward
from agentrl.tools.base import REWARD_LIMIT, ToolResult, tool
from agentrl.tools.builtin.gsm8k import CheckAnswer
from agentrl.tools.loader import load_tools
from agentrl.tools.parsers import MAX_ARGUMENT_DEPTH, ParsedTurn, parse_hermes
from agentrl.tools.server import ServerSettings, create_app
from agentrl.types import Task, ToolCall

TASK = Task(id="t", prompt="What is 6 * 7?", answer="42")


@tool
def verbose_failure(size: int) -> str:
    """Fails with a long message.

    Args:
        size: Characters in the message.
    """
    raise RuntimeError("x" * size)


@tool
def interrupted(command: str) -> str:
    """Wraps a library that turns its own abort into KeyboardInterrupt.

    Args:
        command: Ignored.
    """
    raise KeyboardInterrupt


@tool
def huge_reward(value: float) -> ToolResult:
    """Returns a reward.

    Args:
        value: The reward.
    """
    return ToolResult("ok", reward=value)


def run_turn(tools, calls, truncate=lambda text: (text, False)) -> tuple[list[dict], ToolEnv]:
    async def go():
        env = ToolEnv(tools, ToolLimits(timeout_s=5), truncate)
        await env.start("e", TASK)
        messages = await env.run_turn(ParsedTurn(calls=calls))
        await env.finish()
        return messages, env

    return asyncio.run(go())


def test_an_errors_message_is_cut_to_the_output_budget_like_a_result(tokenizer):
    """A tool that raised with a 1 MB message handed all of it to the model, which ended the
    episode at its context limit, while the same text returned was cut to the budget."""
    renderer = ChatRenderer(tokenizer, [])
    [message], env = run_turn([verbose_failure], [ToolCall("verbose_failure", {"size": 1_000_000})],
                              lambda text: renderer.truncate(text, 40))
    assert message["content"].startswith("Error: verbose_failure failed: RuntimeError: xxx")
    assert len(tokenizer(message["content"])["input_ids"]) <= 60 and len(message["content"]) < 1000
    assert env.metrics["tool_truncations"] == 1 and env.metrics["tool_errors"] == 1


def test_a_tools_keyboard_interrupt_fails_its_call_not_the_run():
    [message], env = run_turn([interrupted], [ToolCall("interrupted", {"command": "x"})])
    assert message["content"] == "Error: interrupted failed: KeyboardInterrupt"
    assert env.metrics["tool_errors"] == 1


def test_one_element_tensors_and_arrays_are_numbers_and_others_are_not():
    """A judge's `torch.sigmoid(logit)` was dropped as no number while the reward function's
    check took the same value."""
    import numpy as np
    import torch

    assert finite_number(torch.tensor(0.5)) == 0.5 and finite_number(torch.tensor([[0.25]])) == 0.25
    assert finite_number(np.array([2.0])) == 2.0 and finite_number(np.float32(1.5)) == 1.5
    assert finite_number(torch.tensor(1e39, dtype=torch.float64), REWARD_LIMIT) is None
    for invalid in (torch.tensor([0.5, 0.5]), torch.tensor(True), np.array(float("nan")), np.array([]), "0.5"):
        assert finite_number(invalid) is None, invalid


def test_a_reward_as_a_decimal_or_past_a_floats_range_is_judged_alike_everywhere():
    """A Decimal counted from the reward function but was dropped as a tool's reward; an int past
    a float's range ended the reward function's check with a bare OverflowError."""
    from decimal import Decimal

    assert finite_number(Decimal("0.5"), REWARD_LIMIT) == 0.5 == outcome_reward(lambda t, m: Decimal("0.5"), TASK, [])
    assert finite_number(Decimal("NaN")) is None and finite_number(10**400) is None
    with pytest.raises(ValueError, match=r"^the reward function returned 1000.*0, not a finite number$"):
        outcome_reward(lambda task, messages: 10**400, TASK, [])


def test_rewards_beyond_the_limit_are_dropped_and_counted():
    """Rewards of 1e39 passed as finite, became infinity in float32 and NaN advantages."""
    calls = [ToolCall("huge_reward", {"value": v}) for v in (1e39, 2.5, -REWARD_LIMIT * 10)]
    messages, env = run_turn([huge_reward], calls)
    assert [m["content"] for m in messages] == ["ok"] * 3
    assert env.step_rewards == [2.5] and env.metrics["tool_invalid_results"] == 2
    assert finite_number(1e39) == 1e39 and finite_number(1e39, REWARD_LIMIT) is None  # metrics may be large
    with pytest.raises(ValueError, match=r"^the reward function returned 10000000000.0, beyond ±1e\+09 "
                                         r"\(the largest reward training takes\)$"):
        outcome_reward(lambda task, messages: 1e10, TASK, [])
    assert checked_total(-REWARD_LIMIT) == -REWARD_LIMIT
    with pytest.raises(ValueError, match=r"^the episode's rewards sum to 1500000000.0, beyond ±1e\+09"):
        checked_total(0.75 * REWARD_LIMIT * 2)


class Lifecycle:
    """A class tool whose reward() waits long enough for the episode to be cancelled meanwhile."""

    log: list[str] = []

    def __init__(self, name: str):
        self.schema = {"type": "function", "function": {"name": name, "description": "d",
                                                        "parameters": {"type": "object", "properties": {}}}}

    async def create(self, instance_id, **kwargs):
        Lifecycle.log.append(f"create {instance_id}")
        return instance_id

    async def execute(self, instance_id, arguments):
        return "ok"

    async def reward(self, instance_id):
        await asyncio.sleep(10)
        return 1.0

    async def release(self, instance_id):
        Lifecycle.log.append(f"release {instance_id}")


def test_an_episode_cancelled_while_it_finishes_still_releases_every_instance():
    Lifecycle.log = []

    async def go():
        env = ToolEnv([Lifecycle("a"), Lifecycle("b")], ToolLimits(timeout_s=30), lambda t: (t, False))
        await env.start("e", TASK)
        finishing = asyncio.create_task(env.finish())
        await asyncio.sleep(0.1)  # inside a.reward()
        finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing

    asyncio.run(go())
    assert Lifecycle.log == ["create e/a", "create e/b", "release e/a", "release e/b"]


@pytest.mark.parametrize("tolerance", [math.nan, -1.0, math.inf])
def test_a_tolerance_that_would_mark_every_answer_wrong_is_refused(tolerance):
    for cls in (CheckAnswer, GSM8KInteraction):
        with pytest.raises(ValueError, match=f"^tolerance must be a finite number of at least 0, got {tolerance}$"):
            cls(tolerance=tolerance)


PLUGIN_EXITS_ON_IMPORT = '''
import argparse
argparse.ArgumentParser().parse_args(["--no-such-flag"])
'''

PLUGIN_EXITS_IN_INIT = '''
import sys

class Search:
    def __init__(self):
        sys.exit("search: no endpoint configured")
'''


PLUGIN_LOOKS_UP_A_SETTING = '''
import os

class Search:
    def __init__(self):
        self.key = dict(os.environ)["AGENTRL_TEST_NO_SUCH_VARIABLE"]
'''

PLUGIN_REFUSES_ITS_CONFIG = '''
class Search:
    def __init__(self):
        raise ValueError("endpoint must be an https URL")
'''


@pytest.mark.parametrize("source,entry,message", [
    (PLUGIN_EXITS_ON_IMPORT, "exits_plugin:anything", "cannot import module 'exits_plugin' (SystemExit: 2)"),
    (PLUGIN_EXITS_IN_INIT, "exits_plugin:Search",
     "constructing exits_plugin:Search with config {} failed: SystemExit: search: no endpoint configured"),
    # Named, or the message would end "failed: 'AGENTRL_TEST_NO_SUCH_VARIABLE'"
    (PLUGIN_LOOKS_UP_A_SETTING, "exits_plugin:Search",
     "constructing exits_plugin:Search with config {} failed: KeyError: 'AGENTRL_TEST_NO_SUCH_VARIABLE'"),
    # A constructor's ValueError is its own sentence about its config: kept as it is
    (PLUGIN_REFUSES_ITS_CONFIG, "exits_plugin:Search",
     "constructing exits_plugin:Search with config {} failed: endpoint must be an https URL\n"),
], ids=["exits_on_import", "exits_in_init", "key_error_in_init", "value_error_in_init"])
def test_a_plugin_that_exits_or_raises_while_loading_is_a_named_error(tmp_path, monkeypatch, source, entry, message):
    (tmp_path / "exits_plugin.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "exits_plugin", raising=False)
    tools = tmp_path / "tools.yaml"
    tools.write_text(f"tools:\n  - class: {entry}\n")
    with pytest.raises(ConfigError) as error:
        load_tools(str(tools))
    assert message in str(error.value) + "\n" and str(tools) in str(error.value)


@tool
def missing_report(name: str) -> str:
    """Reads a report.

    Args:
        name: The report's file name.
    """
    raise LookupError(f"no report named {name}")


def test_a_tool_servers_answers_escape_lone_surrogates():
    """A file name read with Python's defaults can hold a lone surrogate; in an error it made the
    tool server answer 500 (JSON cannot carry it), and clients retried a call that had simply failed."""
    app = create_app([missing_report], ServerSettings(token="t"))
    with TestClient(app) as client:
        auth = {"Authorization": "Bearer t"}
        instance = client.post("/instances", json={"tool": "missing_report"}, headers=auth).json()["instance_id"]
        body = json.dumps({"arguments": {"name": "caf\udce9.txt"}})  # escaped in JSON, a lone surrogate in Python
        r = client.post(f"/instances/{instance}/execute", content=body, headers={**auth, "content-type":
                                                                                  "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["error"] == "LookupError: no report named caf\\udce9.txt"
        unknown = client.post("/instances", content=json.dumps({"tool": "x\udcff"}),
                              headers={**auth, "content-type": "application/json"})
        assert unknown.status_code == 404 and unknown.json()["detail"].startswith("unknown tool 'x\\udcff'")


def test_arguments_nested_deeper_than_a_template_renders_are_a_parse_error():
    """Arguments 600 levels deep parsed, then the chat template's recursion failed the episode."""
    nested: object = 1
    for _ in range(600):
        nested = [nested]
    turn = parse_hermes('<tool_call>\n' + json.dumps({"name": "f", "arguments": {"x": nested}}) + '\n</tool_call>')
    assert turn.calls == [] and turn.errors == [f"the arguments of 'f' are nested more than {MAX_ARGUMENT_DEPTH} "
                                                "levels deep"]
    shallow: object = 1
    for _ in range(MAX_ARGUMENT_DEPTH - 1):
        shallow = [shallow]
    assert parse_hermes('<tool_call>\n' + json.dumps({"name": "f", "arguments": {"x": shallow}}) +
                        '\n</tool_call>').calls[0].arguments == {"x": shallow}


SCHEMA = '''
tools:
  - class: calculator
    schema:
      type: function
      function:
        name: calc
        description: Arithmetic.
        parameters: {type: object, properties: %s, required: %s}
'''


@pytest.mark.parametrize("properties,required,problem", [
    ("{expr: {type: string}}", "[expr]", "the schema of 'calc' has properties ['expr'] that calculator() takes no "
                                         "parameter for (it takes ['expression'])"),
    ("{}", "[]", "calculator() needs ['expression'], which the schema of 'calc' does not offer"),
    # The model may leave it out, and the call fails with a TypeError.
    ("{expression: {type: string}}", "[]", "calculator() has no default for ['expression'], which the schema of "
                                           "'calc' does not list in 'required'"),
    # No call can give it: every call is refused, for a name the model cannot see described.
    ("{expression: {type: string}}", "[expression, note]", "the schema of 'calc' requires ['note'], which it has no "
                                                           "property for (its properties: ['expression'])"),
])
def test_a_schema_whose_calls_cannot_reach_the_function_is_refused_at_load(tmp_path, properties, required, problem):
    """The run used to start with such a file, and its calls failed with a TypeError, or were all refused."""
    path = tmp_path / "tools.yaml"
    path.write_text(SCHEMA % (properties, required))
    with pytest.raises(ConfigError) as error:
        load_tools(str(path))
    assert str(error.value) == f"{path}: tool 'calc' (#1): {problem}"
    path.write_text(SCHEMA % ("{expression: {type: string}, note: {type: string}}", "[expression]"))
    with pytest.raises(ConfigError, match=r"properties \['note'\]"):
        load_tools(str(path))
    path.write_text(SCHEMA % ("{expression: {type: string, description: The arithmetic.}}", "[expression]"))
    assert [t.schema["function"]["name"] for t in load_tools(str(path))] == ["calc"]


@tool
def slow_lookup(key: str) -> str:
    """A healthy tool that takes a while (a database under load).

    Args:
        key: What to look up.
    """
    import time

    time.sleep(0.5)
    return key


def test_a_healthy_sync_tool_is_not_timed_out_by_its_own_queue():
    """With 8 threads per tool, 32 concurrent calls of a 0.5 s tool queued four deep, and the calls
    at the back ran past a 1.5 s timeout although none of them hung."""

    async def go():
        envs = [ToolEnv([slow_lookup], ToolLimits(timeout_s=1.5), lambda t: (t, False)) for _ in range(32)]
        for i, env in enumerate(envs):
            await env.start(f"e{i}", TASK)
        turns = await asyncio.gather(*(env.run_turn(ParsedTurn(calls=[ToolCall("slow_lookup", {"key": f"k{i}"})]))
                                       for i, env in enumerate(envs)))
        return [turn[0]["content"] for turn in turns], sum(env.metrics["tool_timeouts"] for env in envs)

    contents, timeouts = asyncio.run(go())
    assert timeouts == 0 and contents == [f"k{i}" for i in range(32)]


class Store:
    """A stateful tool whose `set` awaits I/O before it stores: the log shows how calls overlapped."""

    schema = {"type": "function", "function": {"name": "store", "description": "Set or get a value.", "parameters": {
        "type": "object", "properties": {"op": {"type": "string"}, "value": {"type": "string"}},
        "required": ["op"]}}}

    def __init__(self):
        self.values: dict[str, str] = {}
        self.log: list[str] = []

    async def create(self, instance_id: str, **kwargs) -> str:
        return instance_id

    async def execute(self, instance_id: str, arguments: dict) -> str:
        self.log.append(f"{arguments['op']} starts")
        if arguments["op"] == "set":
            await asyncio.sleep(0.05)
            self.values[instance_id] = arguments["value"]
            self.log.append("set ends")
            return "ok"
        return self.values.get(instance_id, "unset")

    async def reward(self, instance_id: str) -> float | None:
        return None

    async def release(self, instance_id: str) -> None:
        return None


@pytest.mark.parametrize("parallel, results, log", [
    (True, ["ok", "unset"], ["set starts", "get starts", "set ends"]),
    (False, ["ok", "42"], ["set starts", "set ends", "get starts"]),
])
def test_a_turns_calls_run_at_once_or_in_the_order_written(parallel, results, log):
    store = Store()

    async def go():
        env = ToolEnv([store], ToolLimits(timeout_s=5, parallel_calls=parallel), lambda text: (text, False))
        await env.start("e", TASK)
        messages = await env.run_turn(ParsedTurn(calls=[ToolCall("store", {"op": "set", "value": "42"}),
                                                        ToolCall("store", {"op": "get"})]))
        await env.finish()
        return messages

    assert [m["content"] for m in asyncio.run(go())] == results and store.log == log
