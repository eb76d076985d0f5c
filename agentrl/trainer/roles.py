"""The roles a training run drives (rollout, policy, reference, critic), built from the recipe, and
the local backend that holds them all in the driver's process.

`Roles` is what the driver talks to. `LocalRoles` holds one worker of each role in this process;
`RayRoles` (trainer/launch.py) runs the same worker classes as Ray actors, one per rank or replica,
and exposes the same calls, so the driver reads the same with either backend. The factories below
are what an actor runs in its own process to build its worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agentrl.config import RecipeConfig
from agentrl.errors import ConfigError
from agentrl.models import enable_activation_checkpointing, load_model
from agentrl.hardware import choose_dtype
from agentrl.rollout.worker import LocalSink, RolloutWorker
from agentrl.trainer.checkpoint import (RECIPE, TRAINER_STATE, commit_checkpoint, read_checkpoint_file,
                                        staging_checkpoint)
from agentrl.trainer.critic import CriticWorker, ValueModel
from agentrl.trainer.distributed import Ranks
from agentrl.trainer.logprobs import check_logit_head
from agentrl.trainer.lora import add_lora
from agentrl.trainer.policy import PolicyWorker, ReferenceWorker
from agentrl.trainer.ray_settings import ray_environment
from agentrl.types import Task, Trajectory


def _compute(config: RecipeConfig, ranks: Ranks) -> dict[str, Any]:
    """bf16 settings: FSDP's mixed-precision policy when sharded, autocast otherwise."""
    bf16 = choose_dtype(config.trainer.dtype, config.trainer.device).dtype == "bfloat16"
    return {"param_dtype": torch.bfloat16 if bf16 and ranks.distributed else None,
            "bf16_autocast": bf16 and not ranks.distributed}


def make_policy(config: RecipeConfig, pad_id: int, ranks: Ranks = Ranks()) -> PolicyWorker:
    t, a = config.trainer, config.algorithm
    model = load_model(config.model.path).to(t.device)
    check_logit_head(model, f"model.path '{config.model.path}'")  # the trainer's logprobs skip `forward`
    if t.activation_checkpointing:
        enable_activation_checkpointing(model)
    if config.model.lora.rank > 0:
        if t.activation_checkpointing:
            model.enable_input_require_grads()  # frozen embeddings: recomputed layers still need grads
        model = add_lora(model, config.model.lora, config.model.path, seed=config.seed)
    # Dropout in the policy's forward passes (LoRA's) draws from this process's torch RNG: seeded
    # per rank from the recipe, so that a run repeats and a Ray rank, a process of its own, does
    # not start from wherever its start-up left the RNG. Checkpoints keep it (save_sharded).
    torch.manual_seed(config.seed + ranks.rank)
    return PolicyWorker(
        model, pad_id, lr=t.lr, temperature=config.rollout.temperature, weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps, grad_clip=t.grad_clip, ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches,
        micro_batch_tokens=t.micro_batch_tokens, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
        aggregation=a.aggregation, kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef, rollout_is_cap=a.rollout_is_cap, seed=config.seed, ranks=ranks,
        **_compute(config, ranks))


def make_reference(config: RecipeConfig, pad_id: int, ranks: Ranks = Ranks()) -> ReferenceWorker:
    t = config.trainer
    compute = _compute(config, ranks)  # the policy's precision, so KL at equal weights is exactly 0
    return ReferenceWorker(load_model(config.model.path).to(t.device), pad_id, config.rollout.temperature,
                           t.micro_batch_tokens, ranks, compute["param_dtype"],
                           offload=t.device.startswith("cuda") and ranks.distributed,
                           bf16_autocast=compute["bf16_autocast"])


def make_critic(config: RecipeConfig, pad_id: int, ranks: Ranks = Ranks()) -> CriticWorker:
    """From `critic.path`, or the policy's transformer with a zero value head."""
    t, c = config.trainer, config.critic
    value_model = ValueModel.load(c.path) if c.path else ValueModel(load_model(config.model.path).get_decoder())
    value_model = value_model.to(t.device)
    if t.activation_checkpointing:
        enable_activation_checkpointing(value_model.decoder)
    compute = _compute(config, ranks)
    return CriticWorker(value_model, pad_id, lr=c.lr, weight_decay=c.weight_decay, value_clip=c.value_clip,
                        grad_clip=t.grad_clip, ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches,
                        micro_batch_tokens=t.micro_batch_tokens, bf16_autocast=compute["bf16_autocast"],
                        seed=config.seed, ranks=ranks, param_dtype=compute["param_dtype"])


