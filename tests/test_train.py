"""The training side: chunked logprobs, one PPO step's direction, weight sync, GAE targets, the critic,
and `agentrl train` end to end through the real CLI."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from agentrl.config import AlgorithmConfig
from agentrl.recipe import load_recipe
from agentrl.rollout.hf_engine import HFEngine
from agentrl.trainer.critic import CriticWorker, ValueModel
from agentrl.trainer.logprobs import pad_sequences, token_logprobs
from agentrl.trainer.policy import PolicyWorker, batched_logprobs
from agentrl.trainer.returns import gae_targets, outcome_advantages, token_advantages, token_rewards
from agentrl.types import SamplingParams, Trajectory

from conftest import make_tiny_llama

PROMPT = [1, 504, 3301, 314, 2107, 30, 2, 198]
COMPLETION = [1342, 314, 216, 35, 36, 37, 30, 2]
SEQUENCE, MASK = PROMPT + COMPLETION, [0] * len(PROMPT) + [1] * len(COMPLETION)


def sequence_logprob(model) -> float:
    with torch.no_grad():
        return sum(batched_logprobs(model, [SEQUENCE], [MASK], 2, 1.0, 4096)[0])


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_chunked_logprobs_equal_a_full_forward(tiny_model, temperature):
    sequences = [SEQUENCE, PROMPT + COMPLETION[:3]]
    masks = [MASK, [0] * len(PROMPT) + [1] * 3]
    batch = pad_sequences(sequences, masks, pad_id=2)
    with torch.no_grad():
        logprobs_BT, entropy_BT = token_logprobs(tiny_model, batch, temperature=temperature, chunk_rows=3)
        for row, seq in enumerate(sequences):
            logp_TV = torch.log_softmax(tiny_model(torch.tensor([seq])).logits[0].float() / temperature, dim=-1)
            expected = logp_TV[:-1].gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)
            wanted = torch.tensor(masks[row][1:], dtype=torch.bool)
            got = logprobs_BT[row, 1:len(seq)]
            torch.testing.assert_close(got[wanted], expected[wanted], atol=1e-5, rtol=0)
            assert (got[~wanted] == 0).all() and (logprobs_BT[row, len(seq):] == 0).all()
            entropy = -(logp_TV.exp() * logp_TV).sum(-1)[:-1]
            torch.testing.assert_close(entropy_BT[row, 1:len(seq)][wanted], entropy[wanted], atol=1e-4, rtol=0)


def test_the_entropy_carries_a_gradient_only_when_a_loss_term_asks_for_it(tiny_model):
    """Without an entropy term the entropy is a figure to report: no graph behind it, so the
    backward pass's recomputation of each head chunk stops at the logprobs."""
    batch = pad_sequences([SEQUENCE], [MASK], pad_id=2)
    reported = token_logprobs(tiny_model, batch, temperature=0.7, chunk_rows=3)
    trained = token_logprobs(tiny_model, batch, temperature=0.7, chunk_rows=3, entropy_grad=True)
    assert reported[0].requires_grad and not reported[1].requires_grad
    assert trained[0].requires_grad and trained[1].requires_grad
    assert torch.equal(reported[0], trained[0]) and torch.equal(reported[1], trained[1].detach())
    trained[1].sum().backward()
    assert tiny_model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_the_policy_steps_adamw_on_the_fused_kernel_with_torchs_reference_result():
    """On a CPU torch's default AdamW loops over the tensors in Python (0.34-0.66 s a step for
    SmolLM2-135M against 0.04-0.06 s fused): the workers ask for the fused kernel."""
    worker = PolicyWorker(make_tiny_llama(), 2, lr=1e-2, temperature=1.0)
    assert worker.optimizer.defaults["fused"] is True
    reference = make_tiny_llama()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    worker.update([SEQUENCE], [MASK], [[1.0] * len(SEQUENCE)])
    batch = pad_sequences([SEQUENCE], [MASK], pad_id=2)
    logprobs_BT, _ = token_logprobs(reference, batch)
    (-(logprobs_BT * batch.mask_BT).sum() / batch.mask_BT.sum()).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()
    moved = 0
    for (name, ours), theirs in zip(worker.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5, msg=name)
        moved += not torch.equal(ours, make_tiny_llama().get_parameter(name))
    assert moved > 0


def test_no_gradient_outlives_an_update():
    """The last optimizer step left every gradient allocated, a model-sized block that a colocated
    engine could not take back through the sync and the next rollout."""
    policy = PolicyWorker(make_tiny_llama(), 2, lr=1e-2, temperature=1.0, mini_batches=1, ppo_epochs=2)
    policy.update([SEQUENCE], [MASK], [[1.0 * m for m in MASK]], old_logprobs=[[-1.0] * len(SEQUENCE)])
    critic = CriticWorker(ValueModel.from_policy(make_tiny_llama()), 2, lr=1e-2, value_clip=None)
    critic.update([SEQUENCE], [MASK], [[1.0 * m for m in MASK]], critic.values([SEQUENCE], [MASK]))
    for worker in (policy, critic):
        assert worker.optimizer.state  # it stepped
        assert [n for n, p in worker.model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_step_moves_sequence_logprob_with_the_advantage_sign(advantage):
    model = make_tiny_llama()
    before = sequence_logprob(model)
    worker = PolicyWorker(model, 2, lr=1e-3, temperature=1.0)
    metrics = worker.update([SEQUENCE], [MASK], [[advantage * m for m in MASK]])
    after = sequence_logprob(model)
    assert (after - before) * advantage > 0.05, (before, after)
    assert metrics["clip_fraction"] == 0.0 and metrics["grad_norm"] > 0 and metrics["lr"] == 1e-3


def test_weight_sync_makes_engine_logprobs_equal_the_trainers():
    policy_model = make_tiny_llama()
    engine = HFEngine(copy.deepcopy(policy_model), pad_token_id=2)
    policy = PolicyWorker(policy_model, 2, lr=1e-2, temperature=1.0)

    def trainer_logprobs() -> list[float]:
        return policy.logprobs([SEQUENCE], [MASK])[0][len(PROMPT):]

    engine_before = engine.score(SEQUENCE, len(PROMPT))
    torch.testing.assert_close(torch.tensor(engine_before), torch.tensor(trainer_logprobs()), atol=1e-5, rtol=0)

    policy.update([SEQUENCE], [MASK], [[m * 1.0 for m in MASK]])
    trained = torch.tensor(trainer_logprobs())
    assert (trained - torch.tensor(engine_before)).abs().max() > 1e-2  # the update moved the policy
    assert engine.score(SEQUENCE, len(PROMPT)) == engine_before  # the engine is stale until the sync

    engine.update_weights(policy.named_weights(), version=1, flush_cache=True)
    engine_after = torch.tensor(engine.score(SEQUENCE, len(PROMPT)))
    torch.testing.assert_close(engine_after, trained, atol=1e-5, rtol=0)
    assert engine.weight_version == 1
    # Sampled logprobs agree too: what the rollout records is what the trainer recomputes.
    completion = engine.generate_batch([PROMPT], [SamplingParams(max_new_tokens=6, temperature=1.0)])[0]
    recomputed = policy.logprobs([PROMPT + completion.token_ids], [[0] * len(PROMPT) + [1] * 6])[0][len(PROMPT):]
    torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(recomputed), atol=1e-5, rtol=0)


def make_trajectory(reward: float, pieces: list[tuple[int, bool]]) -> Trajectory:
    """pieces: (number of tokens, trainable) runs, ids 10, 11, ..."""
    traj = Trajectory(task_id="t", group_id="g")
    for n, trainable in pieces:
        start = len(traj.token_ids) + 10
        traj.append(list(range(start, start + n)), trainable=trainable, logprobs=[-0.5] * n if trainable else None)
    traj.reward = reward
    return traj


def test_outcome_advantages_with_kl_to_go():
    trajectories = [make_trajectory(1.0, [(2, False), (2, True)]), make_trajectory(0.0, [(2, False), (2, True)])]
    algo = AlgorithmConfig(advantage="dr_grpo", kl_coef=0.5)
    per_sequence = outcome_advantages(trajectories, 2, algo)
    assert per_sequence == [0.5, -0.5]
    assert token_advantages(trajectories, per_sequence, algo) == [[0, 0, 0.5, 0.5], [0, 0, -0.5, -0.5]]
    kl = [[9.0, 9.0, 0.2, 0.4], [9.0, 9.0, 0.0, 0.0]]  # KL on masked tokens is ignored
    got = token_advantages(trajectories, per_sequence, algo, kl)
    # token 3: 0.5 - 0.5*0.4 = 0.3; token 2: 0.5 - 0.5*(0.2 + 0.4) = 0.2
    assert got[0] == pytest.approx([0, 0, 0.2, 0.3]) and got[1] == [0, 0, -0.5, -0.5]


