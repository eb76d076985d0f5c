"""What one episode's plug-ins can do to the others and to the record: a tool's metrics cannot take
the episode's names, malformed call blocks are answered within the per-turn limit, and what an
interaction changes in its task stays in its own episode."""

from __future__ import annotations

import asyncio

from agentrl.env.interaction import Turn
from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.rollout.collect import collect
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.base import ToolResult
from agentrl.tools.parsers import ParsedTurn, parse_hermes
from agentrl.tools.threads import run_with_daemon_threads
from agentrl.types import Task, ToolCall
from tests.conftest import ScriptedEngine


class Meddler:
    """A tool whose metrics use names the episode sets."""

    schema = {"type": "function", "function": {"name": "meddle", "description": "Meddles.",
                                               "parameters": {"type": "object", "properties": {}}}}

    async def create(self, instance_id, **kwargs):
        return instance_id

    async def execute(self, instance_id, arguments):
        return ToolResult("found", metrics={"error": 1.0, "outcome_reward": 3.0, "interaction_score": 7.0,
                                            "hits": 2.0})

    async def reward(self, instance_id):
        return None

    async def release(self, instance_id):
        return None


def test_a_tools_metrics_cannot_take_the_episodes_names(tokenizer):
    """A successful episode reported error=1 and an interaction score it never had."""
    call = '<tool_call>\n{"name": "meddle", "arguments": {}}\n</tool_call>'
    runner = EpisodeRunner(ScriptedEngine(tokenizer, [call, "Done."]), tokenizer, [Meddler()], parse_hermes,
                           EpisodeSettings(), reward_fn=lambda task, messages: 0.5)
    traj = asyncio.run(runner.run(Task(id="m", prompt="Go."), group_id="g"))
    assert traj.finish == "stop" and traj.error is None
    assert "error" not in traj.metrics and "interaction_score" not in traj.metrics
    assert traj.metrics["outcome_reward"] == 0.5 and traj.metrics["hits"] == 2.0
    assert traj.metrics["tool_invalid_results"] == 3


def test_malformed_blocks_beyond_the_call_limit_get_one_message():
    env = ToolEnv([], ToolLimits(max_calls_per_turn=2), lambda text: (text, False))
    errors = [f"block {i} is not JSON" for i in range(60)]
    messages = asyncio.run(env.run_turn(ParsedTurn(calls=[ToolCall("nope", {})], errors=errors)))
    assert [m["content"] for m in messages] == [
        "Error: unknown tool 'nope'; available: none.", "Error: block 0 is not JSON", "Error: block 1 is not JSON",
        "Error: 58 more malformed tool calls were not read; at most 2 are answered per turn."]
    assert [m["name"] for m in messages[1:]] == ["parse_error"] * 3
    assert env.metrics["parse_errors"] == 60  # every one is counted


class Persona:
    """An interaction that takes its persona out of the task it is given."""

    seen: list = []

    async def start(self, task):
        Persona.seen.append(task.interaction_kwargs.pop("persona", None))

    async def respond(self, messages):
        return Turn("Thanks.", done=True, score=None)

    async def finish(self):
        return None


def test_what_an_interaction_changes_in_its_task_stays_in_its_episode(tokenizer):
    """Tools got a copy of their arguments; the interaction got the group's shared task, so the
    first episode's `pop` left the other three (and every later step) without a persona."""
    Persona.seen = []
    task = Task(id="p", prompt="Hi.", interaction_kwargs={"persona": "impatient"})
    rewarded = []
    runner = EpisodeRunner(ScriptedEngine(tokenizer, ["Hello."] * 4), tokenizer, [], parse_hermes, EpisodeSettings(),
                           interaction_factory=Persona,
                           reward_fn=lambda t, messages: rewarded.append(t.interaction_kwargs.pop("persona")) or 1.0)
    trajectories = asyncio.run(collect(runner, [task], group_size=4, max_concurrent=4))
    assert [t.error for t in trajectories] == [None] * 4
    assert Persona.seen == ["impatient"] * 4 and rewarded == ["impatient"] * 4
    assert task.interaction_kwargs == {"persona": "impatient"}


