"""Plug-ins that misbehave past what an `except Exception` catches: a `sys.exit()`, a
`CancelledError` of their own, a timeout they swallow, state they leave behind, arguments they edit
in place, metrics named like the loop's counters. Each fails its own call only; the run, the other
episodes and the tool server go on, and every instance is released."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.rollout.collect import run_episodes
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.base import ToolResult, tool
from agentrl.tools.parsers import ParsedTurn, parse_hermes
from agentrl.tools.server import ServerSettings, create_app
from agentrl.tools.threads import run_with_daemon_threads
from agentrl.types import Task, ToolCall
from tests.conftest import ScriptedEngine, stop_process
from tests.served_tools import OwnIds
from tests.test_tool_server import TOKEN, api, start_server

FINAL = "The answer is 42."


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@tool
def argparse_like(value: str) -> str:
    """Exits on bad input, as a command-line program wrapped as a tool does.

    Args:
        value: Anything.
    """
    raise SystemExit(f"bad input {value}")


@tool
async def async_exit(value: str) -> str:
    """Exits from a coroutine.

    Args:
        value: Anything.
    """
    raise SystemExit(3)


def test_a_tool_calling_sys_exit_fails_its_call_and_the_run_goes_on(tokenizer):
    tools = [argparse_like, async_exit]
    engine = ScriptedEngine(tokenizer, [call("argparse_like", value="v") + call("async_exit", value="w"), FINAL])
    runner = EpisodeRunner(engine, tokenizer, tools, parse_hermes, EpisodeSettings())
    [traj] = run_episodes(runner, [Task(id="t", prompt="Go.")], group_size=1, max_concurrent=1)
    assert traj.finish == "stop" and traj.messages[-1]["content"] == FINAL
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        "Error: argparse_like failed: SystemExit: bad input v", "Error: async_exit failed: SystemExit: 3"]
    assert traj.metrics["tool_errors"] == 2


class Lifecycle:
    """A tool whose lifecycle methods can raise, hang, or ignore cancellation, and which logs every
    call to them."""

    def __init__(self, log: list[str], name: str, create=None, reward=None, release=None, execute=None):
        self.log, self.name = log, name
        self.behaviour = {"create": create, "reward": reward, "release": release, "execute": execute}
        self.schema = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}

    async def _act(self, method: str, instance_id: str):
        self.log.append(f"{self.name}.{method}")
        behaviour = self.behaviour[method]
        if behaviour == "swallow":  # a retry loop under a bare except: cancellation never ends it
            for _ in range(40):
                try:
                    await asyncio.sleep(0.05)
                except BaseException:  # noqa: BLE001 - the point of this tool
                    continue
            self.log.append(f"{self.name}.{method} gave up by itself")
            return "late"
        if isinstance(behaviour, BaseException):
            raise behaviour
        return None

    async def create(self, instance_id, **kwargs):
        return await self._act("create", instance_id)

    async def execute(self, instance_id, arguments):
        return await self._act("execute", instance_id) or "ran"

    async def reward(self, instance_id):
        await self._act("reward", instance_id)
        return 0.5

    async def release(self, instance_id):
        await self._act("release", instance_id)


def test_a_cancelled_error_from_reward_or_release_fails_that_step_and_every_instance_is_released():
    log: list[str] = []
    tools = [Lifecycle(log, "a", reward=asyncio.CancelledError()), Lifecycle(log, "b", release=asyncio.CancelledError()),
             Lifecycle(log, "c", create=RuntimeError("no sandbox left"))]

    async def main():
        env = ToolEnv(tools, ToolLimits(timeout_s=1), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        messages = await env.run_turn(ParsedTurn(calls=[ToolCall("c", {})]))
        return env, messages, await env.finish()

    env, messages, total = run_with_daemon_threads(main())
    # c's create failed: it is released all the same (whatever it made is its to free), and the
    # model is told why it could not be started.
    assert messages[0]["content"] == "Error: c could not be started for this episode (RuntimeError: no sandbox left)."
    assert log == ["a.create", "b.create", "c.create", "c.release", "a.reward", "a.release", "b.reward", "b.release"]
    assert total == 0.5  # b's reward; a's failed
    assert env.metrics["tool_lifecycle_errors"] == 3  # c's create, a's reward, b's release


class Abort(BaseException):
    """A plug-in's own BaseException, as gevent's Timeout and trio's Cancelled are: past `except Exception`."""


