"""The GSM8K interaction, the answer-checking tool, and how rewards are summed."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

from agentrl.env.gsm8k import GSM8KInteraction
from agentrl.env.interaction import Turn, load_interaction
from agentrl.env.rewards import gsm8k_reward
from agentrl.errors import ConfigError
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.builtin.gsm8k import CheckAnswer, parse_number
from agentrl.tools.parsers import parse_hermes
from agentrl.types import Task
from tests.conftest import ScriptedEngine

TASK = Task(id="q", prompt="Natalia sold 48 clips in April and half as many in May. How many in total?",
            answer="Natalia sold 48/2 = 24 clips in May.\n#### 72")


def test_interaction_retry_then_correct(tokenizer):
    engine = ScriptedEngine(tokenizer, ["The total is 70.", "Sorry, the total is 72."])
    runner = EpisodeRunner(engine, tokenizer, [], parse_hermes, EpisodeSettings(interaction_scores=True),
                           interaction_factory=lambda: GSM8KInteraction(max_attempts=2), reward_fn=gsm8k_reward)
    traj = asyncio.run(runner.run(TASK, group_id="g"))
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant"]
    assert traj.messages[2]["content"] == "Your answer is incorrect. Please check your work and try again."
    assert traj.reward == 2.0  # outcome 1 + interaction score 1
    assert traj.metrics["interaction_score"] == 1.0 and traj.finish == "stop"
    rendered = tokenizer.apply_chat_template(traj.messages, tokenize=False)
    assert tokenizer.decode(traj.token_ids) + "\n" == rendered
    user_ids = tokenizer("\n<|im_start|>user\n" + traj.messages[2]["content"] + "<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)["input_ids"]
    start = len(engine.prompts[1]) - len(user_ids)
    assert traj.token_ids[start:start + len(user_ids)] == user_ids
    assert traj.loss_mask[start:start + len(user_ids)] == [0] * len(user_ids)


def test_interaction_gives_up_after_max_attempts(tokenizer):
    engine = ScriptedEngine(tokenizer, ["It is 1.", "It is 2."])
    runner = EpisodeRunner(engine, tokenizer, [], parse_hermes, EpisodeSettings(),
                           interaction_factory=lambda: GSM8KInteraction(max_attempts=2), reward_fn=gsm8k_reward)
    traj = asyncio.run(runner.run(TASK, group_id="g"))
    assert traj.reward == 0.0 and traj.metrics["turns"] == 2 and traj.messages[-1]["role"] == "assistant"


def test_check_answer_step_and_final_rewards(tokenizer):
    call = '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "%s"}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [call % "72", call % "70", "Done: 72"])
    runner = EpisodeRunner(engine, tokenizer, [CheckAnswer()], parse_hermes,
                           EpisodeSettings(tool_step_rewards=True, tool_final_rewards=True), reward_fn=None)
    traj = asyncio.run(runner.run(TASK, group_id="g"))
    replies = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert replies == ["Correct.", "Not checked: an answer was already submitted, and only 1 submission per task "
                                   "can be checked."]
    assert traj.metrics["tool_step_reward"] == 1.0  # the first submission pays, once
    assert traj.reward == 2.0 and traj.metrics["answer_correct"] == 1.0


@pytest.mark.parametrize("text,value", [("The answer is 1,234.5.", 1234.5), ("$-7", -7.0), ("none", None),
                                        ("12 apples and 30 pears", 30.0),
                                        # LaTeX's thousands separators used to read as 200
                                        ("\\boxed{1{,}200}", 1200.0), ("$1\\,200$", 1200.0),
                                        ("$\\$1{,}234{,}567.5$", 1234567.5)])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text,value", [
    ("Let me think... 18", 18.0), ("Wait...18", 18.0), ("So,18", 18.0), ("...-5", -5.0),
    ("So,-18", -18.0), ("...18 and 1.2.3", 18.0), ("1.2.3", None), ("3,4,5", None), ("ages 3,-5", None)])
def test_prose_punctuation_before_a_number_does_not_hide_it(text, value):
    """A dot or comma that follows no digit is prose, not part of a number; 'Wait...18' was None."""
    assert parse_number(text) == value


@pytest.mark.timeout(30)
def test_parse_number_reads_a_reply_of_repeated_exponent_signs_in_linear_time():
    # Each "e-" could be matched two ways: 24 of them took seconds, the 128 a 256-token reply
    # holds would hold the event loop for good.
    assert parse_number("The answer is 1" + "e-" * 5000 + "!") == 1.0
    assert parse_number("Answer: 2.5e-3 and 1e+6") == 1e6


@pytest.mark.parametrize("answer,reply,parsed,reward", [
    ("#### 12", "Answer: 12 (ages 10-12)", 12.0, 1.0),  # a hyphen inside a range is not a minus
    ("#### 10", "Total: 10.\nTime: 2023-10-05", 10.0, 1.0),  # a date is not a number
    ("#### 7", "The answer is 7.\n\nSteps 1,2", 7.0, 1.0),  # nor a comma list
    ("#### 345", "The answers are 3,4,5", None, 0.0),  # ill-grouped commas are no thousands separators
    ("#### 0.5", "It is .5 of the cake", 0.5, 1.0),
    ("#### 1,234", "She has 1,234 apples.", 1234.0, 1.0),  # GSM8K's own format on both sides
    ("#### 1234567", "1,234,567", 1234567.0, 1.0),
    ("#### -3", "It is -3", -3.0, 1.0),
    ("#### -3", "It is \u22123", -3.0, 1.0),  # the typographic minus
    ("#### 1200.5", "$1,200.50", 1200.5, 1.0),
    ("#### 4", "Answer: 3-4", None, 0.0),  # a range is no answer
    ("#### 4", "5-1=4", 4.0, 1.0),
    ("#### 19", "COVID-19", 19.0, 1.0),  # after a letter the hyphen is no minus
    ("#### 1000000", "It is 1e6", 1e6, 1.0),  # the exponent belongs to the number: not 6
    ("#### 0.0025", "2.5E-3 of it", Fraction("0.0025"), 1.0),  # exactly: no float is 0.0025
    ("#### 6", "1e6", 1e6, 0.0),
    ("#### 3", "It takes 3 eggs, 3e", 3.0, 1.0),  # an 'e' without digits is a letter
    ("#### 4", "Between 1e3-1e4", None, 0.0),  # a range of exponents is still a range
    ("#### 5", "5 or 1e400", 5.0, 1.0),  # a number that overflows is no answer
])
def test_gsm8k_reward_reads_numbers_not_ranges_dates_or_lists(answer, reply, parsed, reward):
    assert parse_number(reply) == parsed
    assert gsm8k_reward(Task(id="x", prompt="p", answer=answer), [{"role": "assistant", "content": reply}]) == reward


@pytest.mark.parametrize("answer,reply,reward", [
    # past 2**53 a float is one for several whole numbers: truth + 1 and a rounded exponent form matched
    ("#### 210131379142599177585066", "210131379142599177585066", 1.0),
    ("#### 210131379142599177585066", "210131379142599177586066", 0.0),
    ("#### 9007199254740993", "9007199254740992", 0.0),  # 2**53 + 1 against 2**53
    ("#### 5573091967552379766250761329861300608558", "5.5730919675523801e+39", 0.0),
    ("#### 1,000,000,000,000,000,000", "1e18", 1.0),  # exactly that number, written another way
    # a decimal truth is matched within half a unit of its last place only
    ("#### 1450000.5", "1450000.5", 1.0),
    ("#### 1450000.5", "1450001.5", 0.0),
    ("#### 1450000.5", "1450000", 0.0),
    ("#### 2.25", "2.2500001", 1.0),  # rounding, within the relative tolerance
])
def test_answers_are_compared_exactly_to_the_truths_precision(answer, reply, reward):
    task = Task(id="x", prompt="p", answer=answer)
    assert gsm8k_reward(task, [{"role": "assistant", "content": reply}]) == reward
    check = CheckAnswer()
    asyncio.run(check.create("i", ground_truth=answer))
    assert asyncio.run(check.execute("i", {"answer": reply})).text == ("Correct." if reward else
                                                                      "Incorrect. No more answers will be checked.")


def test_gsm8k_reward_uses_last_number_of_final_message():
    assert gsm8k_reward(TASK, [{"role": "assistant", "content": "48 + 24 = 72"}]) == 1.0
    assert gsm8k_reward(TASK, [{"role": "assistant", "content": "72 is wrong, it is 73"}]) == 0.0
    assert gsm8k_reward(Task(id="x", prompt="p"), [{"role": "assistant", "content": "1"}]) == 0.0


def test_an_episode_that_ends_while_calling_tools_has_no_final_answer(tokenizer):
    """The calculator's argument ends with the right number; the episode never answered."""
    from agentrl.tools.builtin.calculator import calculator

    task = Task(id="m", prompt="What is 5678?", answer="#### 5678")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5678"\n</tool_call>'
    for turns, max_turns, finish, reward in [([call], 1, "max_turns", 0.0), ([broken], 1, "max_turns", 0.0),
                                             ([call, "It is 5678."], 2, "stop", 1.0)]:
        runner = EpisodeRunner(ScriptedEngine(tokenizer, turns), tokenizer, [calculator], parse_hermes,
                               EpisodeSettings(max_turns=max_turns), reward_fn=gsm8k_reward)
        traj = asyncio.run(runner.run(task, group_id="g"))
        assert (traj.finish, traj.reward) == (finish, reward), turns
    called = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "72"}'}}]}
    assert gsm8k_reward(TASK, [called]) == 0.0  # OpenAI-style calls (an agent's record), no tool reply yet
    assert gsm8k_reward(TASK, [{"role": "assistant", "content": [{"type": "text", "text": "It is 72."}]}]) == 1.0
    cut = EpisodeRunner(ScriptedEngine(tokenizer, ['<tool_call>\n{"name": "calculator", "arguments": '
                                                   '{"expression": "5678 + 5678"'], stop=False),
                        tokenizer, [calculator], parse_hermes, EpisodeSettings(max_new_tokens_per_turn=64),
                        reward_fn=gsm8k_reward)
    traj = asyncio.run(cut.run(task, group_id="g"))  # the call cut off by the length limit: no answer either
    assert traj.finish == "length" and "5678" in traj.messages[-1]["content"] and traj.reward == 0.0


