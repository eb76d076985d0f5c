"""Misbehaving tools and malformed calls become tool messages and metrics; the episode goes on."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import json

import pydantic
import pytest
import torch

from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.rollout.collect import summarize
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.base import FunctionTool, ToolResult, tool
from agentrl.tools.builtin.calculator import calculator
from agentrl.tools.parsers import ParsedTurn, parse_hermes
from agentrl.tools.threads import run_with_daemon_threads
from agentrl.types import Task, ToolCall
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
def flood(size: int, text: str = "x") -> str:
    """Returns a lot of text.

    Args:
        size: Repetitions.
        text: What is repeated.
    """
    return text * size


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


def test_output_of_long_tokens_is_cut_at_the_budget_not_before(tokenizer):
    """SmolLM2 has one token for 64 '#': a 10-token output cut to 4 tokens keeps 256 characters."""
    from agentrl.rollout.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer, [])
    text = "#" * 640
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 10
    assert renderer.truncate(text, 4) == ("#" * 256 + "\n[output truncated to 4 tokens]", True)
    assert renderer.truncate(text, 10) == (text, False)


def test_a_cut_through_a_character_keeps_it_whole_or_leaves_it_out(tokenizer):
    """Byte-level tokens split an emoji or a CJK character; a cut between them decoded to U+FFFD,
    a character the tool never wrote."""
    from agentrl.rollout.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer, [])
    for text in ("🎉🚀👍" * 300, "数学问题的答案是七十二。" * 200):
        for budget in (5, 6, 7, 8, 31, 32):
            cut, was_cut = renderer.truncate(text, budget)
            body = cut.removesuffix(f"\n[output truncated to {budget} tokens]")
            assert was_cut and text.startswith(body) and "\ufffd" not in body, (text[:3], budget, body)
            assert budget - 3 <= len(tokenizer(body, add_special_tokens=False)["input_ids"]) <= budget


def test_special_token_text_counts_against_the_budget_as_the_tokens_it_is_kept_as(tokenizer):
    """`<|im_end|>` in a tool's output stays text, 7 tokens of it, not the 1 control token a
    plain encode() counts: the cut must count the same way, or the output runs 7x over budget."""
    from agentrl.rollout.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer, [])
    as_text = tokenizer("<|im_end|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert len(as_text) == 7
    text, cut = renderer.truncate("<|im_end|>" * 1000, 50)
    body = text.removesuffix("\n[output truncated to 50 tokens]")
    assert cut and body != text and ("<|im_end|>" * 1000).startswith(body)
    kept_as = len(tokenizer(body, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    assert 40 < kept_as <= 50  # (a plain count kept 50 whole <|im_end|>: about 300 tokens of text)
    traj, tools = run(tokenizer, call("flood", size=3, text="<|im_end|>"))
    assert tools[0]["content"] == "<|im_end|>" * 3  # within the budget: whole, and kept as text
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rendered_ends = [i for i, m in zip(traj.token_ids, traj.loss_mask) if i == end and not m]
    assert len(rendered_ends) == 3  # the system, user and tool turns' own: none from the output


def test_broken_json_in_tool_call(tokenizer):
    traj, tools = run(tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"\n</tool_call>')
    assert tools[0]["name"] == "parse_error"
    assert tools[0]["content"].startswith("Error: the tool call is not valid JSON (")
    assert traj.metrics["parse_errors"] == 1 and traj.metrics["tool_calls"] == 0


def test_unknown_tool_and_bad_arguments(tokenizer):
    traj, tools = run(tokenizer, call("search", query="x") + call("calculator", expr="1+1"))
    assert tools[0]["content"] == "Error: unknown tool 'search'; available: calculator, explode, flood, sleepy."
    assert tools[1]["content"] == "Error: bad arguments for calculator: unexpected argument 'expr' (it takes expression)."
    assert traj.metrics["tool_errors"] == 2
    traj, tools = run(tokenizer, call("calculator"))
    assert tools[0]["content"] == "Error: bad arguments for calculator: 'expression' is a required property."


@tool
def tagged(x: int, nullable: float = 1.0, tags: list[str] | None = None) -> str:
    """Echoes its arguments.

    Args:
        x: A number.
        nullable: A parameter whose name is a schema keyword.
        tags: Optional tags.
    """
    return f"{x} {nullable} {tags}"


def test_a_functions_optional_parameter_takes_the_null_its_schema_offers_and_nothing_unknown():
    """transformers writes `X | None` as `nullable: true`, which the model reads but jsonschema
    ignores: a null the schema offered was refused as 'not of type array'. An argument the function
    does not take used to reach it and fail as a TypeError, as if the tool had broken."""
    from agentrl.tools.base import argument_problem

    assert tagged.schema["function"]["parameters"]["properties"]["tags"]["nullable"] is True
    assert argument_problem(tagged, {"x": 1, "tags": None}) is None
    assert argument_problem(tagged, {"x": 1, "tags": ["a"], "nullable": 2.5}) is None
    assert argument_problem(tagged, {"x": 1, "tags": [3]}) == "bad arguments for tagged: 3 is not of type 'string'."
    assert argument_problem(tagged, {"x": 1, "nullable": None}) == ("bad arguments for tagged: None is not of "
                                                                   "type 'number'.")
    assert argument_problem(tagged, {"x": 1, "z": 3, "a": 0}) == ("bad arguments for tagged: unexpected argument "
                                                                 "'a', 'z' (it takes nullable, tags, x).")
    assert argument_problem(FunctionTool(lambda **kw: "ok", schema=tagged.schema), {"x": 1, "z": 3}) is None


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def convert(degrees: float, unit: Unit, times: int = 1, pair: tuple[int, str] = (0, "")) -> str:
    """Converts a temperature.

    Args:
        degrees: The value.
        unit: What it is in.
        times: How often to repeat the answer.
        pair: Any pair.
    """
    value = degrees * 9 / 5 + 32 if unit is Unit.C else (degrees - 32) * 5 / 9
    return ",".join([f"{value:g}"] * times) + f" {type(pair).__name__}"


def test_a_functions_arguments_arrive_as_its_type_hints_say():
    """The JSON value used to reach the function as it was: "celsius" is not Unit.C (100 °C came
    back as 37.8), 2.0 passes jsonschema's integer check and then broke `"x" * 2.0`."""
    from agentrl.tools.base import argument_problem

    converting = FunctionTool(convert)
    run = lambda arguments: asyncio.run(converting.execute("e", arguments)).text  # noqa: E731
    assert run({"degrees": 100, "unit": "celsius", "times": 2.0, "pair": [1, "a"]}) == "212,212 tuple"
    assert argument_problem(converting, {"degrees": 1, "unit": "kelvin"}) == (
        "bad arguments for convert: 'kelvin' is not one of ['celsius', 'fahrenheit'].")
    assert argument_problem(converting, {"degrees": 1, "unit": "celsius", "times": 2.5}) == (
        "bad arguments for convert: 2.5 is not of type 'integer'.")
    assert argument_problem(converting, {"degrees": 1, "unit": "celsius", "pair": [1]}) == (
        "bad arguments for convert: argument 'pair': Field required.")