def run_group(tokenizer, reward_fn, **settings):
    runner = EpisodeRunner(ScriptedEngine(tokenizer, ["It is 4."] * 4), tokenizer, [], parse_hermes,
                           EpisodeSettings(**settings), reward_fn=reward_fn)
    # daemon threads, as a run has: asyncio.run would wait for a hung reward function's thread at its end
    return run_with_daemon_threads(collect(runner, [Task(id="r", prompt="2+2?", answer="#### 4")], group_size=4,
                                           max_concurrent=4))


def test_reward_functions_run_off_the_event_loop_several_at_once(tokenizer):
    """A grader that calls a judge held every episode while it ran: on the event loop, the four calls
    ran one after another, so four that wait for each other never met; and `asyncio.run` inside one
    failed every episode."""
    import threading

    meet = threading.Barrier(4, timeout=10)

    async def judge():
        return 1.0

    def grader(task, messages):
        meet.wait()
        return asyncio.run(judge())

    assert [(t.error, t.reward) for t in run_group(tokenizer, grader)] == [(None, 1.0)] * 4


def test_a_reward_function_that_hangs_fails_its_episode_at_the_timeout(tokenizer):
    import threading

    release = threading.Event()
    try:
        trajectories = run_group(tokenizer, lambda task, messages: release.wait(), reward_timeout_s=0.2)
    finally:
        release.set()
    assert [(t.finish, t.error) for t in trajectories] == [
        ("error", "TimeoutError: the reward function did not answer within 0.2 s (reward.timeout_s)")] * 4


class Rambler:
    """A simulated user who answers with a megabyte of text, then ends the episode."""

    async def start(self, task):
        self.replies = 0

    async def respond(self, messages):
        self.replies += 1
        return Turn("word " * 200_000, done=False, score=None) if self.replies == 1 else Turn("", done=True)

    async def finish(self):
        return None


def test_an_interactions_reply_is_cut_to_max_interaction_tokens(tokenizer):
    """The whole reply went into the context: a megabyte held the event loop for seconds, and then
    the episode ended at the context limit without the model seeing a word of it."""
    runner = EpisodeRunner(ScriptedEngine(tokenizer, ["Hello.", "Bye."]), tokenizer, [], parse_hermes,
                           EpisodeSettings(max_interaction_tokens=16, max_context_tokens=256),
                           interaction_factory=Rambler)
    traj = asyncio.run(runner.run(Task(id="u", prompt="Hi."), group_id="g"))
    assert (traj.finish, traj.error, traj.metrics["turns"]) == ("stop", None, 2.0)
    user = traj.messages[2]["content"]
    cut, was_cut = runner.renderer.truncate("word " * 200_000, 16, "reply")
    assert was_cut and user == cut and user.startswith("word word")
    assert user.endswith("\n[reply truncated to 16 tokens]")  # the user's reply, not a tool's output
    assert traj.metrics["interaction_truncations"] == 1.0


def test_a_non_finite_logprob_from_the_engine_fails_its_episode(tokenizer):
    """A diverged model's NaN was recorded: it would weight the update (truncated importance
    weights) and be written to the trajectory file as a bare NaN, which is no JSON."""
    from agentrl.types import Completion

    class Diverged(ScriptedEngine):
        async def generate(self, token_ids, sampling):
            done = await super().generate(token_ids, sampling)
            return Completion(done.token_ids, [float("nan")] + done.logprobs[1:], done.finish, done.weight_version)

    runner = EpisodeRunner(Diverged(tokenizer, ["The answer is 4."]), tokenizer, [], parse_hermes, EpisodeSettings())
    [traj] = run_with_daemon_threads(collect(runner, [Task(id="t", prompt="2+2?", answer="4")], 1, 1))
    assert (traj.finish, traj.error) == ("error", "ValueError: the engine gave sampled token 0 of turn 1 the logprob "
                                                  "nan (a diverged model?)")
    assert traj.loss_mask.count(1) == 0  # nothing of the turn was recorded as sampled
