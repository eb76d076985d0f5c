"""The critic for PPO with GAE: the policy's architecture with a scalar value head.

`ValueModel` wraps any causal LM's decoder (`get_decoder()`) and replaces the vocabulary head with a
linear map to one number. Values are aligned like logprobs: values_BT[:, t] is read from the hidden
state at t - 1, i.e. the value of the state in which token t is chosen, and is 0 off the mask.
The head starts at zero so the first advantages are the plain returns.

It is saved as `decoder/` (a transformers model directory) plus `value_head.pt`, so a critic can be
started from a trained one with `critic.path`.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel

from agentrl.algos.losses import value_loss
from agentrl.errors import ConfigError
from agentrl.trainer.checkpoint import atomic_directory, full_state_dict, load_sharded, save_sharded
from agentrl.trainer.distributed import Ranks, clipped_step, shard_model
from agentrl.trainer.logprobs import (PaddedBatch, disable_model_dropout, evaluation, mini_batch_schedule, pad_values,
                                      padded_micro_batches)
from agentrl.trainer.optimizer import adamw


class ValueModel(torch.nn.Module):
    def __init__(self, decoder: torch.nn.Module):
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(decoder.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, causal_lm: torch.nn.Module) -> "ValueModel":
        """A critic initialised from the policy's transformer (the policy itself is not shared)."""
        return cls(copy.deepcopy(causal_lm.get_decoder()))

    @classmethod
    def load(cls, path: str | Path) -> "ValueModel":
        path = Path(path)
        if (path / "value_head.pt").exists():
            model = cls(AutoModel.from_pretrained(path / "decoder", dtype=torch.float32))
            model.head.load_state_dict(torch.load(path / "value_head.pt", weights_only=True))
            return model
        from agentrl.models import load_model  # a causal LM checkpoint: take its decoder, fresh head

        return cls(load_model(str(path)).get_decoder())

    def save(self, path: str | Path, rank: int = 0) -> None:
        """`decoder/` and `value_head.pt` at `path`; all ranks call it when sharded, rank 0 writes."""
        state = full_state_dict(self)
        if rank != 0:
            return
        state = state if state is not None else self.state_dict()
        with atomic_directory(path) as staging:
            self.decoder.save_pretrained(staging / "decoder", state_dict={
                name.removeprefix("decoder."): t for name, t in state.items() if name.startswith("decoder.")})
            torch.save({name.removeprefix("head."): t for name, t in state.items() if name.startswith("head.")},
                       staging / "value_head.pt")

    def forward(self, batch: PaddedBatch) -> torch.Tensor:
        # use_cache=False: nothing decodes from here, and a decoder would build a key/value cache per call
        hidden_BTH = self.decoder(input_ids=batch.ids_BT, attention_mask=batch.attention_BT,
                                  use_cache=False).last_hidden_state
        values_BT = torch.zeros(batch.mask_BT.shape, dtype=torch.float, device=hidden_BTH.device)
        values_BT[:, 1:] = self.head(hidden_BTH[:, :-1]).squeeze(-1).float()
        return values_BT * batch.mask_BT


def check_critic_path(path: str) -> None:
    """`critic.path` names what ValueModel.load starts from (a saved critic; or a causal LM: a local
    model directory, a builtin name, a hub id), or a ConfigError naming the key. Cheap (a hub id
    reads its config only), so the driver checks it before any model loads."""
    from agentrl.models import BUILTIN_MODELS

    local = Path(path)
    if local.is_dir():
        if ((local / "value_head.pt").is_file() and (local / "decoder" / "config.json").is_file()
                or any((local / name).is_file() for name in ("config.json", "adapter_config.json"))):
            return
        raise ConfigError(f"critic.path: {path} is a directory but neither a saved critic (decoder/ and "
                          "value_head.pt) nor a model directory (config.json or adapter_config.json)")
    if path in BUILTIN_MODELS:
        return
    if local.is_absolute() or path.startswith(("./", "../", "~")):  # a path, not a hub id
        raise ConfigError(f"critic.path: {path} does not exist")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"critic.path: '{path}' is not a local directory, not a builtin "
                          f"({', '.join(BUILTIN_MODELS)}), and loading it as a hub id failed "
                          f"({str(e).splitlines()[0]})") from None