def test_an_answer_cut_off_by_the_token_limit_is_no_answer(tokenizer):
    """'The total is 120 apples.' cut after '12' used to score as the answer 12."""
    task = Task(id="c", prompt="How many apples?", answer="#### 12")
    reply = "The total is 120 apples."
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    cut_at = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("12"))
    runner = EpisodeRunner(ScriptedEngine(tokenizer, [reply], stop=False), tokenizer, [], parse_hermes,
                           EpisodeSettings(max_new_tokens_per_turn=cut_at), reward_fn=gsm8k_reward)
    traj = asyncio.run(runner.run(task, group_id="g"))
    assert traj.finish == "length" and traj.messages[-1] == {"role": "assistant", "content": "The total is 12",
                                                             "truncated": True}
    assert traj.reward == 0.0
    assert gsm8k_reward(task, [{"role": "assistant", "content": "The total is 12"}]) == 1.0  # unmarked, it counts


def test_interaction_yaml(tmp_path):
    factory = load_interaction("tool_configs/gsm8k_interaction.yaml")
    assert factory().max_attempts == 2 and factory() is not factory()
    bad = tmp_path / "bad.yaml"
    bad.write_text("interactions:\n  - class: agentrl.env.gsm8k:GSM8KInteraction\n    config: {max_attempts: 0}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: interaction 'agentrl.env.gsm8k:GSM8KInteraction': config"):
        load_interaction(bad)


