"""The policy worker (PPO-style updates) and the reference worker (frozen logprobs for KL).

Plain classes holding a model: the local backend uses them in one process, the Ray backend runs one
per rank (trainer/launch.py), sharded with FSDP2 when there are several (trainer/distributed.py).
Every rank receives the whole batch and works on its token-balanced share; results for other
ranks' rows are None and the caller merges them. A training step hands the policy worker per-token
advantages; the worker runs PPO epochs over mini-batches, packs each rank's share of a mini-batch
into micro-batches by a token budget, accumulates gradients so that the loss equals the mini-batch
loss exactly (normalised by the mini-batch's global counts, whatever the number of ranks), clips the
gradient norm and steps AdamW.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from agentrl.algos.losses import aggregate, kl_estimate, ppo_policy_loss, truncated_importance_weights
from agentrl.trainer.checkpoint import load_sharded, save_model, save_sharded
from agentrl.trainer.distributed import Ranks, buckets, clipped_step, shard_model
from agentrl.trainer.lora import merged_weights
from agentrl.trainer.logprobs import (attach_token_logprobs, disable_model_dropout, evaluation, mini_batch_schedule,
                                      pad_values, padded_micro_batches, token_logprobs)
from agentrl.trainer.optimizer import adamw
from agentrl.trainer.packing import PackCost, enable_packing


class WeightSink(Protocol):
    """Where a weight sync goes: the local engine, or every engine replica under Ray."""

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None: ...

    def finish(self, version: int) -> None: ...


class ReferenceWorker:
    """A frozen model whose logprobs anchor the KL term (no optimizer; shards may live offloaded).
    `bf16_autocast` must match the policy's, so that at equal weights both give equal logprobs."""

    def __init__(self, model: torch.nn.Module, pad_id: int, temperature: float, micro_batch_tokens: int,
                 ranks: Ranks = Ranks(), param_dtype: torch.dtype | None = None, offload: bool = False,
                 bf16_autocast: bool = False):
        self.model = model.eval().requires_grad_(False)
        self.pack_cost = enable_packing(model)  # before sharding: it counts parameters
        if ranks.distributed:
            shard_model(self.model, param_dtype, offload, forward_methods=(attach_token_logprobs(self.model),))
        self.pad_id, self.temperature, self.micro_batch_tokens = pad_id, temperature, micro_batch_tokens
        self.ranks = ranks
        self.bf16_autocast = bf16_autocast

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]], masks: list[list[int]]) -> list[list[float] | None]:
        device = next(self.model.parameters()).device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast):
            return batched_logprobs(self.model, sequences, masks, self.pad_id, self.temperature,
                                    self.micro_batch_tokens, self.ranks, self.pack_cost)


def batched_logprobs(model: torch.nn.Module, sequences: list[list[int]], masks: list[list[int]], pad_id: int,
                     temperature: float, micro_batch_tokens: int, ranks: Ranks = Ranks(),
                     cost: PackCost | None = None) -> list[list[float] | None]:
    """Per-sequence token logprobs (0.0 off the mask) of this rank's share, in micro-batches without
    grad and in eval mode, packed by `cost` (packing.py); None for the rows other ranks compute
    (none with one rank)."""
    device = next(model.parameters()).device
    out: list[list[float] | None] = [None] * len(sequences)
    plan = ranks.micro_batch_plan(list(range(len(sequences))), sequences, masks, micro_batch_tokens, cost)
    with torch.no_grad(), evaluation(model):
        for idx, batch in padded_micro_batches(plan, sequences, masks, pad_id, device):
            logprobs_BT, _ = token_logprobs(model, batch, temperature)
            for row, i in enumerate(idx):
                out[i] = logprobs_BT[row, : len(sequences[i])].tolist()
    return out