def test_rewards_that_float32_cannot_tell_apart_still_get_advantages():
    """The rewards went through float32 before the group statistics (in float64): 1000 and
    1000.00002 became one value, and the group got advantage 0."""
    trajectories = [make_trajectory(r, [(1, True)]) for r in (1000.0, 1000.00002, 1000.0, 1000.00002)]
    got = outcome_advantages(trajectories, 4, AlgorithmConfig(advantage="grpo"))
    std = statistics.stdev([1000.0, 1000.00002, 1000.0, 1000.00002])  # unbiased, as GRPO's
    expected = 0.00001 / (std + 1e-6)  # eps 1e-6 as in grpo_advantages
    assert got == pytest.approx([-expected, expected, -expected, expected], rel=1e-6) and expected > 0.79


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_reinforce_pp_subtracts_the_kl_to_go_then_whitens_over_tokens(scale):
    """REINFORCE++ (arXiv:2501.03262): the return (reward less the group's mean, minus kl_coef times
    the KL-to-go) whitened over the batch's trained tokens. Whitening each episode's reward first
    gave the same advantages at any reward scale and left them off centre."""
    trajectories = [make_trajectory(scale, [(2, False), (2, True), (1, False)]),
                    make_trajectory(0.0, [(2, False), (2, True), (1, False)])]
    algo = AlgorithmConfig(advantage="reinforce_pp", kl_coef=0.5, kl_in_reward=True)
    per_sequence = outcome_advantages(trajectories, 2, algo)
    assert per_sequence == pytest.approx([scale / 2, -scale / 2])
    kl = [[0.0, 0.0, 0.2, 0.2, 5.0]] * 2  # 0.1 a token after kl_coef; the tool token's is ignored
    got = token_advantages(trajectories, per_sequence, algo, kl)
    returns = torch.tensor([scale / 2 - 0.2, scale / 2 - 0.1, -scale / 2 - 0.2, -scale / 2 - 0.1])
    whitened = (returns - returns.mean()) / returns.std(unbiased=False)
    assert [got[0][2], got[0][3], got[1][2], got[1][3]] == pytest.approx(whitened.tolist(), abs=1e-5)
    assert [row[t] for row in got for t in (0, 1, 4)] == [0] * 6
    if scale == 1.0:  # by hand: returns 0.3, 0.4, -0.7, -0.6, mean -0.15, std sqrt(0.2525)
        assert got[0][2] == pytest.approx(0.45 / math.sqrt(0.2525), abs=1e-5)
    else:  # returns -0.15, -0.05, -0.25, -0.15: the KL now outweighs the reward on the first tokens
        assert got[0][2] == pytest.approx(0.0, abs=1e-5) and got[1][3] == pytest.approx(0.0, abs=1e-5)


def test_gae_puts_the_reward_on_the_last_sampled_token_before_trailing_tool_output():
    """An episode stopped by rollout.max_turns ends with a tool message (mask 0): the outcome reward
    goes on the last sampled token, and GAE carries it back from there."""
    traj = make_trajectory(1.0, [(2, False), (2, True), (2, False), (1, True), (2, False)])
    algo = AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.5)
    assert token_rewards([traj], algo) == [[0, 0, 0, 0, 0, 0, 1.0, 0, 0]]
    values = [[0, 0, 0.1, 0.2, 0, 0, 0.4, 0, 0]]
    _, returns = gae_targets([traj], values, algo)
    # deltas: t6 = 1 - 0.4 = 0.6; t3 = 0.9*0.4 - 0.2 = 0.16; t2 = 0.9*0.2 - 0.1 = 0.08
    # advantages: A6 = 0.6, A3 = 0.16 + 0.45*0.6 = 0.43, A2 = 0.08 + 0.45*0.43 = 0.2735; returns = A + V
    assert returns[0] == pytest.approx([0, 0, 0.3735, 0.63, 0, 0, 1.0, 0, 0])


def test_gae_targets_by_hand():
    # prompt(2) agent(2) tool(2) agent(1): reward 1 on the last agent token
    traj = make_trajectory(1.0, [(2, False), (2, True), (2, False), (1, True)])
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=0.5)
    assert token_rewards([traj], algo) == [[0, 0, 0, 0, 0, 0, 1.0]]
    values = [[0, 0, 0.1, 0.2, 0, 0, 0.4]]
    _, returns = gae_targets([traj], values, algo)
    # deltas: t6 = 1 - 0.4 = 0.6; t3 = 0 + 0.4 - 0.2 = 0.2; t2 = 0.2 - 0.1 = 0.1
    # advantages: A6 = 0.6, A3 = 0.2 + 0.5*0.6 = 0.5, A2 = 0.1 + 0.5*0.5 = 0.35; returns = A + V
    assert returns[0] == pytest.approx([0, 0, 0.45, 0.7, 0, 0, 1.0])
    advantages, _ = gae_targets([traj], values, algo)
    raw = torch.tensor([0.35, 0.5, 0.6])
    whitened = (raw - raw.mean()) / raw.std(unbiased=False)
    assert [advantages[0][t] for t in (2, 3, 6)] == pytest.approx(whitened.tolist(), abs=1e-5)
    assert [advantages[0][t] for t in (0, 1, 4, 5)] == [0, 0, 0, 0]


def test_critic_starts_at_zero_learns_returns_and_round_trips(tmp_path):
    critic = CriticWorker(ValueModel.from_policy(make_tiny_llama()), 2, lr=1e-2, value_clip=None)
    assert critic.values([SEQUENCE], [MASK])[0] == [0.0] * len(SEQUENCE)  # zero head: values start at 0
    returns = [[1.0 * m for m in MASK]]
    losses = []
    for _ in range(20):
        losses.append(critic.update([SEQUENCE], [MASK], returns, critic.values([SEQUENCE], [MASK]))["value_loss"])
    assert losses[0] == pytest.approx(0.5)  # 0.5 * (0 - 1)^2 on every trainable token
    assert losses[-1] < 0.05
    values = critic.values([SEQUENCE], [MASK])[0]
    assert all(v == 0.0 for v, m in zip(values, MASK) if not m)
    critic.model.save(tmp_path / "critic")
    assert CriticWorker(ValueModel.load(tmp_path / "critic"), 2, lr=1e-2, value_clip=None).values(
        [SEQUENCE], [MASK])[0] == pytest.approx(values, abs=1e-6)


def test_value_clip_limits_the_critic_step():
    old = [[0.0] * len(SEQUENCE)]
    returns = [[5.0 * m for m in MASK]]
    clipped = CriticWorker(ValueModel.from_policy(make_tiny_llama()), 2, lr=1e-2, value_clip=0.01)
    free = CriticWorker(ValueModel.from_policy(make_tiny_llama()), 2, lr=1e-2, value_clip=None)
    for _ in range(5):  # the clipped loss keeps measuring against v_old ± 0.01: no gradient once outside
        clipped.update([SEQUENCE], [MASK], returns, old)
        free.update([SEQUENCE], [MASK], returns, old)
    clipped_mean = sum(clipped.values([SEQUENCE], [MASK])[0]) / sum(MASK)
    free_mean = sum(free.values([SEQUENCE], [MASK])[0]) / sum(MASK)
    assert 0 < clipped_mean < free_mean


REWARD_PLUGIN = '''
def length_parity(task, messages):
    """1.0 when the last reply as sampled (cut off or not) has an even number of characters: random
    replies give mixed rewards."""
    return float(len(messages[-1]["content"]) % 2 == 0)
'''

REQUIRED_METRICS = {
    "reward_mean", "reward_std", "accuracy", "tool_call_rate", "parse_error_rate", "mean_turns", "response_tokens",
    "loss", "clip_fraction", "approx_kl", "kl_ref", "entropy", "grad_norm", "skipped_step_fraction", "lr",
    "time_rollout_s", "time_logprobs_s",
    "time_update_s", "time_sync_s", "tokens_per_s", "weight_version", "rollout_logprob_diff", "engine_k3_mean",
    "engine_k3_max", "episodes_failed", "mask_coverage", "finish_stop", "finish_length", "tool_truncations",
    "engine_bf16", "trainer_bf16"}


