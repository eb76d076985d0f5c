"""The RL driver. One step: collect groups → release engine memory → old and reference logprobs →
(critic values) → advantages → policy (and critic) update → resume the engine's weights → weight sync
(new version, cache flush) → resume its KV cache → log.

Everything a step needs is built once in `train`; the loop body reads top to bottom. Roles are
plain objects in this process (trainer.backend 'local').
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from agentrl.algos.losses import kl_estimate
from agentrl.config import RecipeConfig, to_yaml
from agentrl.memory import release_freed_memory
from agentrl.models import enable_activation_checkpointing, load_model
from agentrl.rollout.collect import collect, summarize
from agentrl.rollout.run import build_runner
from agentrl.trainer.checkpoint import STATE_FILE, load_checkpoint, save_checkpoint, save_model
from agentrl.trainer.critic import CriticWorker, ValueModel
from agentrl.trainer.policy import PolicyWorker, ReferenceWorker
from agentrl.trainer.returns import gae_targets, outcome_advantages
from agentrl.types import Trajectory


def build_workers(config: RecipeConfig, pad_id: int
                  ) -> tuple[PolicyWorker, ReferenceWorker | None, CriticWorker | None]:
    """The trained policy; a frozen reference when the KL is on; a critic for GAE."""
    t, a, r = config.trainer, config.algorithm, config.rollout
    policy = PolicyWorker(
        load_model(config.model.path).to(t.device), pad_id, lr=t.lr, temperature=r.temperature,
        weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, grad_clip=t.grad_clip, ppo_epochs=t.ppo_epochs,
        mini_batches=t.mini_batches, micro_batch_tokens=t.micro_batch_tokens, clip_low=a.clip_low,
        clip_high=a.clip_high, dual_clip=a.dual_clip, aggregation=a.aggregation,
        kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
        bf16_autocast=t.bf16_autocast, seed=config.seed)
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
                              micro_batch_tokens=t.micro_batch_tokens, bf16_autocast=t.bf16_autocast,
                              seed=config.seed)
    return policy, reference, critic


def step_record(step: int, trajectories: list[Trajectory], rollout: dict[str, float], update: dict[str, float],
                times: dict[str, float]) -> dict[str, float]:
    """One metrics.jsonl line: rollout summary, update metrics, time split."""
    rewards = torch.tensor([tr.reward or 0.0 for tr in trajectories])
    return {"step": step, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
            "accuracy": sum(tr.metrics.get("outcome_reward", 0.0) for tr in trajectories) / len(trajectories),
            "response_tokens": rollout["tokens_generated"] / len(trajectories),
            **{k: v for k, v in rollout.items() if k not in ("reward_mean", "wall_s")},
            **update, **times, "weight_version": step,
            "tokens_per_s": rollout["tokens_generated"] / sum(times.values())}


def train(config: RecipeConfig) -> list[dict[str, float]]:
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
    bar = tqdm(range(done + 1, t.steps + 1), desc="train", file=sys.stdout, dynamic_ncols=True, initial=done,
               total=t.steps)
    with open(run_dir / "metrics.jsonl", "w") as log:
        log.writelines(json.dumps(record) + "\n" for record in history)
        for step in bar:
            tasks = [pool[i % len(pool)] for i in range((step - 1) * t.tasks_per_step, step * t.tasks_per_step)]
            clock = time.perf_counter()
            trajectories = asyncio.run(collect(runner, tasks, r.group_size, r.max_concurrent_episodes))
            rollout = summarize(trajectories, time.perf_counter() - clock)
            times = {"time_rollout_s": time.perf_counter() - clock}

            clock = time.perf_counter()
            engine.release_memory()
            sequences, masks = [tr.token_ids for tr in trajectories], [tr.loss_mask for tr in trajectories]
            old = None if policy.on_policy else policy.logprobs(sequences, masks)
            ref = reference.logprobs(sequences, masks) if reference else None
            kl = None
            if ref is not None and a.kl_in_reward:
                base = old or policy.logprobs(sequences, masks)
                kl = [kl_estimate(torch.tensor(p), torch.tensor(q), a.kl_estimator).tolist() for p, q in zip(base, ref)]
            if critic is not None:
                values = critic.values(sequences, masks)
                advantages, returns = gae_targets(trajectories, values, a, kl)
            else:
                advantages = outcome_advantages(trajectories, r.group_size, a, kl)
            times["time_logprobs_s"] = time.perf_counter() - clock

            clock = time.perf_counter()
            update = policy.update(sequences, masks, advantages, old, None if a.kl_in_reward else ref,
                                   rollout_logprobs=[tr.logprobs for tr in trajectories])
            if critic is not None:
                update |= critic.update(sequences, masks, returns, values)
            release_freed_memory()  # once a step, after the largest allocations (see agentrl/memory.py)
            times["time_update_s"] = time.perf_counter() - clock

            clock = time.perf_counter()
            engine.resume_memory(("weights",))  # the weights first: the KV cache is not needed to load them
            engine.update_weights(policy.named_weights(), version=step, flush_cache=True)
            engine.resume_memory(("kv_cache",))
            times["time_sync_s"] = time.perf_counter() - clock

            record = step_record(step, trajectories, rollout, update, times)
            history.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", tools=f"{record['tool_call_rate']:.2f}",
                            loss=f"{record['loss']:.4f}", kl_ref=f"{record['kl_ref']:.4f}",
                            engine_gap=f"{record['rollout_logprob_diff']:.1e}")
            if t.save_every and step % t.save_every == 0:
                save_model(policy.model, tokenizer, run_dir / f"step_{step}")
                save_checkpoint(run_dir / "checkpoint", step, policy, critic, history)
    save_model(policy.model, tokenizer, run_dir / "final")
    if critic is not None:
        critic.model.save(run_dir / "critic")
    print("reward by step: " + " ".join(f"{h['reward_mean']:.2f}" for h in history))
    print(f"saved {run_dir / 'final'}; metrics in {run_dir / 'metrics.jsonl'}")
    return history
