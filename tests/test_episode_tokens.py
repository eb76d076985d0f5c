"""Token-in/token-out: exact ids and masks of a scripted two-turn episode with a tool call."""

from __future__ import annotations

from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.builtin.calculator import calculator
from agentrl.tools.parsers import parse_hermes
from agentrl.types import Task
from tests.conftest import ScriptedEngine

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
ANSWER = "1234 * 5678 = 7006652. The answer is 7006652."
TASK = Task(id="t1", prompt="What is 1234 * 5678?", answer="#### 7006652")


def run(tokenizer, engine, **settings):
    import asyncio

    runner = EpisodeRunner(engine, tokenizer, [calculator], parse_hermes, EpisodeSettings(**settings),
                           reward_fn=lambda task, messages: 1.0 if "7006652" in messages[-1]["content"] else 0.0)
    return asyncio.run(runner.run(TASK, group_id="g"))


def test_two_turn_episode_exact_ids_and_mask(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, ANSWER])
    traj = run(tokenizer, engine)

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": TASK.prompt}], tools=[calculator.schema],
                                           tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    turn1, turn2 = engine.turns
    # What the template adds between the sampled <|im_end|> and the next assistant turn, as ids
    # checked by hand against SmolLM2's vocabulary: '\n' <|im_start|> 'tool' '\n' '<' 'tool' '_'
    # 'response' '>' '\n' '7006652' (one id per digit) '\n' '</' 'tool' '_' 'response' '>'
    # <|im_end|> '\n' <|im_start|> 'ass' 'istant' '\n'.
    suffix = [198, 1, 19324, 198, 44, 19324, 79, 7639, 46, 198, 39, 32, 32, 38, 38, 37, 34, 198,
              9617, 19324, 79, 7639, 46, 2, 198, 1, 520, 9531, 198]

    assert traj.token_ids == prompt_ids + turn1 + suffix + turn2
    assert traj.loss_mask == [0] * len(prompt_ids) + [1] * len(turn1) + [0] * len(suffix) + [1] * len(turn2)
    assert turn1[-1] == 2 and turn2[-1] == 2  # the sampled <|im_end|> is trained
    # Logprobs sit exactly on the sampled tokens, in the engine's order.
    sampled = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
    assert sampled == [-0.01 * (i + 1) for i in range(len(turn1))] + [-0.01 * (i + 1) for i in range(len(turn2))]
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if not m)
    # The engine saw exactly the growing sequence, never a re-tokenisation.
    assert engine.prompts == [prompt_ids, prompt_ids + turn1 + suffix]

    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[1]["tool_calls"][0]["function"] == {"name": "calculator",
                                                             "arguments": {"expression": "1234 * 5678"}}
    assert traj.messages[2]["content"] == "7006652"
    assert traj.finish == "stop" and traj.reward == 1.0
    assert traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 1 and traj.metrics["tool_errors"] == 0


def test_decoded_ids_equal_template_rendering(tokenizer):
    traj = run(tokenizer, ScriptedEngine(tokenizer, [CALL, ANSWER]))
    rendered = tokenizer.apply_chat_template(traj.messages, tools=[calculator.schema], tokenize=False)
    decoded = tokenizer.decode(traj.token_ids, skip_special_tokens=False)
    # The one documented boundary difference: the template ends every turn with '\n' after
    # <|im_end|>; the final turn's newline is never sampled, so the ids stop at <|im_end|>.
    assert rendered == decoded + "\n"


def test_length_finish_keeps_partial_turn_trainable(tokenizer):
    traj = run(tokenizer, ScriptedEngine(tokenizer, [ANSWER], stop=False), max_new_tokens_per_turn=5)
    assert traj.finish == "length"
    assert traj.loss_mask[-5:] == [1] * 5 and sum(traj.loss_mask) == 5


def test_max_turns_stops_after_tool_turn(tokenizer):
    traj = run(tokenizer, ScriptedEngine(tokenizer, [CALL, CALL]), max_turns=1)
    assert traj.finish == "max_turns"
    assert traj.metrics["turns"] == 1 and traj.messages[-1]["role"] == "tool"


def test_context_budget_ends_episode_before_overflow(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, ANSWER])
    prompt_len = len(tokenizer.apply_chat_template([{"role": "user", "content": TASK.prompt}],
                                                   tools=[calculator.schema], add_generation_prompt=True,
                                                   return_dict=False))
    traj = run(tokenizer, engine, max_context_tokens=prompt_len + len(engine.turns[0]) + 5)
    assert traj.finish == "length"
    assert len(traj.token_ids) <= prompt_len + len(engine.turns[0]) + 5
    assert traj.messages[-1]["role"] == "assistant"  # the tool reply did not fit and was not appended