def test_only_keyword_parameters_make_a_tool():
    from agentrl.tools.base import function_schema

    def total(*values: int) -> int:
        """Adds.

        Args:
            values: The numbers.
        """
        return sum(values)

    def tag(name: str, **attributes: str) -> str:
        """Tags.

        Args:
            name: The tag.
            attributes: Its attributes.
        """
        return name + "".join(f" {k}={v}" for k, v in sorted(attributes.items()))

    with pytest.raises(ValueError, match=r"^parameter '\*values' of 'total' cannot be given by name"):
        function_schema(total)
    tagging = tool(tag)
    assert tagging.schema["function"]["parameters"]["required"] == ["name"]
    assert set(tagging.schema["function"]["parameters"]["properties"]) == {"name"}
    assert asyncio.run(tagging.execute("e", {"name": "a", "href": "u"})).text == "a href=u"


def test_an_async_function_behind_a_sync_decorator_is_awaited():
    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    @logged
    async def search(query: str) -> str:
        """Searches.

        Args:
            query: What to look for.
        """
        await asyncio.sleep(0)
        return f"found {query}"

    assert asyncio.run(tool(search).execute("e", {"query": "x"})).text == "found x"


def test_calls_over_the_per_turn_limit_get_an_error(tokenizer):
    traj, tools = run(tokenizer, call("calculator", expression="1+1") * 3)
    assert [t["content"] for t in tools] == ["2", "2", "Error: not run; at most 2 tool calls per turn."]
    # The call not run counts as a call and as an error, so the error rate stays a share of calls.
    assert traj.metrics["tool_calls"] == 3 and traj.metrics["tool_errors"] == 1
    assert traj.metrics["tool/calculator/calls"] == 3 and traj.metrics["tool/calculator/errors"] == 1
    summary = summarize([traj], 1.0)
    assert summary["tool_error_rate"] == 1 / 3 and summary["tool/calculator/error_rate"] == 1 / 3


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