class Judge:
    """An interaction for the loader tests: a typed config with a secret in it."""

    def __init__(self, model: str, api_key: str, tolerance: float = 0.0):
        if not model.startswith("judge-"):
            raise ValueError(f"unknown judge model {model!r}")
        self.tolerance = tolerance

    async def start(self, task): return None  # noqa: E704
    async def respond(self, messages): return None  # noqa: E704
    async def finish(self): return None  # noqa: E704


class BlockingJudge(Judge):
    def respond(self, messages): return None  # noqa: E704


@pytest.mark.parametrize("entry,message", [
    ("{class: tests.test_interaction_and_rewards:Judge, config: {model: gpt, api_key: sk-live-SECRET}}",
     "config {'model': 'gpt', 'api_key': '***'} rejected (unknown judge model 'gpt')"),
    ("{class: tests.test_interaction_and_rewards:Judge, config: {model: judge-1, api_key: k, tolerance: [1]}}",
     "config.tolerance = [1]: expected float"),
    ("{class: tests.test_interaction_and_rewards:Judge, config: []}", "key 'config' must be a mapping, not list"),
    ("{class: tests.test_interaction_and_rewards:BlockingJudge, config: {model: judge-1, api_key: k}}",
     "method(s) respond must be 'async def'"),
    ("{class: 7}", "interaction #1: key 'class' must be text"),
])
def test_bad_interaction_files_name_the_key_and_hide_secrets(tmp_path, entry, message):
    path = tmp_path / "judge.yaml"
    path.write_text(f"interactions:\n  - {entry}\n")
    with pytest.raises(ConfigError) as err:
        load_interaction(path)
    assert str(err.value).startswith(f"{path}: interaction") and message in str(err.value)
    assert "SECRET" not in str(err.value)


