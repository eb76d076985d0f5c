"""A tool that blocks in plain synchronous Python costs its episodes one timeout, not the run.

The rollout runs in a real subprocess, the way `agentrl rollout` and `agentrl train` run it, so
the test sees what a user sees: when the episodes are done the process exits, although the tool's
threads are still sleeping.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentrl.tools.threads import DaemonExecutor, run_with_daemon_threads

SCRIPT = textwrap.dedent('''
    import asyncio, json, sys, time
    from agentrl.env.tool_env import ToolLimits
    from agentrl.models import load_tokenizer
    from agentrl.rollout.collect import run_episodes
    from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
    from agentrl.tools.base import tool
    from agentrl.tools.parsers import parse_hermes
    from agentrl.types import Completion, Task

    @tool
    def stuck(seconds: float) -> str:
        """Sleeps in plain synchronous Python.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke up"

    class ToThread:
        """A class-based tool that hands blocking work to asyncio's default executor."""
        schema = {"type": "function", "function": {"name": "to_thread", "description": "Blocks.",
                  "parameters": {"type": "object", "properties": {}}}}
        async def create(self, instance_id, **kwargs): return instance_id
        async def execute(self, instance_id, arguments):
            await asyncio.to_thread(time.sleep, 3600)
            return "never"
        async def reward(self, instance_id): return None
        async def release(self, instance_id): return None

    class CallThenAnswer:
        """Every episode's first turn calls both tools; its second turn answers."""
        weight_version = 0
        def __init__(self, tokenizer, first):
            encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [2]
            self.call, self.answer, self.prompt_len = encode(first), encode("Done."), None
        async def generate(self, token_ids, sampling):
            self.prompt_len = self.prompt_len or len(token_ids)  # every task has the same prompt
            ids = self.call if len(token_ids) == self.prompt_len else self.answer
            return Completion(ids, [-0.1] * len(ids), "stop", 0)

    tokenizer = load_tokenizer("smollm2-135m-instruct", chat_template="hermes")
    first = ('<tool_call>\\n{"name": "stuck", "arguments": {"seconds": 3600}}\\n</tool_call>'
             '<tool_call>\\n{"name": "to_thread", "arguments": {}}\\n</tool_call>')
    engine = CallThenAnswer(tokenizer, first)
    runner = EpisodeRunner(engine, tokenizer, [stuck, ToThread()], parse_hermes,
                           EpisodeSettings(tool_limits=ToolLimits(timeout_s=1.0)))
    started = time.perf_counter()
    trajectories = run_episodes(runner, [Task(id=f"t{i}", prompt="Go.") for i in range(4)], 4, 64)
    print(json.dumps({"wall_s": time.perf_counter() - started,
                      "finish": [t.finish for t in trajectories],
                      "timeouts": sum(t.metrics["tool_timeouts"] for t in trajectories),
                      "replies": sorted({m["content"] for t in trajectories for m in t.messages if m["role"] == "tool"})}))
