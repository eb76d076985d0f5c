"""The RL driver. One step: collect groups → release engine memory → old and reference logprobs →
(critic values) → advantages → policy (and critic) update → resume engine memory → weight sync
(new version, cache flush) → log.

Everything a step needs is built once in `train`; the loop body reads top to bottom. Roles are
plain objects in this process (trainer.backend 'local').
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch

from agentrl.algos.losses import kl_estimate
from agentrl.config import AlgorithmConfig, RecipeConfig, check_training, to_yaml
from agentrl.errors import RunFailed
from agentrl.hardware import choose_dtype
from agentrl.memory import release_freed_memory
from agentrl.models import enable_activation_checkpointing, load_model
from agentrl.rollout.collect import run_episodes, summarize, write_jsonl
from agentrl.rollout.run import build_runner
from agentrl.trainer.checkpoint import STATE_FILE, load_checkpoint, save_checkpoint, save_model
from agentrl.trainer.critic import CriticWorker, ValueModel
from agentrl.trainer.policy import PolicyWorker, ReferenceWorker
from agentrl.tracking import RunLogger
from agentrl.trainer.returns import gae_targets, outcome_advantages, token_advantages
from agentrl.types import Trajectory


def build_workers(config: RecipeConfig, pad_id: int
                  ) -> tuple[PolicyWorker, ReferenceWorker | None, CriticWorker | None]:
    """The trained policy; a frozen reference when the KL is on; a critic for GAE."""
    t, a, r = config.trainer, config.algorithm, config.rollout
    bf16_autocast = choose_dtype(t.dtype, t.device).dtype == "bfloat16"
    policy = PolicyWorker(
        load_model(config.model.path).to(t.device), pad_id, lr=t.lr, temperature=r.temperature,
        weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, grad_clip=t.grad_clip, ppo_epochs=t.ppo_epochs,
        mini_batches=t.mini_batches, micro_batch_tokens=t.micro_batch_tokens, clip_low=a.clip_low,
        clip_high=a.clip_high, dual_clip=a.dual_clip, aggregation=a.aggregation,
        kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
        bf16_autocast=bf16_autocast, seed=config.seed)
    reference = (ReferenceWorker(load_model(config.model.path).to(t.device), pad_id, r.temperature,
                                 t.micro_batch_tokens) if a.kl_coef > 0 else None)
    if t.activation_checkpointing:
        enable_activation_checkpointing(policy.model)
    critic = None
    if a.advantage == "gae":
        value_model = (ValueModel.load(config.critic.path).to(t.device) if config.critic.path
                       else ValueModel.from_policy(policy.model))
        if t.activation_checkpointing:
            enable_activation_checkpointing(value_model.decoder)
        critic = CriticWorker(value_model, pad_id, lr=config.critic.lr, value_clip=config.critic.value_clip,
                              grad_clip=t.grad_clip, ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches,
                              micro_batch_tokens=t.micro_batch_tokens, bf16_autocast=bf16_autocast,
                              seed=config.seed)
    return policy, reference, critic


def step_record(step: int, trajectories: list[Trajectory], rollout: dict[str, float], update: dict[str, float],
                times: dict[str, float], synced_version: int) -> dict[str, float]:
    """One metrics.jsonl line: rollout summary, update metrics, time split, weight versions.
    `weight_version` is the oldest version the engine reported for this step's samples;
    `synced_version` the one it holds after this step's sync."""
    ok = [tr for tr in trajectories if tr.finish != "error"]
    rewards = torch.tensor([tr.reward for tr in ok] or [0.0])
    return {"step": step, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(ok) > 1 else 0.0,
            "accuracy": sum(tr.metrics.get("outcome_reward", 0.0) for tr in ok) / max(len(ok), 1),
            "response_tokens": rollout["tokens_generated"] / len(trajectories),
            **{k: v for k, v in rollout.items() if k not in ("reward_mean", "wall_s")},
            **update, **times, "weight_version": min(tr.weight_version for tr in trajectories),
            "synced_version": synced_version, "tokens_per_s": rollout["tokens_generated"] / sum(times.values())}


def check_failures(step: int, trajectories: list[Trajectory], max_fraction: float) -> None:
    """Stop the run, naming the most common causes, when too many of a step's episodes failed."""
    failed = [tr for tr in trajectories if tr.finish == "error"]
    if len(failed) > max_fraction * len(trajectories):
        causes = "; ".join(f"{error} ({count}x)" for error, count in Counter(tr.error for tr in failed).most_common(3))
        raise RunFailed(f"step {step}: {len(failed)} of {len(trajectories)} episodes failed (more than "
                        f"trainer.max_failed_fraction {max_fraction:g}): {causes}")