class Roles:
    """The calls the driver makes; subclasses place the workers. `policy`, `reference` and
    `critic` answer logprobs / values / update / save_state / load_state with whole-batch results."""

    config: RecipeConfig
    tokenizer: Any
    policy: Any
    reference: Any
    critic: Any

    def collect(self, tasks: list[Task]) -> list[Trajectory]: ...

    def release_memory(self) -> None: ...

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Tags from {"weights", "kv_cache"}, None for both: a sync resumes the weights first."""

    def sync_weights(self, version: int) -> None: ...

    def weight_version(self) -> int: ...

    def rollout_rng_states(self) -> list[Any]: ...

    def set_rollout_rng_states(self, states: list[Any]) -> None: ...

    def save_model(self, path: Path) -> None: ...

    def save_critic(self, path: Path) -> None: ...

    def shutdown(self) -> None:
        """Release what the roles opened outside their memory (engine servers, their weight files,
        tool processes); under Ray also the actors and their placement."""
        ...

    def worker_table(self) -> dict[str, int]:
        """{'policy rank 1': process id, ...} for the workers in processes of their own (none on the
        local backend); the driver writes it to <output_dir>/workers.json once the run directory is
        its own (an earlier run's table goes to previous/ with that run)."""
        return {}

    def save_checkpoint(self, run_dir: Path, step: int, history: list[dict[str, Any]]) -> Path:
        """checkpoints/step_<step>/: sharded policy (and critic) state, then the driver's state."""
        staging = staging_checkpoint(run_dir, step)
        (staging / RECIPE).write_text(json.dumps(self.config.model_dump(mode="json"), indent=1))
        state = {"step": step, "history": history, "torch_rng": torch.get_rng_state(),
                 "policy": self.policy.save_state(staging / "policy"),
                 "critic": self.critic.save_state(staging / "critic") if self.critic is not None else None,
                 "rollout_rng": self.rollout_rng_states()}
        torch.save(state, staging / TRAINER_STATE)
        return commit_checkpoint(staging, self.config.trainer.keep_checkpoints)

    def load_checkpoint(self, path: Path) -> tuple[int, list[dict[str, Any]]]:
        """Restore every role from a checkpoint; returns (its step, the metrics so far)."""
        state = read_checkpoint_file(path / TRAINER_STATE)
        if (state["critic"] is not None) != (self.critic is not None):
            raise ConfigError(f"{path}: the checkpoint was written {'with' if state['critic'] else 'without'} a "
                              "critic; algorithm.advantage must match the run that wrote it")
        self.policy.load_state(path / "policy", state["policy"])
        if self.critic is not None:
            self.critic.load_state(path / "critic", state["critic"])
        self.set_rollout_rng_states(state["rollout_rng"])
        torch.set_rng_state(state["torch_rng"])
        return state["step"], state["history"]


class LocalRoles(Roles):
    """Every role as a plain object in this process (trainer.backend 'local')."""

    def __init__(self, config: RecipeConfig, tokenizer: Any):
        self.config, self.tokenizer = config, tokenizer
        self.rollout = RolloutWorker(config)
        pad_id = tokenizer.pad_token_id
        try:
            self.policy = make_policy(config, pad_id)
            self.reference = make_reference(config, pad_id) if config.algorithm.kl_coef > 0 else None
            self.critic = make_critic(config, pad_id) if config.algorithm.advantage == "gae" else None
        except BaseException:  # the engine and the tools' servers are open already
            self.rollout.close()
            raise

    def collect(self, tasks: list[Task]) -> list[Trajectory]:
        return self.rollout.collect(tasks)

    def release_memory(self) -> None:
        self.rollout.release_memory()

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        self.rollout.resume_memory(tags)

    def sync_weights(self, version: int) -> None:
        self.policy.push_weights(LocalSink([self.rollout]), version, self.config.trainer.sync_bucket_mb << 20)

    def weight_version(self) -> int:
        return self.rollout.version()

    def rollout_rng_states(self) -> list[Any]:
        return [self.rollout.rng_state()]

    def set_rollout_rng_states(self, states: list[Any]) -> None:
        self.rollout.set_rng_state(states[0] if states else None)

    def save_model(self, path: Path) -> None:
        self.policy.save_pretrained(path, self.tokenizer)

    def save_critic(self, path: Path) -> None:
        self.critic.save(path)

    def shutdown(self) -> None:
        self.rollout.close()


def start_roles(config: RecipeConfig, tokenizer: Any) -> Roles:
    """The backend the recipe asks for (trainer.backend)."""
    if config.trainer.backend == "ray":
        ray_environment(private=config.trainer.ray_address is None)
        from agentrl.trainer.launch import RayRoles  # imports ray

        return RayRoles(config, tokenizer)
    return LocalRoles(config, tokenizer)
