"""`check_answer` checks a limited number of submissions, so a policy cannot guess its way to the reward.

A checker that answered every guess let a model try number after number, then state the one marked
"Correct.": the recipe's outcome reward (and eval accuracy, which keeps the tools) paid for it. The
episodes here run through the real loop, tool file and recipe settings, with an engine that guesses.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from agentrl.errors import ConfigError
from agentrl.recipe import load_recipe
from agentrl.rollout.episode import EpisodeRunner
from agentrl.rollout.run import episode_settings, load_user_parts
from agentrl.tools.builtin.gsm8k import CheckAnswer
from agentrl.tools.loader import load_tools
from agentrl.tools.parsers import parse_hermes
from agentrl.types import Completion, Task

TASK = Task(id="q", prompt="Pick the number I am thinking of, between 10 and 17.", answer="#### 15")
GUESSES = [[10, 11, 12, 13], [14, 15, 16, 17]]  # one turn each, within the recipe's 4 calls per turn


def call(n: int) -> str:
    return '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "%d"}}\n</tool_call>' % n


class GuessingEngine:
    """A policy that knows nothing and asks the checker: it submits the guesses a turn at a time,
    then states the guess the checker marked "Correct." (if any) as its final answer."""

    def __init__(self, tokenizer, guesses: list[list[int]]):
        self.tokenizer, self.guesses, self.turn = tokenizer, guesses, 0
        self.weight_version = 0

    async def generate(self, token_ids, sampling) -> Completion:
        prompt = self.tokenizer.decode(token_ids)
        if self.turn < len(self.guesses):
            text = "\n".join(call(n) for n in self.guesses[self.turn])
        else:
            replies = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
            tried = [n for turn in self.guesses for n in turn]
            marked = [n for n, reply in zip(tried, replies) if reply == "Correct."]
            text = f"The answer is {marked[0]}." if marked else "I could not work it out."
        self.turn += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [2]
        return Completion(ids, [-0.01] * len(ids), "stop", self.weight_version)


def run_recipe_episode(tokenizer, overrides: list[str] = (), guesses=GUESSES):
    config = load_recipe("recipes/gsm8k_tool.yaml", list(overrides))
    tools, interaction, reward_fn = load_user_parts(config)
    runner = EpisodeRunner(GuessingEngine(tokenizer, guesses), tokenizer, tools, parse_hermes,
                           episode_settings(config), interaction, reward_fn)
    return asyncio.run(runner.run(TASK, group_id="g"))


@pytest.mark.parametrize("overrides", [[], ["reward.tool_step_rewards=true", "reward.tool_final_rewards=true"]],
                         ids=["recipe", "with-tool-rewards"])
def test_guessing_through_the_checker_no_longer_finds_the_answer(tokenizer, overrides):
    traj = run_recipe_episode(tokenizer, overrides)
    replies = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(replies) == 8 and "Correct." not in replies  # guess 15 came after the first, wrong, one
    assert replies[0] == "Incorrect. No more answers will be checked."
    assert set(replies[1:]) == {"Not checked: an answer was already submitted, and only 1 submission per task "
                                "can be checked."}
    assert traj.messages[-1]["content"] == "I could not work it out."
    assert traj.reward == 0.0
    assert traj.metrics["tool_step_reward"] == 0.0 and traj.metrics["tool_final_reward"] == 0.0
    assert traj.metrics["answer_correct"] == 0.0 and traj.metrics["answers_refused"] == 7.0


def test_a_right_first_submission_still_pays_once(tokenizer):
    traj = run_recipe_episode(tokenizer, ["reward.tool_step_rewards=true", "reward.tool_final_rewards=true"],
                              guesses=[[15, 15]])
    assert [m["content"] for m in traj.messages if m["role"] == "tool"][0] == "Correct."
    assert traj.messages[-1]["content"] == "The answer is 15."
    assert traj.reward == 3.0  # outcome 1 + one step reward + the final reward
    assert traj.metrics["answer_correct"] == 1.0 and traj.metrics["answers_refused"] == 1.0


def test_more_attempts_give_feedback_but_the_tool_reward_counts_the_first():
    tool = CheckAnswer(max_attempts=3)

    async def episode():
        await tool.create("e", ground_truth="#### 15")
        results = [await tool.execute("e", {"answer": a}) for a in ("no number", "14", "15", "16", "15")]
        return results, await tool.reward("e")

    results, final = asyncio.run(episode())
    assert [r.text for r in results] == [
        "Error: the answer must contain a number.",  # reveals nothing, so it uses up no submission
        "Incorrect. You may submit 2 more answers.", "Correct.", "Incorrect. No more answers will be checked.",
        "Not checked: an answer was already submitted, and only 3 submissions per task can be checked."]
    assert [r.reward for r in results] == [None, 0.0, None, None, None] and final == 0.0
    assert [r.metrics for r in results] == [{}, {"answer_correct": 0.0}, {}, {}, {"answers_refused": 1.0}]
    assert "only your first 3 submissions are checked" in tool.schema["function"]["description"]
    assert "only your first submission is checked" in CheckAnswer().schema["function"]["description"]


@pytest.mark.parametrize("value, shown", [("0", "got 0"), ("2.5", "2.5")])
def test_a_max_attempts_below_one_or_not_whole_is_refused_naming_the_file(tmp_path, value, shown):
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class: check_answer\n    config: {{max_attempts: {value}}}\n")
    with pytest.raises(ConfigError, match=re.escape(str(path))) as err:
        load_tools(path)
    assert "max_attempts" in str(err.value) and shown in str(err.value)
    assert len(str(err.value).splitlines()) == 1