def test_a_base_exception_of_a_tools_own_fails_that_step_and_every_instance_is_released():
    """It used to pass the handlers of create, reward and release: the episode ended in it, and the
    instances after it were never released."""
    log: list[str] = []
    tools = [Lifecycle(log, "a", create=Abort("no sandbox")), Lifecycle(log, "b", reward=Abort("judge gone")),
             Lifecycle(log, "c", release=Abort("stuck")), Lifecycle(log, "d", execute=Abort("mid-call"))]

    async def main():
        env = ToolEnv(tools, ToolLimits(timeout_s=1), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        messages = await env.run_turn(ParsedTurn(calls=[ToolCall("a", {}), ToolCall("d", {})]))
        return env, messages, await env.finish()

    env, messages, total = run_with_daemon_threads(main())
    assert [m["content"] for m in messages] == ["Error: a could not be started for this episode (Abort: no sandbox).",
                                                "Error: d failed: Abort: mid-call"]
    assert log == ["a.create", "a.release", "b.create", "c.create", "d.create", "d.execute",
                   "b.reward", "b.release", "c.reward", "c.release", "d.reward", "d.release"]
    assert total == 1.0  # c's and d's rewards; b's failed
    assert env.metrics["tool_lifecycle_errors"] == 3  # a's create, b's reward, c's release


def test_the_timeout_fires_for_a_tool_that_swallows_its_cancellation():
    log: list[str] = []
    tools = [Lifecycle(log, "stubborn", execute="swallow")]

    async def main():
        env = ToolEnv(tools, ToolLimits(timeout_s=0.2), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        started = time.perf_counter()
        messages = await env.run_turn(ParsedTurn(calls=[ToolCall("stubborn", {})]))
        return messages, time.perf_counter() - started

    started = time.perf_counter()
    messages, turn_s = run_with_daemon_threads(main())
    whole_s = time.perf_counter() - started
    assert messages[0]["content"] == "Error: stubborn did not finish within 0.2 s."
    # 0.2 s, then 1 s of grace for the cancellation, then the call is abandoned; the 2 s loop of
    # the tool would only end later, and neither the turn nor the end of the run waits for it.
    assert 1.1 < turn_s < 1.9 and whole_s < 1.9
    assert "stubborn.execute gave up by itself" not in log


def test_a_create_that_times_out_is_released_and_the_reason_reaches_the_model():
    log: list[str] = []

    async def main():
        env = ToolEnv([Lifecycle(log, "slow", create="swallow")], ToolLimits(timeout_s=0.1), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        return await env.run_turn(ParsedTurn(calls=[ToolCall("slow", {})]))

    messages = run_with_daemon_threads(main())
    assert log == ["slow.create", "slow.release"]
    assert messages[0]["content"] == "Error: slow could not be started for this episode (TimeoutError: no answer within 0.1 s)."


@tool
def normalise(query: str, limit: int = 5) -> str:
    """Edits its arguments in place, as some plug-ins do.

    Args:
        query: What to look for.
        limit: How many.
    """
    return "ok"


def test_the_recorded_call_keeps_what_the_model_wrote_whatever_the_tool_does_with_its_arguments(tokenizer):
    class Editing:
        schema = normalise.schema

        async def create(self, instance_id, **kwargs):
            return instance_id

        async def execute(self, instance_id, arguments):
            arguments.clear()
            arguments["limit"] = 10
            return ToolResult("ok", metrics={"tool_calls": 7.0, "tool/normalise/errors": 1.0, "hits": 3.0})

        async def reward(self, instance_id):
            return None

        async def release(self, instance_id):
            return None

    engine = ScriptedEngine(tokenizer, [call("normalise", query="cats"), FINAL])
    runner = EpisodeRunner(engine, tokenizer, [Editing()], parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), "g"))
    assert traj.messages[1]["tool_calls"][0]["function"]["arguments"] == {"query": "cats"}
    # A metric named like one of the loop's counters is dropped and counted, not added to it.
    assert traj.metrics["tool_calls"] == 1 and "tool/normalise/errors" not in traj.metrics
    assert traj.metrics["tool_invalid_results"] == 2 and traj.metrics["hits"] == 3


def test_the_tool_server_survives_a_tool_calling_sys_exit(tmp_path):
    proc, url = start_server(tmp_path, tools_yaml="tools:\n  - class: tests.served_tools:quit_early\n")
    try:
        with api(url) as client:
            instance = client.post("/instances", json={"tool": "quit_early"}).json()["instance_id"]
            reply = client.post(f"/instances/{instance}/execute", json={"arguments": {"code": 2}})
            assert (reply.status_code, reply.json()["error"]) == (200, "SystemExit: 2")
            assert client.get("/health").status_code == 200 and proc.poll() is None
            assert client.get("/stats").json()["tools"]["quit_early"]["execute"]["errors"] == 1
    finally:
        stop_process(proc)


def test_the_tool_server_hands_a_tool_the_ids_its_create_returned():
    own = OwnIds()
    with TestClient(create_app([own], ServerSettings(token=TOKEN)),
                    headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        client_id = "client-0001"
        created = client.post("/instances", json={"tool": "own_ids", "instance_id": client_id}).json()
        assert created == {"instance_id": client_id, "error": None}
        executed = client.post(f"/instances/{client_id}/execute", json={"arguments": {}}).json()
        # A metrics value that is no mapping is dropped, as the local loop drops it: not a 500.
        assert executed == {"text": "in session-client-0001 of client-0001", "reward": None, "metrics": {},
                            "error": None}
        assert client.post(f"/instances/{client_id}/reward").json() == {"reward": 1.0, "error": None}
        assert client.delete(f"/instances/{client_id}").json() == {"error": None}
    assert own.released == ["session-client-0001"] and own.sessions == {}


def test_the_tool_server_counts_its_own_500s():
    class Broken:
        schema = OwnIds.schema

        async def create(self, instance_id, **kwargs):
            return instance_id

        async def execute(self, instance_id, arguments):
            class Unreadable(ToolResult):
                @property
                def text(self):
                    raise RuntimeError("a server-side bug")
            return Unreadable.__new__(Unreadable)

        async def reward(self, instance_id):
            return None

        async def release(self, instance_id):
            return None

    with TestClient(create_app([Broken()], ServerSettings(token=TOKEN)), raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        instance = client.post("/instances", json={"tool": "own_ids"}).json()["instance_id"]
        reply = client.post(f"/instances/{instance}/execute", json={"arguments": {}})
        assert (reply.status_code, reply.json()) == (500, {"detail": "internal server error (RuntimeError)"})
        assert client.get("/stats").json()["responses"] == {"200": 1, "500": 1}


def test_an_interaction_score_that_is_not_a_number_is_left_out_and_counted(tokenizer):
    """None means a reply is not scored (as a tool's reward None); NaN, a bool and a tensor of two
    are invalid, and their count reaches the step's metrics (it was kept per episode only). A
    reward model's one-element tensor is a score (it was dropped as invalid, so a judge's scores
    added nothing to any reward)."""
    import torch

    from agentrl.env.interaction import Turn
    from agentrl.rollout.collect import summarize

    replies = iter([Turn("Try again.", False, math.nan), Turn("Again.", False, None), Turn("More.", False, True),
                    Turn("Closer.", False, torch.tensor([0.5, 0.5])), Turn("Nearly.", False, torch.tensor(0.125)),
                    Turn("Right.", True, 0.25)])

    class Judge:
        async def start(self, task):
            return None

        async def respond(self, messages):
            return next(replies)

        async def finish(self):
            return None

    engine = ScriptedEngine(tokenizer, ["4", "5", "6", "7", "8", "9"])
    runner = EpisodeRunner(engine, tokenizer, [], parse_hermes, EpisodeSettings(interaction_scores=True, max_turns=6),
                           interaction_factory=Judge, reward_fn=lambda task, messages: 1.0)
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), "g"))
    assert traj.finish == "stop" and traj.reward == 1.375
    assert traj.metrics["interaction_invalid_scores"] == 3 and traj.metrics["interaction_score"] == 0.375
    summary = summarize([traj, traj], 1.0)
    assert (summary["interaction_invalid_scores"], summary["interaction_score_mean"]) == (6.0, 0.375)
    assert "interaction_score_mean" not in summarize([run_without_interaction(tokenizer)], 1.0)