def test_train_two_steps_through_the_cli(tmp_path, tiny_model_dir):
    (tmp_path / "e2e_rewards.py").write_text(REWARD_PLUGIN)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", f"model.path={tiny_model_dir}",
         "model.dtype=float32", f"output_dir={out}", "reward.function=e2e_rewards:length_parity",
         "rollout.group_size=4", "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=8", "trainer.steps=2",
         "trainer.tasks_per_step=2", "trainer.lr=1e-3", "trainer.dtype=float32", "algorithm.kl_coef=0.01",
         "trainer.save_every=1"],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # Step 1 sampled with the start weights (version 0), step 2 with those synced after step 1.
    assert [r["weight_version"] for r in rows] == [0, 1] and [r["synced_version"] for r in rows] == [1, 2]
    for row in rows:
        assert REQUIRED_METRICS <= set(row), REQUIRED_METRICS - set(row)
        assert 0 < row["reward_mean"] < 1 and row["grad_norm"] > 0
        # The engine sampled step 2 with the weights synced after step 1: logprobs agree to fp32 noise.
        assert row["rollout_logprob_diff"] < 1e-4 and 0 <= row["engine_k3_mean"] <= row["engine_k3_max"] < 1e-8
        assert row["engine_bf16"] == row["trainer_bf16"] == 0.0  # the recipe's float32 is what ran
        assert 0 < row["mask_coverage"] < 1 and row["episodes_failed"] == 0
        # Per second of the step: the phases add up to time_step_s (they were counted twice)
        assert row["tokens_per_s"] == pytest.approx(row["tokens_generated"] / row["time_step_s"])
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl_ref"] > 1e-6
    assert "train" in done.stdout and f"saved {out / 'final'}" in done.stdout
    # TensorBoard events of the same numbers, readable with tensorboard's own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")] == [
        (r["step"], round(r["reward_mean"], 6)) for r in rows]
    assert load_recipe(out / "config.yaml").trainer.steps == 2  # the effective config, loadable again
    steps = sorted(p.name for p in (out / "trajectories").iterdir())
    assert steps == ["step_1.jsonl", "step_2.jsonl"]
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    step_1 = AutoModelForCausalLM.from_pretrained(out / "step_1")
    weights = lambda m: m.model.embed_tokens.weight  # noqa: E731
    assert not torch.equal(weights(final), weights(start)) and not torch.equal(weights(final), weights(step_1))


@pytest.fixture
def tiny_recipe(tmp_path, tiny_model_dir, monkeypatch):
    """Writes a recipe on the tiny model, output in tmp_path/run, with the length-parity reward
    importable; the given YAML sections complete it."""
    (tmp_path / "e2e_rewards.py").write_text(REWARD_PLUGIN)
    (tmp_path / "raising_rewards.py").write_text(RAISING_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(sections: str):
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"model: {{path: {tiny_model_dir}}}\noutput_dir: {tmp_path / 'run'}\n"
                          f"reward: {{function: 'e2e_rewards:length_parity'}}\n" + textwrap.dedent(sections))
        return recipe

    return write