class LoopJudge(Judge):
    """A constructor that needs the running loop (an async HTTP client's session made in it)."""

    def __init__(self, model: str, api_key: str):
        super().__init__(model, api_key)
        self.loop = asyncio.get_running_loop()


def test_an_interaction_built_on_the_event_loop_loads(tmp_path):
    """Each episode builds its instance on the event loop; the load-time check built one outside
    any loop, so such a constructor was refused with "no running event loop"."""
    path = tmp_path / "judge.yaml"
    path.write_text("interactions:\n  - {class: tests.test_interaction_and_rewards:LoopJudge, "
                    "config: {model: judge-1, api_key: k}}\n")
    factory = load_interaction(path)

    async def in_an_episode():
        return factory(), load_interaction(path), asyncio.get_running_loop()  # loaded on a loop too

    judge, again, loop = asyncio.run(in_an_episode())
    assert judge.loop is loop and again is not None
    with pytest.raises(RuntimeError, match="no running event loop"):
        factory()  # what the check did


def test_interaction_config_values_are_converted_to_the_constructors_types(tmp_path):
    path = tmp_path / "judge.yaml"  # YAML reads 1e-6 as text
    path.write_text("interactions:\n  - {class: tests.test_interaction_and_rewards:Judge, "
                    "config: {model: judge-1, api_key: k, tolerance: 1e-6}}\n")
    assert load_interaction(path)().tolerance == 1e-6


def test_a_reward_function_with_the_wrong_signature_stops_before_any_model_loads():
    """It used to be found only after a whole rollout, every episode failed by its TypeError."""
    from agentrl.env.rewards import load_reward_fn

    with pytest.raises(ConfigError) as refused:
        load_reward_fn("agentrl.env.rewards:final_answer_text")
    assert str(refused.value) == ("reward.function: 'agentrl.env.rewards:final_answer_text' must take "
                                  "(task, messages), not (messages: 'list[dict[str, Any]]') -> 'str'")
    assert load_reward_fn("agentrl.env.rewards:gsm8k_reward").__name__ == "gsm8k_reward"


async def async_judge(task, messages):  # refused as a reward function below
    return 1.0


def test_an_async_reward_function_stops_before_any_model_loads():
    """It used to pass the check and fail every episode with 'returned <coroutine …>'."""
    from agentrl.env.rewards import load_reward_fn

    with pytest.raises(ConfigError) as refused:
        load_reward_fn("tests.test_interaction_and_rewards:async_judge")
    assert str(refused.value).startswith("reward.function: 'tests.test_interaction_and_rewards:async_judge' is async")


class MeddlingJudge:
    """Appends its own prompt and rewrites the answer it reads, then asks again (text None the 2nd time)."""

    async def start(self, task):
        self.calls = 0

    async def respond(self, messages):
        self.calls += 1
        messages.append({"role": "user", "content": "JUDGE PROMPT: grade this"})
        messages[-2]["content"] = "THE ANSWER IS 72."
        return Turn("Try again." if self.calls == 1 else None, done=False)

    async def finish(self):
        pass