@dataclasses.dataclass
class Hit:
    title: str
    score: float


class Page(pydantic.BaseModel):
    url: str
    hits: list[Hit]


def test_values_json_lacks_a_type_for_reach_the_model_as_what_they_mean(tokenizer):
    """Before, `default=str` quoted them: a set came out as "{1, 2, 3}", a numpy integer as "3"."""
    import numpy

    @tool
    def search(query: str) -> dict:
        """Searches.

        Args:
            query: What to look for.
        """
        return {"ids": {3, 1, 2}, "count": numpy.int64(3), "best": Hit("a", 0.5), "scores": torch.tensor([0.5, 0.25]),
                "page": Page(url="u", hits=[Hit("b", 0.25)]), "mean": numpy.float32(0.5)}

    engine = ScriptedEngine(tokenizer, [call("search", query="q"), FINAL])
    runner = EpisodeRunner(engine, tokenizer, [search], parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    assert json.loads(traj.messages[2]["content"]) == {
        "ids": [1, 2, 3], "count": 3, "best": {"title": "a", "score": 0.5}, "scores": [0.5, 0.25],
        "page": {"url": "u", "hits": [{"title": "b", "score": 0.25}]}, "mean": 0.5}


def test_engine_failure_ends_episode_with_error(tokenizer):
    class BrokenEngine(ScriptedEngine):
        async def generate(self, token_ids, sampling):
            raise RuntimeError("engine down")

    runner = EpisodeRunner(BrokenEngine(tokenizer, []), tokenizer, [calculator], parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    assert traj.finish == "error" and traj.error == "RuntimeError: engine down"
    assert sum(traj.loss_mask) == 0


class Garbage:
    """A class-based tool returning what real plug-ins sometimes do: text with a lone surrogate (a
    file name read from a non-UTF-8 directory), raw bytes, a reward that is not a number."""

    schema = {"type": "function", "function": {"name": "garbage", "description": "Misbehaves.", "parameters": {
        "type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}}}

    def __init__(self):
        self.released: list[str] = []

    async def create(self, instance_id, **kwargs):
        return instance_id

    async def execute(self, instance_id, arguments):
        kind = arguments["kind"]
        if kind == "surrogate":
            return ToolResult("report_\udcff.txt saved", reward=0.5)
        if kind == "bytes":
            return b"caf\xc3\xa9 \xff"
        if kind == "reward":
            return ToolResult("scored", reward="high", metrics={"good": 1.0, "bad": float("nan")})
        return ToolResult(text={"nested": ["ok"]}, reward=float("inf"))

    async def reward(self, instance_id):
        raise RuntimeError("reward service down")

    async def release(self, instance_id):
        self.released.append(instance_id)


def test_whatever_a_tool_returns_becomes_a_message_and_the_episode_goes_on(tokenizer):
    garbage = Garbage()
    turn = "".join(call("garbage", kind=k) for k in ("surrogate", "bytes", "reward", "object"))
    engine = ScriptedEngine(tokenizer, [turn, FINAL])
    runner = EpisodeRunner(engine, tokenizer, [garbage], parse_hermes,
                           EpisodeSettings(tool_step_rewards=True, tool_limits=ToolLimits(max_calls_per_turn=4)))
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    assert traj.finish == "stop" and traj.error is None and traj.metrics["turns"] == 2
    replies = [m["content"] for m in traj.messages if m["role"] == "tool"]
    # The lone surrogate shows as a visible escape; the undecodable byte as U+FFFD.
    assert replies == [r"report_\udcff.txt saved", "café \ufffd", "scored",
                       '{"nested": ["ok"]}']
    # Only the valid step reward counts; the text reward, the NaN metric and the infinite reward
    # are dropped and counted; the valid metric is kept.
    assert traj.reward == 0.5 and traj.metrics["tool_step_reward"] == 0.5
    assert traj.metrics["tool_invalid_results"] == 3 and traj.metrics["good"] == 1.0 and "bad" not in traj.metrics
    # reward() raised at the end: no call failed, the tool's lifecycle did ...
    assert traj.metrics["tool_errors"] == 0 and traj.metrics["tool_lifecycle_errors"] == 1
    assert len(garbage.released) == 1  # ... and release() still ran: no leaked state
    json.dumps(traj.to_json()).encode("utf-8")  # the trajectory is writable as JSONL


class Recorded:
    """A tool that logs when its call starts and ends and when it is released."""

    def __init__(self, log: list[str], name: str = "slow", seconds: float = 0.2, raises: BaseException | None = None):
        self.log, self.seconds, self.raises = log, seconds, raises
        self.schema = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}

    async def create(self, instance_id, **kwargs):
        return instance_id

    async def execute(self, instance_id, arguments):
        name = self.schema["function"]["name"]
        self.log.append(f"{name} start")
        await asyncio.sleep(self.seconds)
        self.log.append(f"{name} end")
        if self.raises is not None:
            raise self.raises
        return "done"

    async def reward(self, instance_id):
        return None

    async def release(self, instance_id):
        self.log.append(f"{self.schema['function']['name']} released")


def run_logged(tokenizer, tools, turn: str, log: list[str]):
    engine = ScriptedEngine(tokenizer, [turn, FINAL])
    runner = EpisodeRunner(engine, tokenizer, tools, parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    log.append(f"episode {traj.finish}")
    return traj, [m["content"] for m in traj.messages if m["role"] == "tool"]


def test_a_schema_jsonschema_cannot_apply_becomes_a_message_after_the_sibling_call_ends(tokenizer):
    async def lookup(key: str) -> str:
        return "never runs"

    # Built in code, so the loader's $ref check never saw it.
    broken = FunctionTool(lookup, schema={"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"$ref": "#/$defs/missing"}}}}})
    log: list[str] = []
    traj, replies = run_logged(tokenizer, [Recorded(log), broken], call("slow") + call("lookup", key="k"), log)
    assert replies == ["done", "Error: the arguments for lookup cannot be checked, its parameters schema is broken "
                               "(_WrappedReferencingError: PointerToNowhere: '/$defs/missing' does not exist within "
                               "{'type': 'object', 'properties': {'key': {'$ref': '#/$defs/missing'}}})."]
    assert log == ["slow start", "slow end", "slow released", "episode stop"]
    assert traj.metrics["tool_calls"] == 2 and traj.metrics["tool_errors"] == 1


def test_a_tool_raising_cancelled_error_is_a_message_and_its_sibling_finishes_first(tokenizer):
    log: list[str] = []
    quick = Recorded(log, name="quick", seconds=0.0, raises=asyncio.CancelledError("connection dropped"))
    traj, replies = run_logged(tokenizer, [Recorded(log), quick], call("slow") + call("quick"), log)
    assert replies == ["done", "Error: quick failed: CancelledError"]  # asyncio drops the exception's text
    assert log == ["slow start", "quick start", "quick end", "slow end", "slow released", "quick released",
                   "episode stop"]
    assert traj.metrics["tool_calls"] == 2 and traj.metrics["tool_errors"] == 1


def test_cancelling_a_turn_waits_for_every_call_to_finish_its_cancellation():
    log: list[str] = []

    def cleaning_up(name: str, cleanup_s: float):
        async def execute(instance_id, arguments):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(cleanup_s)  # e.g. telling a server to stop the work
                log.append(f"{name} cleaned up")
                raise
        tool = Recorded(log, name=name)
        tool.execute = execute
        return tool

    async def main():
        env = ToolEnv([cleaning_up("fast", 0.01), cleaning_up("slow", 0.1)], ToolLimits(), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        turn = asyncio.create_task(env.run_turn(ParsedTurn(calls=[ToolCall("fast", {}), ToolCall("slow", {})])))
        await asyncio.sleep(0.05)
        turn.cancel()
        try:
            await turn
        except asyncio.CancelledError:
            log.append("turn cancelled")

    asyncio.run(main())
    assert log == ["fast cleaned up", "slow cleaned up", "turn cancelled"]


class NumpyScores(Garbage):
    """Rewards and metrics as numpy computes them, and a count too large for a float."""

    schema = {"type": "function", "function": {"name": "numpy_scores", "description": "Scores.", "parameters": {
        "type": "object", "properties": {}}}}

    async def execute(self, instance_id, arguments):
        import numpy as np

        return ToolResult("scored", reward=np.float32(0.25), metrics={"hits": np.int64(3), "huge": 10**400})

    async def reward(self, instance_id):
        import numpy as np

        return np.float64(1.5)


def test_numpy_scalars_count_as_numbers_and_an_int_too_large_for_a_float_is_dropped(tokenizer):
    """np.float32(0.25) used to be refused as no number (0 reward, counted invalid), and 10**400
    failed the whole call with an OverflowError that replaced the tool's text."""
    runner = EpisodeRunner(ScriptedEngine(tokenizer, [call("numpy_scores"), FINAL]), tokenizer, [NumpyScores()],
                           parse_hermes, EpisodeSettings(tool_step_rewards=True, tool_final_rewards=True))
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), group_id="g"))
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["scored"]
    assert (traj.metrics["tool_step_reward"], traj.metrics["tool_final_reward"], traj.reward) == (0.25, 1.5, 1.75)
    assert traj.metrics["hits"] == 3.0 and "huge" not in traj.metrics and traj.metrics["tool_invalid_results"] == 1


def test_a_metric_whose_total_would_overflow_keeps_the_total_it_had():
    """Two finite 1e308 made an infinite sum, which averaged over a step to NaN."""

    @tool
    def counted(n: float) -> ToolResult:
        """Counts.

        Args:
            n: How much.
        """
        return ToolResult("counted", metrics={"load": n})

    async def main():
        env = ToolEnv([counted], ToolLimits(max_calls_per_turn=4), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        await env.run_turn(ParsedTurn(calls=[ToolCall("counted", {"n": n}) for n in (1e308, 1e308, -5e307)]))
        await env.finish()
        return env.metrics

    metrics = run_with_daemon_threads(main())
    assert metrics["load"] == 1e308 - 5e307 and metrics["tool_invalid_results"] == 1


class Cart:
    """A stateful tool that fills the list its task gave it."""

    schema = {"type": "function", "function": {"name": "add", "description": "Add an item to the cart.",
                                               "parameters": {"type": "object", "properties": {}}}}
    name = "add"

    async def create(self, instance_id, ground_truth=None, items=()):
        self.items = items
        return instance_id

    async def execute(self, instance_id, arguments):
        self.items.append("apple")
        return f"{len(self.items)} item(s) in the cart"

    async def reward(self, instance_id):
        return None

    async def release(self, instance_id):
        pass


def test_each_episode_gets_its_own_copy_of_the_tasks_tool_arguments(tokenizer):
    """create() used to get the task's own objects: the second episode of a group found the first
    one's apple already in its cart."""
    task = Task(id="t", prompt="Shop.", tool_kwargs={"add": {"items": ["bread"]}})
    seen = []
    for _ in range(2):
        engine = ScriptedEngine(tokenizer, [call("add"), FINAL])
        runner = EpisodeRunner(engine, tokenizer, [Cart()], parse_hermes, EpisodeSettings())
        traj = asyncio.run(runner.run(task, group_id="g"))
        seen += [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert seen == ["2 item(s) in the cart"] * 2 and task.tool_kwargs == {"add": {"items": ["bread"]}}