def learn(trajectories: list[Trajectory], group_size: int, a: AlgorithmConfig, policy: PolicyWorker,
          reference: ReferenceWorker | None, critic: CriticWorker | None, times: dict[str, float]) -> dict[str, float]:
    """Old and reference logprobs, advantages, and the policy (and critic) update, on the episodes
    that did not fail; returns the update's metrics and adds the time split to `times`."""
    clock = time.perf_counter()
    per_sequence = outcome_advantages(trajectories, group_size, a) if critic is None else None
    trained = [tr for tr in trajectories if tr.finish != "error"]
    if not trained:  # every episode failed and trainer.max_failed_fraction allowed it: nothing to learn
        times.update(time_logprobs_s=0.0, time_update_s=0.0)
        return {}
    sequences, masks = [tr.token_ids for tr in trained], [tr.loss_mask for tr in trained]
    old = None if policy.on_policy else policy.logprobs(sequences, masks)
    ref = reference.logprobs(sequences, masks) if reference else None
    kl = None
    if ref is not None and a.kl_in_reward:
        base = old or policy.logprobs(sequences, masks)
        kl = [kl_estimate(torch.tensor(p), torch.tensor(q), a.kl_estimator).tolist() for p, q in zip(base, ref)]
    if critic is not None:
        values = critic.values(sequences, masks)
        advantages, returns = gae_targets(trained, values, a, kl)
    else:
        advantages = token_advantages(trained, [x for x in per_sequence if x is not None], a, kl)
    times["time_logprobs_s"] = time.perf_counter() - clock

    clock = time.perf_counter()
    update = policy.update(sequences, masks, advantages, old, None if a.kl_in_reward else ref,
                           rollout_logprobs=[tr.logprobs for tr in trained])
    if critic is not None:
        update |= critic.update(sequences, masks, returns, values)
    release_freed_memory()  # once a step, after the largest allocations (see agentrl/memory.py)
    times["time_update_s"] = time.perf_counter() - clock
    return update


def train(config: RecipeConfig) -> list[dict[str, float]]:
    check_training(config)
    print(to_yaml(config), file=sys.stderr)
    t, a, r = config.trainer, config.algorithm, config.rollout
    runner, pool = build_runner(config)
    engine, tokenizer = runner.engine, runner.renderer.tokenizer
    policy, reference, critic = build_workers(config, tokenizer.pad_token_id)
    run_dir = Path(config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    history: list[dict[str, float]] = []
    done = 0  # completed steps; the step number is also the data cursor
    if t.resume and (run_dir / "checkpoint" / STATE_FILE).exists():
        done, history = load_checkpoint(run_dir / "checkpoint", policy, critic)
        engine.update_weights(policy.named_weights(), version=done, flush_cache=True)
        print(f"resumed from {run_dir / 'checkpoint'} after step {done}")
    (run_dir / "config.yaml").write_text(to_yaml(config))
    with RunLogger(run_dir, config.model_dump(mode="json"), t.steps, t.wandb_project, start_step=done) as logger:
        for step in range(done + 1, t.steps + 1):
            tasks = [pool[i % len(pool)] for i in range((step - 1) * t.tasks_per_step, step * t.tasks_per_step)]
            clock = time.perf_counter()
            trajectories = run_episodes(runner, tasks, r.group_size, r.max_concurrent_episodes)
            rollout = summarize(trajectories, time.perf_counter() - clock)
            times = {"time_rollout_s": time.perf_counter() - clock}
            write_jsonl(trajectories, run_dir / "trajectories" / f"step_{step}.jsonl", step=step)
            check_failures(step, trajectories, t.max_failed_fraction)

            engine.release_memory()
            update = learn(trajectories, r.group_size, a, policy, reference, critic, times)

            clock = time.perf_counter()
            engine.resume_memory()
            engine.update_weights(policy.named_weights(), version=step, flush_cache=True)
            times["time_sync_s"] = time.perf_counter() - clock

            record = step_record(step, trajectories, rollout, update, times, engine.weight_version)
            history.append(record)
            logger.log(step, record)
            if t.save_every and step % t.save_every == 0:
                save_model(policy.model, tokenizer, run_dir / f"step_{step}")
                save_checkpoint(run_dir / "checkpoint", step, policy, critic, history)
    save_model(policy.model, tokenizer, run_dir / "final")
    if critic is not None:
        critic.model.save(run_dir / "critic")
    print("reward by step: " + " ".join(f"{h['reward_mean']:.2f}" for h in history))
    print(f"saved {run_dir / 'final'}; metrics in {run_dir / 'metrics.jsonl'}")
    return history