def test_a_judge_or_reward_function_cannot_change_what_the_episode_recorded(tokenizer):
    """Interactions and the reward function used to get the episode's own message list: a judge
    appending its prompt put it into the recorded conversation, and an edit made the messages
    disagree with the sampled tokens. A judge that returns text None fails the episode instead of
    showing the model an empty user turn."""
    seen = []

    def meddling_reward(task, messages):
        seen.append(messages[-1]["content"])
        messages.clear()
        return 1.0

    engine = ScriptedEngine(tokenizer, ["It is 70.", "It is 72."])
    runner = EpisodeRunner(engine, tokenizer, [], parse_hermes, EpisodeSettings(), interaction_factory=MeddlingJudge,
                           reward_fn=meddling_reward)
    traj = asyncio.run(runner.run(TASK, group_id="g"))
    assert traj.finish == "error" and traj.error == "InteractionError: the interaction's respond returned text None, not a string"
    assert [(m["role"], m["content"]) for m in traj.messages] == [
        ("user", TASK.prompt), ("assistant", "It is 70."), ("user", "Try again."), ("assistant", "It is 72.")]
    assert tokenizer.decode(traj.token_ids) + "\n" == tokenizer.apply_chat_template(traj.messages, tokenize=False)

    engine = ScriptedEngine(tokenizer, ["It is 72."])
    runner = EpisodeRunner(engine, tokenizer, [], parse_hermes, EpisodeSettings(), reward_fn=meddling_reward)
    traj = asyncio.run(runner.run(TASK, group_id="g"))
    assert traj.reward == 1.0 and seen == ["It is 72."] and len(traj.messages) == 2


class Replying:
    """An interaction whose every reply is `reply`, recording its calls in `log`."""

    def __init__(self, reply, log=None):
        self.reply, self.log = reply, log if log is not None else []

    async def start(self, task):
        self.log.append(("start", dict(task.interaction_kwargs)))

    async def respond(self, messages):
        self.log.append("respond")
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply

    async def finish(self):
        self.log.append("finish")


def run_with(tokenizer, interaction, turns=("4", "5"), tools=(), task=TASK):
    runner = EpisodeRunner(ScriptedEngine(tokenizer, list(turns)), tokenizer, list(tools), parse_hermes,
                           EpisodeSettings(), interaction_factory=interaction)
    return asyncio.run(runner.run(task, "g"))


@pytest.mark.parametrize("reply,error", [
    ((False, "Try again.", 0.0, {}), "returned (False, 'Try again.', 0.0, {}), not a Turn(text, done, score) "
                                      "(agentrl.env.interaction.Turn; verl's (done, text, score, metadata) tuple is "
                                      "not one)"),
    (Turn("Try again.", "false"), "returned done='false', not True or False"),  # a truthy string ended the episode
    (KeyError("score"), "raised KeyError: 'score'"),  # read like a reward function's failure
    (TimeoutError("judge API: read timed out"), "raised TimeoutError: judge API: read timed out"),
])
def test_an_interactions_failure_is_named_as_the_interactions(tokenizer, reply, error):
    """A tuple failed with "'tuple' object has no attribute 'score'", a judge's own TimeoutError
    was reported as rollout.interaction_timeout_s running out (its message dropped), and what
    respond raised read like anyone's."""
    log = []
    traj = run_with(tokenizer, lambda: Replying(reply, log))
    assert (traj.finish, traj.error) == ("error", f"InteractionError: the interaction's respond {error}")
    assert log == [("start", {}), "respond", "finish"]