def test_ppo_with_critic_runs_and_saves_the_critic(tmp_path, tiny_recipe):
    from agentrl.train import train

    recipe = tiny_recipe("""
        data: {source: arithmetic, num_tasks: 4}
        rollout: {group_size: 2, max_turns: 1, max_new_tokens_per_turn: 6}
        algorithm: {advantage: gae, lam: 0.9}
        critic: {lr: 1.0e-3}
        trainer: {steps: 2, tasks_per_step: 2, lr: 1.0e-3, ppo_epochs: 2, mini_batches: 2}
    """)
    history = train(load_recipe(recipe))
    assert len(history) == 2 and all(h["value_loss"] > 0 and h["critic_grad_norm"] > 0 for h in history)
    critic = ValueModel.load(tmp_path / "run" / "critic")
    assert critic.head.weight.abs().sum() > 0  # the zero-initialised head was trained


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, tiny_recipe, capsys):
    from agentrl.train import train

    recipe = tiny_recipe("""
        rollout: {group_size: 4, max_turns: 1, max_new_tokens_per_turn: 6}
        trainer: {steps: 3, tasks_per_step: 2, lr: 1.0e-3, warmup_steps: 4, save_every: 1, keep_checkpoints: 1}
    """)
    exact = ["model.dtype=float32", "trainer.dtype=float32"]  # the logprob check below needs float32 on both sides
    whole = train(load_recipe(recipe, exact + [f"output_dir={tmp_path / 'whole'}"]))
    train(load_recipe(recipe, exact + [f"output_dir={tmp_path / 'split'}", "trainer.steps=1"]))
    resumed = train(load_recipe(recipe, exact + [f"output_dir={tmp_path / 'split'}", "trainer.resume=auto"]))
    assert f"resumed from {tmp_path / 'split' / 'checkpoints' / 'step_1'} after step 1" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and resumed[1:] == rows[1:]
    # Same tasks, same samples (the engine's sampling RNG was restored), same update (weights,
    # optimizer moments and the warm-up schedule were restored).
    for step in (2, 3):
        read = lambda run: [json.loads(line) for line in  # noqa: E731
                            (tmp_path / run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
        assert [(t["task_id"], t["token_ids"]) for t in read("split")] == [(t["task_id"], t["token_ids"]) for t in read("whole")]
        assert rows[step - 1]["loss"] == pytest.approx(whole[step - 1]["loss"], abs=1e-6)
        assert rows[step - 1]["lr"] == pytest.approx(whole[step - 1]["lr"])
    assert rows[1]["weight_version"] == 1 and rows[1]["synced_version"] == 2 and rows[1]["rollout_logprob_diff"] < 1e-4
    # keep_checkpoints 1: only the newest complete checkpoint is left.
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["step_3"]
    # Starting over in the same directory (resume never): the earlier run's step_3 would outrank
    # this run's step_1 (pruned at once) and its step 2-3 trajectories would pass for this run's.
    train(load_recipe(recipe, exact + [f"output_dir={tmp_path / 'split'}", "trainer.steps=1"]))
    assert "moved to" in capsys.readouterr().err
    listing = lambda path: sorted(p.name for p in path.iterdir())  # noqa: E731
    assert listing(tmp_path / "split" / "checkpoints") == ["step_1"]
    assert listing(tmp_path / "split" / "trajectories") == ["step_1.jsonl"]
    assert listing(tmp_path / "split" / "previous" / "checkpoints") == ["step_3"]
    assert listing(tmp_path / "split" / "previous" / "trajectories") == [f"step_{i}.jsonl" for i in (1, 2, 3)]
    assert len((tmp_path / "split" / "previous" / "metrics.jsonl").read_text().splitlines()) == 3
    # The earlier run's model directories go with it: its step_2/ and step_3/ would pass for this
    # run's steps, its final/ for this run's result until this one ends.
    assert listing(tmp_path / "split") == ["checkpoints", "config.yaml", "final", "metrics.jsonl", "previous",
                                           "step_1", "tensorboard", "trajectories"]
    assert listing(tmp_path / "split" / "previous") == ["checkpoints", "config.yaml", "final", "metrics.jsonl", "step_1",
                                                        "step_2", "step_3", "tensorboard", "trajectories"]
    # Each recipe beside its results: `agentrl view previous/` decodes with the earlier run's.
    recipe_of = lambda path: yaml.safe_load((tmp_path / "split" / path / "config.yaml").read_text())  # noqa: E731
    assert (recipe_of(".")["trainer"]["steps"], recipe_of("previous")["trainer"]["steps"]) == (1, 3)
    assert recipe_of("previous")["trainer"]["resume"] == "auto"
    weights = lambda path: (tmp_path / "split" / path / "model.safetensors").read_bytes()  # noqa: E731
    assert weights("final") == weights("step_1") and weights("previous/final") == weights("previous/step_3")


def test_a_resumed_run_takes_the_recipes_learning_rate_and_refuses_another_models_checkpoint(tmp_path, tiny_recipe,
                                                                                            capsys, monkeypatch):
    """The checkpoint holds the optimizer's moments and the schedule's position; its learning rate
    is the recipe's (it used to stay the checkpoint's, while config.yaml showed the new one). A
    resume whose model, LoRA layout, tasks or step count do not fit the checkpoint's recipe is a
    ConfigError naming them before any model loads (a changed LoRA alpha or target list, another
    model.path or task pool used to load without a word); a checkpoint without its recipe still
    gets a ConfigError from dcp's mismatch, not its traceback."""
    import agentrl.train
    from agentrl.errors import ConfigError
    from agentrl.train import train

    recipe = tiny_recipe("""
        rollout: {group_size: 2, max_turns: 1, max_new_tokens_per_turn: 4}
        trainer: {steps: 1, tasks_per_step: 2, lr: 1.0e-3, warmup_steps: 4, save_every: 1}
    """)
    run = [f"output_dir={tmp_path / 'run'}"]
    assert [h["lr"] for h in train(load_recipe(recipe, run))] == [pytest.approx(1e-3 / 4)]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"
    start_roles = agentrl.train.start_roles
    monkeypatch.setattr(agentrl.train, "start_roles", lambda *a: pytest.fail("a model loaded"))
    for changes, named in ((["model.lora.rank=4", "model.lora.alpha=32"], "model.lora.alpha null -> 32.0, "
                                                                          "model.lora.rank 0 -> 4"),
                           (["data.num_tasks=9"], "data.num_tasks 8 -> 9"),
                           (["trainer.tasks_per_step=1"], "trainer.tasks_per_step 2 -> 1")):
        with pytest.raises(ConfigError) as err:
            train(load_recipe(recipe, run + ["trainer.resume=auto", "trainer.steps=2", *changes]))
        assert str(err.value) == (f"trainer.resume 'auto': {checkpoint} was written with other settings for the model "
                                  f"or the tasks ({named}); resume with the ones it was written with, or start the "
                                  "new run in another output_dir")
    monkeypatch.setattr(agentrl.train, "start_roles", start_roles)
    (checkpoint / "recipe.json").rename(tmp_path / "recipe.json")  # as a checkpoint written before recipes were kept
    with pytest.raises(ConfigError) as err:
        train(load_recipe(recipe, run + ["trainer.resume=auto", "trainer.steps=2", "model.lora.rank=4"]))
    (tmp_path / "recipe.json").rename(checkpoint / "recipe.json")
    assert str(err.value) == (
        f"{tmp_path / 'run' / 'checkpoints' / 'step_1' / 'policy'}: the checkpoint does not fit this run's model "
        "(Missing key in checkpoint state_dict: model.base_model.model.model.layers.0.self_attn.q_proj.lora_A."
        "default.weight); resume with the model.path and model.lora settings of the run that wrote it")
    capsys.readouterr()
    resumed = train(load_recipe(recipe, run + ["trainer.resume=auto", "trainer.steps=2", "trainer.lr=5e-2"]))
    assert [h["lr"] for h in resumed] == [pytest.approx(1e-3 / 4), pytest.approx(5e-2 * 2 / 4)]
    assert f"agentrl: warning: resuming {checkpoint} with settings changed since it was written: trainer.lr 0.001 -> " \
           "0.05\n" in capsys.readouterr().err
    # A relaunch with fewer steps than the checkpoint has done used to train nothing and save final/.
    monkeypatch.setattr(agentrl.train, "start_roles", lambda *a: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError) as err:
        train(load_recipe(recipe, run + ["trainer.resume=auto", "trainer.steps=1", "trainer.lr=5e-2"]))
    assert str(err.value) == (f"trainer.steps 1: {checkpoint.with_name('step_2')} is at step 2 already; raise "
                              "trainer.steps to continue it")
    monkeypatch.setattr(agentrl.train, "start_roles", start_roles)
    # A damaged checkpoint is no mismatch of settings: named, with the way on (torch's own error
    # named no file, and every relaunch met it again).
    step_2 = tmp_path / "run" / "checkpoints" / "step_2"
    state = (step_2 / "trainer_state.pt").read_bytes()
    shard = next((step_2 / "policy").glob("*.distcp"))
    for damaged, reason in ((step_2 / "trainer_state.pt", r"\w+Error: .+"), (step_2 / "policy", r"\w+: .+")):
        (step_2 / "trainer_state.pt").write_bytes(state[: len(state) // 2] if damaged.name == "trainer_state.pt" else state)
        if damaged.name == "policy":
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        with pytest.raises(ConfigError) as err:
            train(load_recipe(recipe, run + ["trainer.resume=auto", "trainer.steps=3"]))
        assert re.fullmatch(rf"{re.escape(str(damaged))}: cannot read this checkpoint \({reason}\); if it is damaged, "
                            rf"delete {re.escape(str(step_2))} to resume from the checkpoint before it", str(err.value))


def test_a_resumed_run_drops_the_trajectories_and_models_the_interrupted_run_wrote_after_its_checkpoint(tmp_path):
    """A run killed at step 4 with its last checkpoint at step 2 left step_3 and step_4 files; the
    resumed run rewrites them as it gets there, but one relaunched with trainer.steps=3 showed the
    other run's step_4 as its own. Evaluations of the models it replaces go to previous/, as a
    fresh run's would: the old model's eval_final.json read as the new final/'s."""
    from agentrl.train import drop_steps_after

    (tmp_path / "trajectories").mkdir()
    for step in range(1, 5):
        (tmp_path / "trajectories" / f"step_{step}.jsonl").write_text("{}\n")
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "config.json").write_text("{}")
    (tmp_path / "trajectories" / "step_notes.jsonl").write_text("{}\n")  # not a step's: kept
    # `agentrl eval` of step_2, step_4 and final/ (which the resumed run saves anew) and of the base model
    evaluations = ["eval_step_2.json", "eval_step_4.json", "eval_step_4.jsonl", "eval_final.json",
                   "eval_final.jsonl", "eval_smollm2-135m-instruct.json"]
    for name in evaluations:
        (tmp_path / name).write_text("{}")
    drop_steps_after(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == ["step_1.jsonl", "step_2.jsonl",
                                                                           "step_notes.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_smollm2-135m-instruct.json", "eval_step_2.json",
                                                          "previous", "step_1", "step_2", "trajectories"]
    assert sorted(p.name for p in (tmp_path / "previous").iterdir()) == ["eval_final.json", "eval_final.jsonl",
                                                                         "eval_step_4.json", "eval_step_4.jsonl"]


def test_a_checkpoint_is_on_disk_before_it_takes_its_name_and_before_older_ones_are_pruned(tmp_path, monkeypatch):
    """Renaming alone orders nothing on disk: after a power cut, a checkpoint under its final name
    could hold empty files while the older ones were already pruned."""
    import os

    from agentrl.trainer.checkpoint import commit_checkpoint, complete_checkpoints, staging_checkpoint

    events: list[str] = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, __import__("shutil").rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("sync " + os.readlink(f"/proc/self/fd/{fd}"))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(f"rename {a} {b}") or real_replace(a, b))
    monkeypatch.setattr("agentrl.trainer.checkpoint.shutil.rmtree",
                        lambda p, **kw: events.append(f"remove {p}") or real_rmtree(p, **kw))
    for step in (1, 2):
        staging = staging_checkpoint(tmp_path, step)
        (staging / "policy").mkdir()
        (staging / "policy" / "shard.distcp").write_bytes(b"weights")
        (staging / "trainer_state.pt").write_bytes(b"state")
        events.clear()
        commit_checkpoint(staging, keep=1)
    root = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_2"]
    staged, final = root / "step_2.tmp", root / "step_2"
    rename = events.index(f"rename {staged} {final}")
    assert events[0] == f"remove {final}" and sorted(events[1:rename]) == [  # every file and directory, then the rename
        f"sync {staged}", f"sync {staged / 'policy'}", f"sync {staged / 'policy' / 'shard.distcp'}",
        f"sync {staged / 'trainer_state.pt'}"]
    assert events[rename + 1:] == [f"sync {root}", f"remove {root / 'step_1'}"]  # the rename is on disk before pruning


def test_activation_checkpointing_gives_the_same_update():
    from agentrl.models import enable_activation_checkpointing

    plain, recomputed = make_tiny_llama(), make_tiny_llama()
    enable_activation_checkpointing(recomputed)
    for model in (plain, recomputed):
        PolicyWorker(model, 2, lr=1e-3, temperature=1.0).update([SEQUENCE], [MASK], [[m * 1.0 for m in MASK]])
    layer = recomputed.model.layers[0]
    assert layer.gradient_checkpointing and not plain.model.layers[0].gradient_checkpointing
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(plain.model.embed_tokens.weight, make_tiny_llama().model.embed_tokens.weight)


def test_failed_episodes_are_left_out_of_the_update_and_the_baseline():
    from agentrl.train import learn

    def episode(reward: float, completion: list[int], finish: str = "stop") -> Trajectory:
        traj = Trajectory(task_id="t", group_id="g", finish=finish)
        traj.append(PROMPT, trainable=False)
        traj.append(completion, trainable=True, logprobs=[-1.0] * len(completion))
        traj.reward = None if finish == "error" else reward
        return traj

    good = [episode(1.0, COMPLETION), episode(0.0, COMPLETION[:5] + [2])]
    failed = episode(0.0, COMPLETION[2:], finish="error")  # sampled tokens with mask 1, reward None
    algo = AlgorithmConfig(advantage="grpo")
    assert outcome_advantages(good + [failed], 3, algo)[2] is None
    with_failure, without = make_tiny_llama(), make_tiny_llama()
    metrics = {}
    for model, trajectories, group in ((with_failure, good + [failed], 3), (without, good, 2)):
        worker = PolicyWorker(model, 2, lr=1e-3, temperature=1.0)
        metrics[group] = learn(trajectories, group, algo, worker, None, None, {})
    for (name, a), b in zip(with_failure.named_parameters(), without.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert metrics[3]["loss"] == metrics[2]["loss"] and metrics[3]["grad_norm"] > 0


def test_the_kl_in_the_reward_is_reported_as_kl_ref_like_the_kl_loss():
    """Both place the same KL (k3, policy before the update against the reference) in the step; the
    metric is its mean over the trained tokens either way, and so is the entropy, whatever the
    loss's aggregation (a sum per sequence grows with length: it reported 75.5 nats of entropy)."""
    from agentrl.train import learn
    from agentrl.trainer.policy import ReferenceWorker

    trajectories = []
    for reward, completion in ((1.0, COMPLETION), (0.0, COMPLETION[:5] + [2])):
        traj = Trajectory(task_id="t", group_id="g", finish="stop")
        traj.append(PROMPT, trainable=False)
        traj.append(completion, trainable=True, logprobs=[-1.0] * len(completion))
        traj.reward = reward
        trajectories.append(traj)
    kl_ref, entropy = {}, {}
    for in_reward, aggregation in ((False, "token-mean"), (True, "token-mean"), (False, "seq-mean-token-sum"),
                                   (True, "seq-mean-token-sum"), (False, "seq-mean-token-mean")):
        algo = AlgorithmConfig(advantage="grpo", kl_coef=0.1, kl_in_reward=in_reward, aggregation=aggregation)
        policy = PolicyWorker(make_tiny_llama(), 2, lr=1e-3, temperature=1.0, kl_coef=0.0 if in_reward else 0.1,
                              aggregation=aggregation)
        reference = ReferenceWorker(make_tiny_llama(seed=1), 2, 1.0, 4096)
        update = learn(trajectories, 2, algo, policy, reference, None, {})
        kl_ref[in_reward, aggregation], entropy[in_reward, aggregation] = update["kl_ref"], update["entropy"]
    assert kl_ref[True, "token-mean"] == pytest.approx(0.01939, abs=1e-5)  # two random models: not 0.0
    assert kl_ref == pytest.approx(dict.fromkeys(kl_ref, kl_ref[True, "token-mean"]), abs=1e-6)
    assert entropy == pytest.approx(dict.fromkeys(entropy, entropy[False, "token-mean"]), abs=1e-5)
    assert entropy[False, "token-mean"] < math.log(49152)  # nats per token


def test_the_entropy_bonus_raises_the_entropy_and_the_kl_term_lowers_the_kl():
    """With every advantage 0 only the two terms move the weights: a flipped sign in either still
    passed every other test."""
    from agentrl.trainer.policy import ReferenceWorker

    reference = ReferenceWorker(make_tiny_llama(seed=1), 2, 1.0, 4096)
    sequences, masks, zero = [SEQUENCE], [MASK], [[0.0] * len(SEQUENCE)]
    ref = reference.logprobs(sequences, masks)
    for coefficient, metric, direction in (("entropy_coef", "entropy", 1), ("kl_coef", "kl_ref", -1)):
        worker = PolicyWorker(make_tiny_llama(), 2, lr=1e-3, temperature=1.0, **{coefficient: 0.5})
        # each measured before its step: the third update sees the first two steps' effect
        seen = [worker.update(sequences, masks, zero, ref_logprobs=ref)[metric] for _ in range(3)]
        assert (seen[2] - seen[0]) * direction > 2e-4 * abs(seen[0]), (metric, seen)


def test_grad_norm_is_the_mean_over_the_steps_taken_and_kl_ref_needs_a_reference(monkeypatch):
    """A skipped step (its norm not finite) added a 0 to the mean: one of two skipped halved the
    reported norm. Without a reference there is no KL to it, and a 0 read as "no drift"."""
    from agentrl.trainer import critic as critic_module
    from agentrl.trainer import policy as policy_module

    norms = []

    def first_skipped(model, optimizer, *args):
        if not norms:
            optimizer.zero_grad(set_to_none=True)
            norms.append(float("inf"))
            return float("inf"), False
        norms.append(real(model, optimizer, *args)[0])
        return norms[-1], True

    real = policy_module.clipped_step
    monkeypatch.setattr(policy_module, "clipped_step", first_skipped)
    monkeypatch.setattr(critic_module, "clipped_step", first_skipped)
    sequences, masks = [SEQUENCE, SEQUENCE[:-2]], [MASK, MASK[:-2]]
    worker = PolicyWorker(make_tiny_llama(), 2, lr=1e-3, temperature=1.0, mini_batches=2)
    old = worker.logprobs(sequences, masks)
    metrics = worker.update(sequences, masks, [[m * 1.0 for m in mask] for mask in masks], old)
    assert len(norms) == 2 and metrics["skipped_step_fraction"] == 0.5
    assert metrics["grad_norm"] == pytest.approx(norms[1]) and norms[1] > 0
    assert "kl_ref" not in metrics
    norms.clear()
    critic = CriticWorker(ValueModel.from_policy(make_tiny_llama()), 2, lr=1e-2, value_clip=None, mini_batches=2)
    values = critic.values(sequences, masks)
    metrics = critic.update(sequences, masks, [[1.0 * m for m in mask] for mask in masks], values)
    assert metrics["critic_skipped_step_fraction"] == 0.5
    assert metrics["critic_grad_norm"] == pytest.approx(norms[1]) and norms[1] > 0


RAISING_REWARDS = '''
def always_broken(task, messages):
    raise ConnectionError("judge service unreachable")


def sometimes_broken(task, messages):
    text = messages[-1]["content"]  # the last turn as sampled: a cut-off one has no final answer
    if len(text) % 3 == 0:
        raise ConnectionError("judge service unreachable")
    return float(len(text) % 2 == 0)
'''


def test_a_step_with_too_many_failed_episodes_stops_the_run_with_the_cause(tmp_path, tiny_model_dir):
    (tmp_path / "raising_rewards.py").write_text(RAISING_REWARDS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", f"model.path={tiny_model_dir}",
         "model.dtype=float32", f"output_dir={tmp_path / 'run'}", "reward.function=raising_rewards:always_broken",
         "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_new_tokens_per_turn=4", "trainer.steps=2",
         "trainer.tasks_per_step=2", "trainer.dtype=float32"],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "agentrl: error: step 1: 4 of 4 episodes failed (more than trainer.max_failed_fraction 0.25): "
        "ConnectionError: judge service unreachable (4x)")
    # The failed step's trajectories are on disk for inspection; no update or checkpoint happened.
    rows = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert [r["finish"] for r in rows] == ["error"] * 4 and not (tmp_path / "run" / "final").exists()


def test_training_goes_on_past_a_few_failed_episodes(tiny_recipe):
    from agentrl.train import train

    recipe = tiny_recipe("""
        rollout: {group_size: 4, max_turns: 1, max_new_tokens_per_turn: 6}
        trainer: {steps: 2, tasks_per_step: 2, lr: 1.0e-3, max_failed_fraction: 1.0}
    """)
    history = train(load_recipe(recipe, ["reward.function=raising_rewards:sometimes_broken"]))
    failed = [h["episodes_failed"] for h in history]
    assert sum(failed) > 0 and all(f < 8 for f in failed), failed
    # A step whose groups each kept at most one episode, or only ones that agree, has zero advantages
    # and a zero gradient; the run goes on and learns wherever surviving episodes disagree.
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert any(h["grad_norm"] > 0 for h in history)


@pytest.mark.parametrize("failed, fraction, stops", [(29, 0.29, False), (30, 0.29, True), (57, 0.57, False),
                                                     (58, 0.58, False), (1, 0.0, True)])
def test_the_failed_episode_budget_stops_only_past_its_fraction(failed, fraction, stops):
    # 0.29 · 100 is 28.999999999999996 in floating point: 29 of 100 used to count as more than 29 %.
    from agentrl.errors import RunFailed
    from agentrl.rollout.collect import check_failures
    from agentrl.types import Trajectory

    trajectories = [Trajectory(task_id=str(i), group_id="g") for i in range(100)]
    for tr in trajectories[:failed]:
        tr.finish, tr.error = "error", "ValueError: judge down"
    if stops:
        with pytest.raises(RunFailed, match=rf"^step 1: {failed} of 100 episodes failed"):
            check_failures("step 1", trajectories, fraction)
    else:
        check_failures("step 1", trajectories, fraction)


def test_a_step_where_every_episode_failed_still_advances_the_warm_up(tiny_recipe):
    # The schedule counts RL steps: step k (from 0) trains at lr · (k + 1) / warmup_steps, whether
    # or not an earlier step had anything to train.
    from agentrl.train import train

    recipe = tiny_recipe("""
        rollout: {group_size: 2, max_turns: 1, max_new_tokens_per_turn: 4}
        trainer: {steps: 2, tasks_per_step: 1, lr: 1.0e-3, warmup_steps: 4, max_failed_fraction: 1.0}
    """)
    history = train(load_recipe(recipe, ["reward.function=raising_rewards:always_broken"]))
    assert [h["episodes_failed"] for h in history] == [2, 2]
    assert [h["lr"] for h in history] == pytest.approx([1e-3 / 4, 2e-3 / 4])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_give_the_gradients_of_one_batch(aggregation):
    """Packing a mini-batch into several micro-batches accumulates exactly the one-batch gradient
    (policy loss, KL to a reference, entropy bonus), whatever the aggregation."""
    from agentrl.trainer.packing import packed_rows, plan_micro_batches

    generator = torch.Generator().manual_seed(0)
    sequences, masks, advantages, refs = [], [], [], []
    for length, tool_at in ((12, 6), (20, 9), (27, 14), (9, None), (31, 20)):
        seq = torch.randint(3, 49000, (length,), generator=generator).tolist()
        mask = [0] * 4 + [1] * (length - 4)
        if tool_at is not None:  # a masked tool segment between two sampled ones
            mask[tool_at:tool_at + 3] = [0, 0, 0]
        sequences.append(seq)
        masks.append(mask)
        advantages.append([float(torch.randn(1, generator=generator)) * m for m in mask])
    # A reference near the policy (its own logprobs, shifted by up to ±0.2), as in training.
    for seq, mask, own in zip(sequences, masks, batched_logprobs(make_tiny_llama(), sequences, masks, 2, 0.9, 4096)):
        refs.append([(lp + 0.4 * float(torch.rand(1, generator=generator)) - 0.2) * m for lp, m in zip(own, mask)])
    assert len(plan_micro_batches(packed_rows(list(range(5)), sequences, masks, None), 40)) == 4

    grads = []
    for budget in (40, 100_000):
        model = make_tiny_llama()
        worker = PolicyWorker(model, 2, lr=1e-3, temperature=0.9, grad_clip=1e9, micro_batch_tokens=budget,
                              aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
        # the gradients as the step gets them (it frees them after)
        worker.optimizer.register_step_pre_hook(lambda *_, model=model: grads.append(
            {name: p.grad.clone() for name, p in model.named_parameters()}))
        worker.update(sequences, masks, advantages, ref_logprobs=refs)
    assert len(grads) == 2  # one step each
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[1].values())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_groups_rows_packed_into_one_row_give_the_full_rows_logprobs_and_gradients(implementation):
    """Rows that share a 20-token prompt, packed: the prompt once (19 tokens: its last token's
    hidden state predicts each row's first sampled one, so every row keeps it), then each row's own
    tokens; each row sees the prompt and itself only, at its own positions. The logprobs and
    gradients are those of running every row in full, padding and a masked tool span included.
    Eager attention adds a 4-D mask to its scores: given the boolean mask it masked nothing."""
    from agentrl.trainer.logprobs import pad_sequences, padded_micro_batches
    from agentrl.trainer.packing import PackedRow, pack_cost, packed_rows

    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 49000, (20,), generator=generator).tolist()
    sequences = [prompt + torch.randint(3, 49000, (n,), generator=generator).tolist() for n in (5, 11, 8)]
    masks = [[0] * 20 + [1] * (len(s) - 20) for s in sequences]
    masks[1][24:27] = [0, 0, 0]  # a tool result between two sampled spans
    assert packed_rows([0, 1, 2], sequences, masks, pack_cost(make_tiny_llama())) == [PackedRow([0, 1, 2], 19, 46)]
    (idx, packed), = padded_micro_batches([[PackedRow([0, 1, 2], 19, 46)]], sequences, masks, 2, "cpu")
    layout = packed.packed
    assert idx == [0, 1, 2]
    assert layout.ids_GL[0].tolist() == prompt[:19] + sequences[0][19:] + sequences[1][19:] + sequences[2][19:]
    assert layout.positions_GL[0].tolist() == [*range(19), *range(19, 25), *range(19, 31), *range(19, 28)]
    # Row 1's last token (packed position 36) sees the prompt and its own 12 tokens, nothing of row 0.
    assert layout.attention_G1LL[0, 0, 36].nonzero().flatten().tolist() == [*range(19), *range(25, 37)]
    assert layout.where_BT[2, :28].tolist() == [*range(19), *range(37, 46)]
    assert next(padded_micro_batches([[PackedRow([0], 0, 25)]], sequences, masks, 2, "cpu"))[1].packed is None

    results = []
    for batch in (pad_sequences(sequences, masks, pad_id=2), packed):
        model = make_tiny_llama()
        model.set_attn_implementation(implementation)
        logprobs_BT, entropy_BT = token_logprobs(model, batch, temperature=0.8, entropy_grad=True)
        ((logprobs_BT * batch.mask_BT).sum() + entropy_BT.sum() * 0.1).backward()
        results.append((logprobs_BT.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    assert (results[1][0] * (1 - packed.mask_BT) == 0).all()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_micro_batches_pack_a_prompts_rows_and_split_them_when_attention_would_cost_more():
    from agentrl.trainer.packing import PackCost, PackedRow, packed_rows, plan_micro_batches

    a, b = [5] * 30, [6] * 30  # two prompts of 30 tokens, each shared by three rows
    sequences = [a + [7] * 10, b + [8] * 20, a + [9] * 12, [4] * 25, b + [8] * 5, a + [7] * 10, b + [9] * 7]
    masks = [[0] * 30 + [1] * (len(s) - 30) if s[0] != 4 else [0] * 5 + [1] * 20 for s in sequences]
    # Prompt a's rows: its 29 shared tokens once, then 11 + 13 + 11 of their own: 64 tokens, not 3 × 42.
    packed = packed_rows(list(range(7)), sequences, masks, PackCost(token=1.0, pair=0.0))
    assert packed == [PackedRow([0, 2, 5], 29, 64), PackedRow([1, 4, 6], 29, 64), PackedRow([3], 0, 25)]
    assert plan_micro_batches(packed, 130) == [[packed[2], packed[0]], [packed[1]]]  # padded: rows × longest
    assert plan_micro_batches(packed, 192) == [[packed[2], packed[0], packed[1]]]
    # Four rows of one 20-token prompt and 60 tokens each (61 of their own after the 19 shared), at
    # 0.001 per query-key pair: the second row adds 61 + 0.001 × (141² - 80²) = 74.5 to the first
    # against 80 + 0.001 × 80² = 86.4 for a row of its own, the third 81.9, the fourth 89.4: it
    # starts a new packed row. Without the attention term all four share one.
    long = [[3] * 20 + [10 + k] * 60 for k in range(4)]
    long_masks = [[0] * 20 + [1] * 60] * 4
    assert packed_rows([0, 1, 2, 3], long, long_masks, PackCost(1.0, 0.001)) == [
        PackedRow([0, 1, 2], 19, 202), PackedRow([3], 19, 80)]
    assert packed_rows([0, 1, 2, 3], long, long_masks, PackCost(1.0, 0.0)) == [PackedRow([0, 1, 2, 3], 19, 263)]
    # A packed row stays within a micro-batch's budget (unless one row alone exceeds it).
    assert packed_rows([0, 1, 2, 3], long, long_masks, PackCost(1.0, 0.0), token_budget=202) == [
        PackedRow([0, 1, 2], 19, 202), PackedRow([3], 19, 80)]
    assert packed_rows([0, 1], long, long_masks, PackCost(1.0, 0.0), token_budget=50) == [
        PackedRow([0], 19, 80), PackedRow([1], 19, 80)]
    assert packed_rows(list(range(7)), sequences, masks, None) == [PackedRow([i], 0, len(s)) for i, s in enumerate(sequences)]


def test_pack_cost_counts_the_model_and_refuses_what_a_4d_mask_cannot_describe():
    """Per token: the decoder's parameters without the embedding (2 layers × 36,992 + the final
    norm's 64); per query-key pair: 2 × layers × heads × head size. Sliding-window layers (given
    the full mask they would see too much) and attention functions other than SDPA and eager (the
    engine's own, here) are not packed."""
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from agentrl.rollout.packed_attention import install
    from agentrl.trainer.packing import PackCost, pack_cost

    assert pack_cost(make_tiny_llama()) == PackCost(token=2 * 36_992 + 64, pair=2 * 2 * 4 * 16)
    eager = LlamaForCausalLM._from_config(make_tiny_llama().config, attn_implementation="eager")
    assert pack_cost(eager) == pack_cost(make_tiny_llama())
    sliding = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    assert pack_cost(MistralForCausalLM(sliding)) is None
    # GPT-Neo's local layers (packed: logprobs 0.015 off past the window) and ALiBi, whose bias
    # counts key indices (MPT: 0.1 off; Bloom: its packed pass raised).
    from transformers import (BloomConfig, BloomForCausalLM, GPTNeoConfig, GPTNeoForCausalLM, MptConfig,
                              MptForCausalLM)

    local = GPTNeoConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, window_size=8,
                         attention_types=[[["global", "local"], 1]])
    assert pack_cost(GPTNeoForCausalLM(local)) is None
    assert pack_cost(GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                                                    attention_types=[[["global"], 2]]))) is not None
    assert pack_cost(MptForCausalLM(MptConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4))) is None
    assert pack_cost(BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=64, n_layer=2, n_head=4))) is None
    engine_model = make_tiny_llama()
    assert install(engine_model) and pack_cost(engine_model) is None