def run_without_interaction(tokenizer):
    runner = EpisodeRunner(ScriptedEngine(tokenizer, ["4"]), tokenizer, [], parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="Go."), "g"))
    assert "interaction_score" not in traj.metrics and "interaction_invalid_scores" not in traj.metrics
    return traj


def test_an_episode_out_of_turns_is_max_turns_even_when_the_last_tool_output_would_not_fit(tokenizer):
    @tool
    def wordy(n: int) -> str:
        """Returns many words.

        Args:
            n: How many.
        """
        return "word " * n

    # 260: the prompt (195 tokens) and the call fit, the tool's 200 words do not, and a turn is left
    for context, finish, appended in ((400, "max_turns", False), (4000, "max_turns", True), (260, "length", False)):
        engine = ScriptedEngine(tokenizer, [call("wordy", n=200), FINAL])
        settings = EpisodeSettings(max_turns=1 if context != 260 else 2, max_context_tokens=context,
                                   max_tool_output_tokens=256)
        traj = asyncio.run(EpisodeRunner(engine, tokenizer, [wordy], parse_hermes, settings).run(
            Task(id="t", prompt="Go."), "g"))
        assert (traj.finish, traj.messages[-1]["role"] == "tool") == (finish, appended), context


def test_a_run_that_fails_while_a_stubborn_call_is_in_flight_still_ends():
    """The end of a run cancels what is left and waits for it, but a call that ignores its
    cancellation only for its grace: the 2 s loop of the tool is not waited for."""
    import pytest

    log: list[str] = []

    async def main():
        env = ToolEnv([Lifecycle(log, "stubborn", execute="swallow")], ToolLimits(timeout_s=30),
                      lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        asyncio.ensure_future(env.run_turn(ParsedTurn(calls=[ToolCall("stubborn", {})])))
        await asyncio.sleep(0.1)
        raise RuntimeError("the step failed")

    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="the step failed"):
        run_with_daemon_threads(main())
    assert time.perf_counter() - started < 1.9 and "stubborn.execute gave up by itself" not in log