def test_every_episode_builds_its_interaction_from_its_own_config_and_sees_its_tasks_kwargs(tmp_path, tokenizer):
    """The config's list was one object shared by every episode's instance."""
    path = tmp_path / "judge.yaml"
    path.write_text("interactions:\n  - {class: tests.test_interaction_and_rewards:Replying, "
                    "config: {reply: null, log: [seed]}}\n")
    factory = load_interaction(path)
    task = Task(id="q", prompt="Book a flight.", interaction_kwargs={"persona": "impatient"})
    first, second = run_with(tokenizer, factory, task=task), run_with(tokenizer, factory, task=task)
    assert first.error == second.error == "InteractionError: the interaction's respond returned None, not a " \
        "Turn(text, done, score) (agentrl.env.interaction.Turn; verl's (done, text, score, metadata) tuple is not one)"
    assert factory().log == ["seed"]  # no episode's calls in a later instance's config
    instance = factory()
    asyncio.run(instance.start(task))
    assert instance.log == ["seed", ("start", {"persona": "impatient"})]


class ExitingJudge(Replying):
    def __init__(self):
        raise SystemExit("judge CLI: missing --api-key")


def test_an_interaction_constructor_that_exits_is_a_config_error_at_load_and_a_failed_episode_later(tmp_path,
                                                                                                      tokenizer):
    path = tmp_path / "judge.yaml"
    path.write_text("interactions:\n  - {class: tests.test_interaction_and_rewards:ExitingJudge}\n")
    with pytest.raises(ConfigError) as err:  # SystemExit went through the loader
        load_interaction(path)
    assert str(err.value) == (f"{path}: interaction 'tests.test_interaction_and_rewards:ExitingJudge': config {{}} "
                              "rejected (SystemExit: judge CLI: missing --api-key)")
    traj = run_with(tokenizer, ExitingJudge)  # one that starts failing mid-run: this episode, not the run
    assert (traj.finish, traj.error) == ("error", "InteractionError: the interaction's constructor raised "
                                                  "SystemExit: judge CLI: missing --api-key")


class Unreachable(BaseException):
    """A client library's own abort, outside Exception (as gevent's Timeout is)."""


class UnreachableJudge(Replying):
    def __init__(self):
        raise Unreachable("judge endpoint down")


def test_an_interaction_constructor_raising_its_own_base_exception_fails_at_load_or_that_episode(tmp_path, tokenizer):
    """Only SystemExit was caught: another BaseException left the loader as itself, and mid-run it
    went through the rollout's `except Exception` and ended the run."""
    path = tmp_path / "judge.yaml"
    path.write_text("interactions:\n  - {class: tests.test_interaction_and_rewards:UnreachableJudge}\n")
    with pytest.raises(ConfigError) as err:
        load_interaction(path)
    assert str(err.value) == (f"{path}: interaction 'tests.test_interaction_and_rewards:UnreachableJudge': config {{}} "
                              "rejected (Unreachable: judge endpoint down)")
    traj = run_with(tokenizer, UnreachableJudge)  # one that starts failing mid-run: this episode, not the run
    assert (traj.finish, traj.error) == ("error", "InteractionError: the interaction's constructor raised "
                                                  "Unreachable: judge endpoint down")


def test_a_second_cancellation_during_the_tools_release_still_finishes_the_interaction(tokenizer):
    """finish() was awaited after the tools' release, so a cancellation landing there skipped it and
    a remote judge's session leaked."""
    log = []

    class SlowRelease:
        schema = {"type": "function", "function": {"name": "t", "description": "d",
                                                   "parameters": {"type": "object", "properties": {}}}}

        async def create(self, instance_id, **kwargs):
            return instance_id

        async def execute(self, instance_id, arguments):
            return "x"

        async def reward(self, instance_id):
            return 0.0

        async def release(self, instance_id):
            log.append("release begins")
            await asyncio.sleep(0.2)

    class Stuck(ScriptedEngine):
        async def generate(self, token_ids, sampling):
            await asyncio.sleep(10)

    async def scenario():
        runner = EpisodeRunner(Stuck(tokenizer, []), tokenizer, [SlowRelease()], parse_hermes, EpisodeSettings(),
                               interaction_factory=lambda: Replying(None, log))
        episode = asyncio.create_task(runner.run(TASK, "g"))
        while ("start", {}) not in log:
            await asyncio.sleep(0.01)
        episode.cancel()
        while "release begins" not in log:
            await asyncio.sleep(0.01)
        episode.cancel()  # a second one, as a stopping run sends
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(scenario())
    assert log == [("start", {}), "release begins", "finish"]