def test_lora_trains_adapters_only_and_the_engine_gets_merged_weights(tmp_path, tokenizer):
    from agentrl.config import LoraSettings
    from agentrl.models import load_model
    from agentrl.trainer.lora import add_lora

    base_dir = tmp_path / "base"
    make_tiny_llama().save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model = add_lora(load_model(str(base_dir)), LoraSettings(rank=4, alpha=16), str(base_dir))
    engine = HFEngine(load_model(str(base_dir)), pad_token_id=2)
    policy = PolicyWorker(model, 2, lr=1e-2, temperature=1.0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(len(g["params"]) for g in policy.optimizer.param_groups) == len(trainable)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    before = engine.score(SEQUENCE, len(PROMPT))
    policy.update([SEQUENCE], [MASK], [[m * 1.0 for m in MASK]])
    trained = torch.tensor(policy.logprobs([SEQUENCE], [MASK])[0][len(PROMPT):])
    assert (trained - torch.tensor(before)).abs().max() > 1e-2  # the adapters moved the policy ...
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[name]), name  # ... and no base weight changed
    engine.update_weights(policy.named_weights(), version=1)  # W + scaling·B·A under the base names
    torch.testing.assert_close(torch.tensor(engine.score(SEQUENCE, len(PROMPT))), trained, atol=1e-5, rtol=0)

    # The checkpoint holds the adapters alone and loads back, merged, as the trained model.
    from agentrl.trainer.checkpoint import save_model

    save_model(model, tokenizer, tmp_path / "final")
    assert {p.name for p in (tmp_path / "final").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not (tmp_path / "final" / "model.safetensors").exists()
    reloaded = load_model(str(tmp_path / "final"))
    torch.testing.assert_close(torch.tensor(sequence_logprob_of(reloaded)), trained.sum(), atol=1e-4, rtol=0)


def test_saving_adapters_never_looks_the_base_model_up_on_the_hub(tmp_path, tokenizer, monkeypatch):
    """peft's default save checked the hub for a base model named other than by a directory (a
    builtin's name), to see whether the vocabulary was resized: a lookup off this machine."""
    import peft.utils.save_and_load as peft_save

    from agentrl.config import LoraSettings
    from agentrl.trainer.checkpoint import save_model
    from agentrl.trainer.lora import add_lora

    def no_lookup(repo_id, filename, **kwargs):
        raise AssertionError(f"looked {repo_id}/{filename} up on the hub")

    monkeypatch.setattr(peft_save, "check_file_exists_on_hf_hub", no_lookup)
    model = add_lora(make_tiny_llama(), LoraSettings(rank=4), str(tmp_path))
    model.peft_config["default"].base_model_name_or_path = "smollm2-135m-instruct"  # a builtin's name
    save_model(model, tokenizer, tmp_path / "final")
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()


def sequence_logprob_of(model) -> float:
    return sum(batched_logprobs(model, [SEQUENCE], [MASK], 2, 1.0, 4096)[0])


def test_train_with_lora_through_the_cli(tmp_path, tiny_recipe):
    from agentrl.train import train

    recipe = tiny_recipe("""
        rollout: {group_size: 4, max_turns: 1, max_new_tokens_per_turn: 6}
        trainer: {steps: 2, tasks_per_step: 2, lr: 1.0e-2, save_every: 2}
    """)
    history = train(load_recipe(recipe, ["model.lora.rank=16", "model.dtype=float32", "trainer.dtype=float32"]))
    # Step 2 sampled from merged adapters synced after step 1: the engine agrees with the trainer.
    assert history[1]["rollout_logprob_diff"] < 1e-4 and history[1]["grad_norm"] > 0
    run = tmp_path / "run"
    assert (run / "final" / "adapter_config.json").is_file() and not (run / "final" / "model.safetensors").exists()
    shards = sum(f.stat().st_size for f in (run / "checkpoints" / "step_2" / "policy").iterdir())
    base_bytes = 4 * sum(p.numel() for p in make_tiny_llama().parameters())
    assert shards < base_bytes / 10  # adapters and their Adam moments, not the 3.2 M base weights


def test_train_checks_the_agent_before_it_writes_anything(tmp_path, tiny_recipe):
    from agentrl.errors import ConfigError
    from agentrl.train import train

    recipe = tiny_recipe("rollout: {agent: 'nope_module:agent'}\n")
    with pytest.raises(ConfigError) as err:
        train(load_recipe(recipe))
    assert str(err.value) == ("rollout.agent: cannot import module 'nope_module' "
                              "(ModuleNotFoundError: No module named 'nope_module')")
    assert not (tmp_path / "run").exists()


def refuse_model_loads(monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for module in ("agentrl.trainer.roles", "agentrl.rollout.run"):
        monkeypatch.setattr(f"{module}.load_model", load_model)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.wandb_project=myproj"],
     "trainer.wandb_project: wandb project 'myproj' is configured but the wandb package is not installed "
     "(pip install wandb, or leave the wandb project unset)"),
    (["algorithm.advantage=gae", "critic.path={tmp}/nosuch"], "critic.path: {tmp}/nosuch does not exist"),
    (["algorithm.advantage=gae", "critic.path={tmp}"],
     "critic.path: {tmp} is a directory but neither a saved critic (decoder/ and value_head.pt) nor a model "
     "directory (config.json or adapter_config.json)"),
])
def test_train_checks_wandb_and_the_critic_path_before_any_model_loads(tmp_path, tiny_recipe, monkeypatch,
                                                                        overrides, message):
    from agentrl.errors import ConfigError
    from agentrl.train import train

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail even where it is installed
    refuse_model_loads(monkeypatch)
    recipe = tiny_recipe("trainer: {steps: 1, tasks_per_step: 1}\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run's
    with pytest.raises(ConfigError) as err:
        train(load_recipe(recipe, [o.format(tmp=tmp_path) for o in overrides]))
    assert str(err.value) == message.format(tmp=tmp_path)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]  # not set aside