class CriticWorker:
    """The value model, its optimiser, and the clipped value-loss update."""

    def __init__(self, model: ValueModel, pad_id: int, *, lr: float, value_clip: float | None,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, ppo_epochs: int = 1, mini_batches: int = 1,
                 micro_batch_tokens: int = 4096, bf16_autocast: bool = False, seed: int = 0,
                 ranks: Ranks = Ranks(), param_dtype: torch.dtype | None = None):
        self.ranks = ranks
        disable_model_dropout(model, ranks.rank)
        if ranks.distributed:
            shard_model(model, param_dtype)
        self.model = model.train()
        self.device = next(model.parameters()).device
        self.pad_id, self.value_clip, self.grad_clip = pad_id, value_clip, grad_clip
        self.ppo_epochs, self.mini_batches, self.micro_batch_tokens = ppo_epochs, mini_batches, micro_batch_tokens
        self.bf16_autocast = bf16_autocast
        self.optimizer = adamw(model.parameters(), lr, weight_decay)
        self.rng = random.Random(seed)

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast)

    @torch.no_grad()
    def values(self, sequences: list[list[int]], masks: list[list[int]]) -> list[list[float] | None]:
        """Values of this rank's share of the batch (in eval mode); None for other ranks' rows."""
        out: list[list[float] | None] = [None] * len(sequences)
        plan = self.ranks.micro_batch_plan(list(range(len(sequences))), sequences, masks, self.micro_batch_tokens)
        with evaluation(self.model):
            for idx, batch in padded_micro_batches(plan, sequences, masks, self.pad_id, self.device):
                with self._autocast():
                    values_BT = self.model(batch)
                for row, i in enumerate(idx):
                    out[i] = values_BT[row, : len(sequences[i])].tolist()
        return out

    def update(self, sequences: list[list[int]], masks: list[list[int]], returns: list[list[float]],
               old_values: list[list[float]]) -> dict[str, float]:
        """Epochs over mini-batches of the clipped value loss (token mean over each mini-batch, by
        its global token count); the metrics are means over the optimizer steps taken, the gradient
        norm over those not skipped (0.0 when all were)."""
        totals = {"value_loss": 0.0, "critic_grad_norm": 0.0, "critic_skipped_step_fraction": 0.0}
        passes = stepped_passes = 0  # mini_batch_schedule skips empty mini-batches
        for mini in mini_batch_schedule(self.rng, len(sequences), self.ppo_epochs, self.mini_batches):
            passes += 1
            total = max(sum(sum(masks[i][1:]) for i in mini), 1)
            # Rows without a trainable token weigh nothing: left out, as the policy does, so that a
            # mini-batch of only such rows leaves every gradient None and AdamW moves no weight (a
            # zero gradient would still step on the momentum and the weight decay).
            plan = self.ranks.micro_batch_plan([i for i in mini if any(masks[i][1:])], sequences, masks,
                                               self.micro_batch_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            for n, (idx, batch) in enumerate(padded_micro_batches(plan, sequences, masks, self.pad_id, self.device)):
                if self.ranks.distributed:
                    self.model.set_requires_gradient_sync(n == len(plan) - 1)
                width = batch.ids_BT.shape[1]
                with self._autocast():
                    values_BT = self.model(batch)
                if not idx:  # a dummy pass that keeps FSDP's collectives in step
                    (values_BT.sum() * 0.0).backward()
                    continue
                loss = value_loss(values_BT, pad_values([old_values[i] for i in idx], width, self.device),
                                  pad_values([returns[i] for i in idx], width, self.device), batch.mask_BT,
                                  self.value_clip) * (batch.num_tokens / total)
                (loss * self.ranks.world_size).backward()  # FSDP averages over ranks
                totals["value_loss"] += loss.item()
            norm, stepped = clipped_step(self.model, self.optimizer, self.grad_clip, self.ranks.rank, "critic's")
            totals["critic_grad_norm"] += norm if stepped else 0.0
            totals["critic_skipped_step_fraction"] += 0.0 if stepped else 1.0
            stepped_passes += stepped
        out = {key: value / max(passes, 1) for key, value in totals.items()}
        out["critic_grad_norm"] = totals["critic_grad_norm"] / max(stepped_passes, 1)
        return out

    def save(self, path: str | Path) -> None:
        self.model.save(path, rank=self.ranks.rank)

    def save_state(self, path: str | Path) -> dict[str, Any]:
        save_sharded(path, self.model, self.optimizer, self.ranks)
        return {"rng": self.rng.getstate()}

    def load_state(self, path: str | Path, extra: dict[str, Any]) -> None:
        load_sharded(path, self.model, self.optimizer, self.ranks, shaped_by="model.path and critic.path")
        self.rng.setstate(extra["rng"])