def test_a_tools_own_timeout_error_keeps_its_message_and_is_not_counted_as_a_timeout(tokenizer):
    from agentrl.tools.base import tool

    @tool
    def fetch(url: str) -> str:
        """Fetch a page.

        Args:
            url: where
        """
        raise TimeoutError("upstream 504")

    call = '<tool_call>\n{"name": "fetch", "arguments": {"url": "http://127.0.0.1:9/"}}\n</tool_call>'
    runner = EpisodeRunner(ScriptedEngine(tokenizer, [call, "Done."]), tokenizer, [fetch], parse_hermes,
                           EpisodeSettings())
    traj = asyncio.run(runner.run(TASK, "g"))
    assert traj.messages[2]["content"] == "Error: fetch failed: TimeoutError: upstream 504"
    assert traj.metrics["tool_timeouts"] == 0 and traj.metrics["tool_errors"] == 1


def test_a_slow_interaction_constructor_is_named_once(tokenizer, capsys, monkeypatch):
    """The constructor runs on the event loop for every episode: loading a judge there stalls them
    all. The run goes on; one warning says what to move where."""
    import time

    from agentrl.tools import threads

    monkeypatch.setattr(threads, "BLOCK_WARN_S", 0.05)
    monkeypatch.setattr(threads, "_blockers_named", set())

    class SlowJudge(GSM8KInteraction):
        def __init__(self):
            time.sleep(0.1)  # a model loaded per episode
            super().__init__(max_attempts=1)

    for _ in range(2):
        runner = EpisodeRunner(ScriptedEngine(tokenizer, ["It is 72."]), tokenizer, [], parse_hermes,
                               EpisodeSettings(), interaction_factory=SlowJudge, reward_fn=gsm8k_reward)
        assert asyncio.run(runner.run(TASK, group_id="g")).reward == 1.0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agentrl: warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "agentrl: warning: the interaction's constructor held the event loop for 0.1 s without yielding")
    assert "do per-episode set-up in `async def start`" in warnings[0]


def test_check_answer_takes_the_number_models_often_send_as_a_number():
    from agentrl.tools.base import argument_problem

    tool = CheckAnswer()
    assert argument_problem(tool, {"answer": 18}) is None and argument_problem(tool, {"answer": "18"}) is None
    assert argument_problem(tool, {"answer": [18]}) == "bad arguments for check_answer: [18] is not of type 'string', 'number'."


def test_a_wrong_whole_number_is_never_right_however_large_the_answer():
    """The tolerance was relative (1e-6 of the truth): 1,450,001 scored as 1,450,000, in the
    reward, in check_answer's reply and in the interaction's score."""
    task = Task(id="t", prompt="?", answer="#### 1450000")
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert [gsm8k_reward(task, reply(f"The answer is {n}.")) for n in ("1,450,000", "1450001", "1,449,999")] == \
        [1.0, 0.0, 0.0]
    assert gsm8k_reward(Task(id="t", prompt="?", answer="#### 2.5"), reply("It is 2.5000001.")) == 1.0  # rounding

    async def check(answer) -> str:
        tool = CheckAnswer(max_attempts=3)
        await tool.create("e/check_answer", ground_truth="1450000")
        return (await tool.execute("e/check_answer", {"answer": answer})).text

    assert asyncio.run(check(1450001)).startswith("Incorrect.") and asyncio.run(check("1,450,000")) == "Correct."
    interaction = GSM8KInteraction(max_attempts=1)
    asyncio.run(interaction.start(task))
    assert asyncio.run(interaction.respond(reply("1450001"))).score == 0.0


def test_an_integer_too_large_for_a_float_is_no_answer():
    """JSON lets a 400-digit integer through: check_answer failed with an OverflowError."""
    assert parse_number(10**400) is None and parse_number(float("inf")) is None and parse_number(7) == 7.0

    async def check() -> str:
        tool = CheckAnswer()
        await tool.create("e/check_answer", ground_truth="18")
        return (await tool.execute("e/check_answer", {"answer": 10**400})).text

    assert asyncio.run(check()) == "Error: the answer must contain a number."