def test_the_tool_server_releases_what_a_failed_create_made():
    log: list[str] = []
    failing = Lifecycle(log, "flaky", create=RuntimeError("half started"))
    with TestClient(create_app([failing], ServerSettings(token=TOKEN)),
                    headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        created = client.post("/instances", json={"tool": "flaky", "instance_id": "client-0002"}).json()
        stats = client.get("/stats").json()
    assert created == {"instance_id": None, "error": "RuntimeError: half started"}
    assert log == ["flaky.create", "flaky.release"] and stats["live_instances"] == 0


class HangingJudge:
    """A judge whose respond waits on a remote model that never answers, and which ignores its
    cancellation (a retry loop under a bare `except:`); `finish` hangs too when asked to."""

    def __init__(self, log: list[str], hang_in_finish: bool = False, fail_finish: bool = False):
        self.log, self.hang_in_finish, self.fail_finish = log, hang_in_finish, fail_finish

    async def start(self, task):
        self.log.append("start")

    async def respond(self, messages):
        self.log.append("respond")
        await stubborn_sleep(30)

    async def finish(self):
        self.log.append("finish")
        if self.fail_finish:
            raise RuntimeError("lost the judge's session")
        if self.hang_in_finish:
            await stubborn_sleep(30)


async def stubborn_sleep(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(0.05)
        except BaseException:  # noqa: BLE001 - the point: it swallows its cancellation
            pass


def test_an_interaction_that_never_answers_fails_its_episode_within_the_timeout(tokenizer):
    """A hung judge used to hold its episode, and the whole step, forever: interaction calls had no
    time limit. Now the episode fails with a message naming the setting, within the timeout and the
    abandoned call's grace, and the interaction is still finished. When `finish` hangs as well, the
    reported cause stays respond's; a `finish` that fails after a good episode still fails it."""
    from agentrl.config import RecipeConfig
    from agentrl.rollout.run import episode_settings

    assert episode_settings(RecipeConfig.model_validate(
        {"rollout": {"interaction_timeout_s": 0.25}})).interaction_timeout_s == 0.25
    settings = EpisodeSettings(interaction_timeout_s=0.2)
    for hang_in_finish in (False, True):
        log: list[str] = []
        engine = ScriptedEngine(tokenizer, ["4"])
        runner = EpisodeRunner(engine, tokenizer, [], parse_hermes, settings,
                               interaction_factory=lambda: HangingJudge(log, hang_in_finish))
        started = time.monotonic()
        traj = run_with_daemon_threads(runner.run(Task(id="t", prompt="Go."), "g"))
        took = time.monotonic() - started
        assert traj.finish == "error" and log == ["start", "respond", "finish"], (hang_in_finish, log)
        assert traj.error == ("TimeoutError: the interaction's respond did not answer within 0.2 s "
                              "(rollout.interaction_timeout_s)")
        # 0.2 s + 1 s grace for respond, and as much again for a finish that hangs too; far from 30 s.
        assert took < (3.0 if hang_in_finish else 1.9), took

    class Judged(HangingJudge):
        async def respond(self, messages):
            from agentrl.env.interaction import Turn

            return Turn("Right.", True, 1.0)

    log = []
    runner = EpisodeRunner(ScriptedEngine(tokenizer, ["4"]), tokenizer, [], parse_hermes, settings,
                           interaction_factory=lambda: Judged(log, fail_finish=True))
    traj = run_with_daemon_threads(runner.run(Task(id="t", prompt="Go."), "g"))
    assert (traj.finish, traj.error) == ("error", "InteractionError: the interaction's finish raised RuntimeError: lost the judge's session")


def test_a_call_that_swallows_even_its_closing_does_not_hang_the_run(tmp_path):
    """Freeing a suspended coroutine closes it: a retry loop under a bare `except:` swallows the
    GeneratorExit too and spins forever. The abandoned call used to be freed once its loop closed,
    and the run's next garbage collection hung."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import asyncio, gc\n"
        "from agentrl.tools.threads import call_plugin, run_with_daemon_threads\n"
        "from tests.served_tools import retry_forever\n"
        "async def main():\n"
        "    try:\n"
        "        await call_plugin(retry_forever.execute('i', {'url': 'x'}), 0.1)\n"
        "    except TimeoutError:\n"
        "        print('timed out', flush=True)\n"
        "run_with_daemon_threads(main())\n"
        "gc.collect()\n"
        "print('collected', flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert (done.returncode, done.stdout) == (0, "timed out\ncollected\n"), done.stderr[-2000:]


def test_a_failed_episode_keeps_its_turns_and_tool_calls_and_a_grader_exiting_fails_only_its_episode(tokenizer):
    """An episode whose engine failed on its second turn used to report no turns and no tool calls
    (the summary's mean_turns and per-tool counts left them out); and a reward function that
    calls sys.exit (a grader wrapping a command-line program) ended the whole rollout."""
    from agentrl.rollout.collect import summarize
    from agentrl.tools.builtin.calculator import calculator

    engine = ScriptedEngine(tokenizer, [call("calculator", expression="2*3")])  # no second turn: it raises
    runner = EpisodeRunner(engine, tokenizer, [calculator], parse_hermes, EpisodeSettings())
    [traj] = run_episodes(runner, [Task(id="t", prompt="Go.")], group_size=1, max_concurrent=1)
    assert traj.finish == "error" and traj.error.startswith("IndexError") and traj.messages[-1]["content"] == "6"
    assert (traj.metrics["turns"], traj.metrics["tool_calls"], traj.metrics["tool/calculator/calls"]) == (1, 1, 1)
    summary = summarize([traj], wall_s=1.0)
    assert (summary["mean_turns"], summary["tool/calculator/calls"], summary["episodes_failed"]) == (1, 1, 1)

    def grader(task, messages):
        if task.id == "b":
            raise SystemExit(2)  # argparse's error() on an answer it cannot parse
        return 1.0

    runner = EpisodeRunner(ScriptedEngine(tokenizer, [FINAL, FINAL]), tokenizer, [], parse_hermes, EpisodeSettings(),
                           reward_fn=grader)
    a, b = run_episodes(runner, [Task(id="a", prompt="Go."), Task(id="b", prompt="Go.")], group_size=1,
                        max_concurrent=2)
    assert (a.finish, a.reward, b.finish, b.error) == ("stop", 1.0, "error", "SystemExit: 2")


@pytest.mark.parametrize("raised,error", [
    (KeyboardInterrupt(), "KeyboardInterrupt"),  # a library turning its own abort into one; no Ctrl-C lands on its thread
    (Abort("judge gone"), "Abort: judge gone"),
])
def test_a_grader_raising_outside_exception_on_its_thread_fails_only_its_episode(tokenizer, raised, error):
    """The grader runs on a worker thread, so what it raises there is its own: a KeyboardInterrupt
    went through the episode's `except Exception` and ended the rollout."""
    def grader(task, messages):
        if task.id == "b":
            raise raised
        return 1.0

    runner = EpisodeRunner(ScriptedEngine(tokenizer, [FINAL, FINAL]), tokenizer, [], parse_hermes, EpisodeSettings(),
                           reward_fn=grader)
    try:
        a, b = run_episodes(runner, [Task(id="a", prompt="Go."), Task(id="b", prompt="Go.")], group_size=1,
                            max_concurrent=2)
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt would otherwise stop the whole test session
        pytest.fail(f"the grader's {type(e).__name__} ended the rollout")
    assert (a.finish, a.reward, b.finish, b.error) == ("stop", 1.0, "error", error)


def time_out_one_call(url: str, tool: str) -> dict:
    """Run one call of `tool` past the server's --call-timeout of 0.2 s; the server's /stats after it."""
    with api(url) as client:
        instance = client.post("/instances", json={"tool": tool}).json()["instance_id"]
        reply = client.post(f"/instances/{instance}/execute", json={"arguments": {"url": "x"}})
        assert reply.json()["error"] == f"TimeoutError: {tool} did not finish within 0.2 s"
        return client.get("/stats").json()


def test_the_tool_server_exits_on_sigterm_with_a_call_that_swallows_even_its_closing_in_flight(tmp_path):
    """uvicorn shuts the server down on SIGTERM; a stubborn call it would wait for at the end of its
    loop must not keep the process alive (as a Ctrl-C-style handler of the recipe commands would)."""
    import signal

    proc, url = start_server(tmp_path, "--call-timeout", "0.2",
                             tools_yaml="tools:\n  - class: tests.served_tools:retry_forever\n")
    try:
        assert time_out_one_call(url, "retry_forever")["abandoned_calls"] == 1  # it still runs, on no slot
        proc.terminate()  # uvicorn re-raises the signal once it has shut down: exit status -SIGTERM
        assert proc.wait(20) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_tool_server_exits_on_ctrl_c_with_a_call_hanging_in_a_thread(tmp_path):
    """On Ctrl-C uvicorn shuts down and raises the KeyboardInterrupt again; closing its loop then
    waited, with no limit, for the thread of a timed-out call's `asyncio.to_thread`."""
    # Ctrl-C as a terminal delivers it, also when this test runs where SIGINT is ignored (a job
    # started in the background by a non-interactive shell), which the child would inherit.
    with_ctrl_c = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "sys.argv[0] = 'agentrl'; runpy.run_module('agentrl.cli', run_name='__main__')")
    proc, url = start_server(tmp_path, "--call-timeout", "0.2", launcher=("-c", with_ctrl_c),
                             tools_yaml="tools:\n  - class: tests.served_tools:fetch_in_a_thread\n")
    try:
        time_out_one_call(url, "fetch_in_a_thread")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
        assert proc.stderr.read().splitlines()[-1] == "agentrl: interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()


@tool
async def blocking_fetch(url: str) -> str:
    """Fetches a page the blocking way (requests.get in an async def).

    Args:
        url: The page.
    """
    time.sleep(1.3)
    return "page"


@tool
async def polite_fetch(url: str) -> str:
    """Fetches a page in several awaited pieces, 1.5 s in all.

    Args:
        url: The page.
    """
    for _ in range(5):
        await asyncio.sleep(0.3)
    return "page"


def test_an_async_tool_that_blocks_the_event_loop_is_named_once_and_the_run_goes_on(tokenizer, capsys):
    """Nothing can interrupt a coroutine that never yields: every episode waits and no timeout can
    fire. The call completes, and a warning names the tool once and says what to do; a tool that
    takes as long but awaits as it goes is not named."""
    turns = [call("blocking_fetch", url="a"), call("polite_fetch", url="b"), call("blocking_fetch", url="c"), FINAL]
    runner = EpisodeRunner(ScriptedEngine(tokenizer, turns), tokenizer, [blocking_fetch, polite_fetch], parse_hermes,
                           EpisodeSettings())
    traj = run_with_daemon_threads(runner.run(Task(id="t", prompt="Go."), "g"))
    assert traj.finish == "stop" and [m["content"] for m in traj.messages if m["role"] == "tool"] == ["page"] * 3
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agentrl: warning:")]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("agentrl: warning: the tool 'blocking_fetch' (execute) held the event loop for 1.")
    assert "await asyncio.to_thread(...)" in warnings[0]