class PolicyWorker:
    """The trained model, its optimiser and learning-rate schedule."""

    def __init__(self, model: torch.nn.Module, pad_id: int, *, lr: float, temperature: float,
                 weight_decay: float = 0.0, warmup_steps: int = 0, grad_clip: float = 1.0,
                 ppo_epochs: int = 1, mini_batches: int = 1, micro_batch_tokens: int = 4096,
                 clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                 aggregation: str = "token-mean", kl_coef: float = 0.0, kl_estimator: str = "k3",
                 entropy_coef: float = 0.0, rollout_is_cap: float | None = None, bf16_autocast: bool = False,
                 seed: int = 0, ranks: Ranks = Ranks(), param_dtype: torch.dtype | None = None):
        self.ranks = ranks
        disable_model_dropout(model, ranks.rank)
        self.pack_cost = enable_packing(model)  # before sharding: it counts parameters
        if ranks.distributed:  # before the optimizer, which must hold the shards
            shard_model(model, param_dtype, forward_methods=(attach_token_logprobs(model),))
        self.model = model.train()
        self.device = next(model.parameters()).device
        self.pad_id, self.temperature = pad_id, temperature
        self.grad_clip, self.ppo_epochs, self.mini_batches = grad_clip, ppo_epochs, mini_batches
        self.micro_batch_tokens = micro_batch_tokens
        self.clip = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, aggregation=aggregation)
        self.kl_coef, self.kl_estimator, self.entropy_coef = kl_coef, kl_estimator, entropy_coef
        self.rollout_is_cap = rollout_is_cap
        self.bf16_autocast = bf16_autocast
        self.optimizer = adamw(model.parameters(), lr, weight_decay)  # with LoRA: the adapters only
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0)
        self.rng = random.Random(seed)

    @property
    def on_policy(self) -> bool:
        """One pass over one mini-batch: the pre-update logprobs are those of the first forward."""
        return self.ppo_epochs == 1 and self.mini_batches == 1

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast)

    def logprobs(self, sequences: list[list[int]], masks: list[list[int]]) -> list[list[float] | None]:
        """This rank's share of the batch's token logprobs (None for other ranks' rows)."""
        with self._autocast():
            return batched_logprobs(self.model, sequences, masks, self.pad_id, self.temperature,
                                    self.micro_batch_tokens, self.ranks, self.pack_cost)

    def update(self, sequences: list[list[int]], masks: list[list[int]], advantages: list[list[float]],
               old_logprobs: list[list[float]] | None = None,
               ref_logprobs: list[list[float]] | None = None,
               rollout_logprobs: list[list[float]] | None = None) -> dict[str, float]:
        """PPO epochs over mini-batches; `old_logprobs` None is allowed only when on_policy. Each
        metric is the mean over the optimizer steps taken (a `_max` one the largest); grad_norm is
        over the steps not skipped (0.0 when all were: skipped_step_fraction says so), and kl_ref
        is there only with a reference.

        With `rollout_logprobs` (the engine's, as sampled) the metrics include
        rollout_logprob_diff: the mean |engine - trainer| logprob gap before the update, which is
        ~0 when weight sync works and grows with precision mismatch (bf16 engine) or a stale engine,
        and engine_k3_mean / engine_k3_max: the k3 estimate of KL(engine || trainer) per token.
        With `rollout_is_cap` they also weight each token's surrogate (truncated_importance_weights),
        and rollout_is_weight_mean / rollout_is_truncated_fraction say by how much.
        """
        if old_logprobs is None and not self.on_policy:
            raise ValueError("old_logprobs are required with several epochs or mini-batches")
        if self.rollout_is_cap is not None and rollout_logprobs is None and sequences:
            raise ValueError("rollout_is_cap weights tokens by the engine's logprobs: rollout_logprobs are required")
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        totals: dict[str, float] = {}
        # Mini-batches that reported each metric: fewer than epochs × mini_batches with fewer episodes
        # than parts, and grad_norm only from steps not skipped (a skipped one's 0 lowered the mean).
        counts: dict[str, int] = {}
        for mini in mini_batch_schedule(self.rng, len(sequences), self.ppo_epochs, self.mini_batches):
            for key, value in self._mini_batch(mini, sequences, masks, advantages, old_logprobs, ref_logprobs,
                                               rollout_logprobs).items():
                totals[key] = max(totals.get(key, value), value) if key.endswith("_max") else totals.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
        metrics = {key: value if key.endswith("_max") else value / counts[key] for key, value in totals.items()}
        if counts and "grad_norm" not in metrics:
            metrics["grad_norm"] = 0.0
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # the schedule counts RL steps, a skipped optimizer step too
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()
        return metrics

    def _mini_batch(self, mini, sequences, masks, advantages, old_logprobs, ref_logprobs,
                    rollout_logprobs) -> dict[str, float]:
        token_mean = self.clip["aggregation"] == "token-mean"
        # Global counts over the whole mini-batch (every rank has it): the same loss at any world size.
        total = sum(sum(masks[i][1:]) for i in mini) if token_mean else sum(1 for i in mini if sum(masks[i][1:]))
        tokens = max(sum(sum(masks[i][1:]) for i in mini), 1)
        metrics = {"loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "entropy": 0.0}
        if ref_logprobs is not None:  # without a reference there is no KL to it (a 0 read as "no drift")
            metrics["kl_ref"] = 0.0
        if rollout_logprobs is not None:
            metrics.update(rollout_logprob_diff=0.0, engine_k3_mean=0.0, engine_k3_max=0.0)
            if self.rollout_is_cap is not None:
                metrics.update(rollout_is_weight_mean=0.0, rollout_is_truncated_fraction=0.0)
        # Rows without a trainable token (a prompt that filled the context) weigh nothing: left out.
        plan = self.ranks.micro_batch_plan([i for i in mini if any(masks[i][1:])], sequences, masks,
                                           self.micro_batch_tokens, self.pack_cost)
        self.optimizer.zero_grad(set_to_none=True)
        for n, (idx, batch) in enumerate(padded_micro_batches(plan, sequences, masks, self.pad_id, self.device)):
            if self.ranks.distributed:  # reduce gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(n == len(plan) - 1)
            width = batch.ids_BT.shape[1]
            with self._autocast():
                logprobs_BT, entropy_BT = token_logprobs(self.model, batch, self.temperature,
                                                         entropy_grad=bool(self.entropy_coef))
            if not idx:  # a dummy pass that keeps FSDP's collectives in step; it weighs nothing
                ((logprobs_BT.sum() + entropy_BT.sum()) * 0.0).backward()
                continue
            old_BT = (pad_values([old_logprobs[i] for i in idx], width, self.device) if old_logprobs is not None
                      else logprobs_BT.detach())
            advantages_BT = pad_values([advantages[i] for i in idx], width, self.device)
            weights_BT = None
            if rollout_logprobs is not None:  # always token-mean: a per-token precision figure
                rollout_BT = pad_values([rollout_logprobs[i] for i in idx], width, self.device)
                metrics["rollout_logprob_diff"] += ((old_BT - rollout_BT).abs() * batch.mask_BT).sum().item() / tokens
                # KL(engine || trainer) per sampled token, k3 from the engine's own samples
                k3_BT = kl_estimate(rollout_BT, old_BT.detach(), "k3") * batch.mask_BT
                metrics["engine_k3_mean"] += k3_BT.sum().item() / tokens
                metrics["engine_k3_max"] = max(metrics["engine_k3_max"], k3_BT.max().item())
                if self.rollout_is_cap is not None:
                    weights_BT = truncated_importance_weights(old_BT, rollout_BT, self.rollout_is_cap)
                    metrics["rollout_is_weight_mean"] += (weights_BT * batch.mask_BT).sum().item() / tokens
                    capped_BT = (weights_BT >= self.rollout_is_cap).to(batch.mask_BT.dtype) * batch.mask_BT
                    metrics["rollout_is_truncated_fraction"] += capped_BT.sum().item() / tokens
            part = (batch.num_tokens if token_mean else int((batch.mask_BT.sum(1) > 0).sum())) / max(total, 1)
            loss, clip_metrics = ppo_policy_loss(logprobs_BT, old_BT, advantages_BT, batch.mask_BT, **self.clip,
                                                 weights_BT=weights_BT)
            loss = loss * part
            # The loss terms follow the aggregation; the reported entropy and KL are token means
            # whatever it is (as the KL in the rewards is reported): a sum per sequence is no entropy.
            if self.entropy_coef:
                loss = loss - self.entropy_coef * aggregate(entropy_BT, batch.mask_BT, self.clip["aggregation"]) * part
            if ref_logprobs is not None:
                ref_BT = pad_values([ref_logprobs[i] for i in idx], width, self.device)
                kl_BT = kl_estimate(logprobs_BT, ref_BT, self.kl_estimator)
                if self.kl_coef:
                    loss = loss + self.kl_coef * aggregate(kl_BT, batch.mask_BT, self.clip["aggregation"]) * part
                metrics["kl_ref"] += (kl_BT.detach() * batch.mask_BT).sum().item() / tokens
            # FSDP averages gradients over ranks; each rank's loss is its part of the global loss.
            (loss * self.ranks.world_size).backward()
            metrics["loss"] += loss.item()
            metrics["entropy"] += (entropy_BT.detach() * batch.mask_BT).sum().item() / tokens
            # Token means, as entropy and kl_ref: `part` counts sequences under a seq-mean aggregation,
            # which would make these depend on how rows fall into micro-batches and ranks.
            metrics["clip_fraction"] += clip_metrics["clip_fraction"] * batch.num_tokens / tokens
            metrics["approx_kl"] += clip_metrics["approx_kl"] * batch.num_tokens / tokens
        norm, stepped = clipped_step(self.model, self.optimizer, self.grad_clip, self.ranks.rank, "policy's")
        metrics["skipped_step_fraction"] = 0.0 if stepped else 1.0
        if stepped:
            metrics["grad_norm"] = norm
        return metrics

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors for weight sync, named as the base model's state_dict (LoRA merged in);
        every rank must exhaust it."""
        yield from merged_weights(self.model)

    def push_weights(self, sink: WeightSink, version: int, bucket_bytes: int) -> None:
        """Weight sync: every rank gathers each full tensor (a collective), rank 0 sends them to the
        sink in buckets of at most `bucket_bytes`, then the sink flushes and takes `version`."""
        for bucket in buckets(self.named_weights(), bucket_bytes):
            if self.ranks.rank == 0:
                sink.send(bucket)
        if self.ranks.rank == 0:
            sink.finish(version)

    def save_pretrained(self, path: str | Path, tokenizer: Any) -> None:
        """A transformers model directory at `path`, written by rank 0 (all ranks must call)."""
        save_model(self.model, tokenizer, path, rank=self.ranks.rank)

    def save_state(self, path: str | Path) -> dict[str, Any]:
        """Sharded model and optimizer state into `path` (each rank its shard; all ranks must call),
        and the small state that is the same on every rank, for the driver to keep."""
        save_sharded(path, self.model, self.optimizer, self.ranks)
        return {"scheduler": self.scheduler.state_dict(), "rng": self.rng.getstate()}

    def load_state(self, path: str | Path, extra: dict[str, Any]) -> None:
        load_sharded(path, self.model, self.optimizer, self.ranks)
        # The checkpoint gives the schedule's position; the learning rate is the recipe's.
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scheduler.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # what get_last_lr() reads
        self.rng.setstate(extra["rng"])