def test_a_critic_path_that_names_nothing_stops_the_cli_before_any_model_loads(tmp_path, tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", f"model.path={tiny_model_dir}",
         f"output_dir={tmp_path / 'run'}", "algorithm.advantage=gae", "critic.path=nosuch"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "agentrl: error: critic.path: 'nosuch' is not a local directory, not a builtin (smollm2-135m-instruct), "
        "and loading it as a hub id failed (")
    assert "Loading weights" not in done.stderr and not (tmp_path / "run").exists()


def test_a_run_refuses_at_start_what_would_fail_or_destroy_something_at_its_end(tmp_path):
    """A final/ holding a user's file would be refused only when the trained model is saved, and a
    model trained from inside previous/ would be deleted when the run sets an earlier one aside."""
    from agentrl.errors import ConfigError
    from agentrl.recipe import load_recipe
    from agentrl.train import check_run_dir

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "notes.txt").write_text("mine")
    config = load_recipe("recipes/quickstart.yaml", [f"output_dir={run}"])
    with pytest.raises(ConfigError, match=r"final holds files that are not a saved model \(notes.txt\)"):
        check_run_dir(config, run)
    (run / "final" / "notes.txt").unlink()
    (run / "previous" / "final").mkdir(parents=True)
    (run / "previous" / "final" / "config.json").write_text("{}")
    config = load_recipe("recipes/quickstart.yaml", [f"output_dir={run}", f"model.path={run / 'previous' / 'final'}"])
    with pytest.raises(ConfigError, match=r"model.path: '.*previous/final' is inside .*previous, which this run moves"):
        check_run_dir(config, run)
    check_run_dir(load_recipe("recipes/quickstart.yaml", [f"output_dir={run}"]), run)  # an empty final/ is fine
    # Training on from the last run's result in the same directory: a run from step 0 moves final/
    # into previous/ (a resume would not find it), and LoRA adapters saved over it would name themselves.
    (run / "final" / "config.json").write_text("{}")
    config = load_recipe("recipes/quickstart.yaml", [f"output_dir={run}", f"model.path={run / 'final'}"])
    with pytest.raises(ConfigError) as err:
        check_run_dir(config, run)
    assert str(err.value) == (f"model.path: '{run / 'final'}' is inside {run / 'final'}, which this run moves or "
                              "replaces; copy it elsewhere, or use another output_dir")
    (run / "step_2" / "additional_chat_templates").mkdir(parents=True)  # a tokenizer's extra templates
    (run / "step_2" / "config.json").write_text("{}")
    (run / "step_2" / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    check_run_dir(load_recipe("recipes/quickstart.yaml", [f"output_dir={run}"]), run)


def test_resume_compares_the_models_as_they_are_built_and_names_an_unreadable_recipe(tmp_path, capsys):
    """LoRA alpha null (2 × rank) and the same alpha written out build the same adapters, but a
    resume was refused for it; a critic of another critic.path was refused only once every model
    had loaded, told to fix model.path and model.lora; and a damaged recipe.json was a bare
    JSONDecodeError."""
    from agentrl.errors import ConfigError
    from agentrl.train import check_resume

    checkpoint = tmp_path / "checkpoints" / "step_1"
    checkpoint.mkdir(parents=True)
    written = ["model.lora.rank=8", "algorithm.advantage=gae"]
    (checkpoint / "recipe.json").write_text(json.dumps(load_recipe("recipes/quickstart.yaml", written)
                                                       .model_dump(mode="json")))
    check_resume(load_recipe("recipes/quickstart.yaml", written + ["model.lora.alpha=16"]), checkpoint)
    assert capsys.readouterr().err == ""  # not even a warning: nothing changed
    for changes, named in ((["model.lora.alpha=8"], "model.lora.alpha null -> 8.0"),
                           (["critic.path=/models/other"], 'critic.path null -> "/models/other"')):
        with pytest.raises(ConfigError, match=re.escape(f"({named}); resume with the ones it was written with")):
            check_resume(load_recipe("recipes/quickstart.yaml", written + changes), checkpoint)
    # the adapters' dropout shapes no weight: a warning, as a new learning rate gets
    check_resume(load_recipe("recipes/quickstart.yaml", written + ["model.lora.dropout=0.1"]), checkpoint)
    assert "settings changed since it was written: model.lora.dropout 0.0 -> 0.1" in capsys.readouterr().err
    # without a critic, critic.path shapes nothing
    (checkpoint / "recipe.json").write_text(json.dumps(load_recipe("recipes/quickstart.yaml").model_dump(mode="json")))
    check_resume(load_recipe("recipes/quickstart.yaml", ["critic.path=/models/other"]), checkpoint)
    assert capsys.readouterr().err == ""
    (checkpoint / "recipe.json").write_text('{"model": ')
    with pytest.raises(ConfigError) as err:
        check_resume(load_recipe("recipes/quickstart.yaml"), checkpoint)
    assert str(err.value) == (f"{checkpoint / 'recipe.json'}: cannot read this checkpoint (JSONDecodeError: Expecting "
                              f"value: line 1 column 11 (char 10)); if it is damaged, delete {checkpoint} to resume "
                              "from the checkpoint before it")


def test_a_run_resumes_from_its_own_config_yaml_and_other_spellings_of_its_paths(tmp_path, monkeypatch, capsys):
    """config.yaml names a local model.path absolute (so `agentrl view` finds it from anywhere),
    and the checkpoint kept it as typed: resuming a run from its own config.yaml, or with `./m`
    for `m`, was refused as another model."""
    from agentrl.errors import ConfigError
    from agentrl.recipe import run_config_yaml
    from agentrl.train import check_resume

    monkeypatch.chdir(tmp_path)
    for name in ("m", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "tasks.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    quickstart = str(Path(__file__).parent.parent / "recipes" / "quickstart.yaml")
    typed = ["model.path=m", "data.source=files", "data.files=[tasks.jsonl]", "data.num_tasks=1"]
    checkpoint = tmp_path / "checkpoints" / "step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "recipe.json").write_text(json.dumps(load_recipe(quickstart, typed).model_dump(mode="json")))
    (tmp_path / "config.yaml").write_text(run_config_yaml(load_recipe(quickstart, typed)))
    assert f"path: {tmp_path / 'm'}" in (tmp_path / "config.yaml").read_text()
    check_resume(load_recipe("config.yaml"), checkpoint)
    check_resume(load_recipe(quickstart, [*typed, "model.path=./m", f"data.files=[{tmp_path / 'tasks.jsonl'}]"]),
                 checkpoint)
    assert capsys.readouterr().err == ""  # not even a warning: the same model and tasks
    with pytest.raises(ConfigError, match=re.escape('(model.path "m" -> "other")')):
        check_resume(load_recipe(quickstart, [*typed, "model.path=other"]), checkpoint)


def test_only_a_checkpoint_file_that_is_itself_damaged_gets_the_advice_to_delete_it(tmp_path, monkeypatch):
    """Every failure to read it said "delete step_N": also one of this code (a class a pickle names
    that is gone after an upgrade), or out of memory, after which the checkpoint is good."""
    from torch.distributed.checkpoint.api import CheckpointException

    from agentrl.errors import ConfigError
    from agentrl.trainer.checkpoint import damaged, read_checkpoint_file

    assert damaged(EOFError("Ran out of input")) and damaged(RuntimeError("PytorchStreamReader failed reading zip"))
    assert not damaged(RuntimeError("CUDA out of memory")) and not damaged(ModuleNotFoundError("no module 'x'"))
    assert damaged(CheckpointException("x", {0: (FileNotFoundError(2, "gone"), None)}))
    assert not damaged(CheckpointException("x", {0: (RuntimeError("NCCL timeout"), None)}))
    (tmp_path / "gone_module.py").write_text("class Kept:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_module

    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    torch.save({"kept": gone_module.Kept()}, step / "trainer_state.pt")
    (tmp_path / "gone_module.py").unlink()
    monkeypatch.delitem(sys.modules, "gone_module")
    with pytest.raises(ModuleNotFoundError):  # as it is: the file is fine, this code lacks the class
        read_checkpoint_file(step / "trainer_state.pt")
    (step / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"if it is damaged, delete {step} to resume from the checkpoint")):
        read_checkpoint_file(step / "trainer_state.pt")