''')


def test_an_hour_long_sync_tool_costs_one_timeout_and_the_process_exits(tmp_path):
    (tmp_path / "blocking_rollout.py").write_text(SCRIPT)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(tmp_path / "blocking_rollout.py")], capture_output=True, text=True,
                          timeout=120, cwd=".", env={**__import__("os").environ, "PYTHONPATH": "."})
    exited_after = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # 16 episodes, each with two calls that block for an hour: all done in about one 1 s timeout.
    assert result["finish"] == ["stop"] * 16 and result["timeouts"] == 32
    assert result["replies"] == ["Error: stuck did not finish within 1 s.", "Error: to_thread did not finish within 1 s."]
    assert result["wall_s"] < 5, result
    # ...and the interpreter exited without waiting for the 32 sleeping threads (start-up included).
    assert exited_after < result["wall_s"] + 30, exited_after


def test_daemon_executor_bounds_concurrency_and_skips_cancelled_calls():
    executor = DaemonExecutor(max_workers=2)
    started: list[int] = []

    def work(i: int) -> int:
        started.append(i)
        time.sleep(0.3)
        return i

    async def main():
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(executor, work, i) for i in range(4)]
        await asyncio.sleep(0.1)
        assert executor.running == 2 and sorted(started) == [0, 1]  # two slots, two calls running
        futures[3].cancel()  # still waiting for a slot: it must never run
        return await asyncio.gather(*futures[:3])

    assert asyncio.run(main()) == [0, 1, 2]
    time.sleep(0.5)
    assert sorted(started) == [0, 1, 2] and executor.running == 0


def test_a_grown_executor_starts_the_calls_queued_for_a_slot():
    executor = DaemonExecutor(max_workers=1)
    release = threading.Event()
    first = executor.submit(release.wait, 10)
    queued = executor.submit(lambda: "ran")
    assert (executor.running, executor.waiting) == (1, 1)
    executor.grow(2)
    assert queued.result(5) == "ran" and not first.done()  # it did not wait for the first call
    executor.grow(1)  # never shrinks
    assert executor.max_workers == 2
    release.set()
    assert first.result(5) is True


def test_name_lookups_are_not_queued_behind_hung_plugin_calls():
    # A plug-in's hung to_thread calls fill the default executor; the loop's getaddrinfo (every
    # connection to a host name) still answers. A numeric address: no query leaves the machine.
    release = threading.Event()

    async def main() -> list:
        for _ in range(2):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(release.wait), 0.05)
        return await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo("127.0.0.1", 80), 5)

    try:
        found = run_with_daemon_threads(main(), max_workers=2)
    finally:
        release.set()
        # Its threads end now, not while a later test counts threads.
        deadline = time.monotonic() + 5
        while any(t.name.startswith("agentrl-default") for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert {info[4] for info in found} == {("127.0.0.1", 80)}


def test_calls_queued_behind_hung_ones_own_no_thread_and_cancelled_ones_never_run():
    executor = DaemonExecutor(max_workers=2)
    unblock = threading.Event()
    ran: list[int] = []

    def hang(i: int) -> int:
        ran.append(i)
        unblock.wait(10)
        return i

    async def main():
        loop = asyncio.get_running_loop()
        threads_before = threading.active_count()
        hung = [loop.run_in_executor(executor, hang, i) for i in range(2)]
        for i in range(2, 52):  # 50 calls time out while queued behind the two hung ones
            try:
                await asyncio.wait_for(loop.run_in_executor(executor, hang, i), 0.001)
            except asyncio.TimeoutError:
                pass
        assert threading.active_count() - threads_before == 2 and executor.running == 2
        later = loop.run_in_executor(executor, hang, 99)  # queueing it drops the cancelled calls
        assert executor.waiting == 1
        unblock.set()
        results = await asyncio.gather(*hung, later)
        return results, threads_before

    results, threads_before = asyncio.run(main())
    assert results == [0, 1, 99] and sorted(ran) == [0, 1, 99]
    deadline = time.monotonic() + 2
    while executor.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert executor.running == 0 and executor.waiting == 0


def test_sync_calls_given_up_on_count_as_abandoned_while_their_threads_still_run():
    """A timed-out synchronous function keeps its thread and one of its tool's slots; the tool
    server's /stats (`abandoned_calls`) counted only coroutines, so a tool whose slots had all
    filled this way looked idle. Calls that time out while still queued never run, and never count."""
    from agentrl.tools.base import FunctionTool
    from agentrl.tools.threads import abandoned_calls, call_plugin

    unblock = threading.Event()

    def lookup(key: str) -> str:
        """Looks a key up, slowly.

        Args:
            key: The key.
        """
        unblock.wait(10)
        return key

    slow = FunctionTool(lookup, max_workers=2)

    async def main() -> list[int]:
        counts = [abandoned_calls()]
        for key in "abcd":  # two take both slots, two time out in the queue behind them
            try:
                await call_plugin(slow.execute("i", {"key": key}), timeout_s=0.05)
            except asyncio.TimeoutError:
                pass
        counts.append(abandoned_calls())
        unblock.set()
        deadline = time.monotonic() + 5
        while abandoned_calls() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        counts.append(abandoned_calls())
        return counts

    assert asyncio.run(main()) == [0, 2, 0]



def _rollout(tokenizer, tool, episodes, reward_fn=None, calls=4):
    """`episodes` at once, each one turn of `calls` parallel calls of `tool`, then an answer."""
    from agentrl.env.tool_env import ToolLimits
    from agentrl.rollout.collect import run_episodes
    from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
    from agentrl.tools.parsers import parse_hermes
    from agentrl.types import Completion, Task

    call = '<tool_call>\n{"name": "%s", "arguments": {"query": "q"}}\n</tool_call>' % tool.schema["function"]["name"]
    turns = [tokenizer("\n".join([call] * calls), add_special_tokens=False)["input_ids"] + [2],
             tokenizer("Done.", add_special_tokens=False)["input_ids"] + [2]]

    class Engine:  # the policy's side only: what it samples is scripted, per episode by its turn
        weight_version = 0

        async def generate(self, token_ids, sampling):
            ids = turns[0 if token_ids.count(1) < 4 else 1]  # <|im_start|>: (system,) user, assistant
            return Completion(ids, [-0.5] * len(ids), "stop", 0)

    settings = EpisodeSettings(max_turns=2, tool_limits=ToolLimits(timeout_s=60.0), reward_timeout_s=60.0)
    runner = EpisodeRunner(Engine(), tokenizer, [tool], parse_hermes, settings, reward_fn=reward_fn)
    tasks = [Task(id=f"t{i}", prompt="Look it up.") for i in range(episodes)]
    return run_episodes(runner, tasks, group_size=1, max_concurrent=episodes)


def test_every_call_the_episodes_can_make_at_once_gets_a_thread(tokenizer):
    """The timeout counts a call's wait for a thread (a tool whose threads all hang must not hold
    its episodes forever), so healthy calls queued behind a tool's 64 threads, or the loop's 32
    (`asyncio.to_thread`, graders), timed out. A rollout lets each take all its episodes can make.
    Each call waits on a barrier that only opens once all of them run at once."""
    from agentrl.tools.base import FunctionTool, tool

    barrier = threading.Barrier(20 * 4, timeout=20)  # 20 episodes x 4 parallel calls

    @tool
    def lookup(query: str) -> str:
        """Looks a query up.

        Args:
            query: What to look up.
        """
        barrier.wait()
        return "found"

    @tool
    async def fetch(query: str) -> str:
        """Fetches a query's page with a blocking client, off the event loop.

        Args:
            query: What to fetch.
        """
        await asyncio.to_thread(barrier.wait)
        return "found"

    for used in (lookup, fetch):
        barrier.reset()
        trajectories = _rollout(tokenizer, used, episodes=20)
        assert [(t.finish, t.error) for t in trajectories] == [("stop", None)] * 20, used.schema
        assert [t.metrics["tool_errors"] for t in trajectories] == [0] * 20
        assert [m["content"] for m in trajectories[0].messages if m["role"] == "tool"] == ["found"] * 4

    graders = threading.Barrier(40, timeout=20)

    def grade(task, messages):
        graders.wait()
        return 1.0

    trajectories = _rollout(tokenizer, lookup, episodes=40, reward_fn=grade, calls=0)
    assert [(t.finish, t.error, t.reward) for t in trajectories] == [("stop", None, 1.0)] * 40

    limited = FunctionTool(lookup.fn, max_workers=2)  # a bound of its own (a service taking 2 at once) stays
    limited.allow_calls(100)
    assert limited._threads.max_workers == 2
