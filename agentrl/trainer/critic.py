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

import torch
from transformers import AutoModel

from agentrl.algos.losses import value_loss
from agentrl.trainer.logprobs import PaddedBatch, mini_batch_schedule, pad_values, padded_micro_batches


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

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.decoder.save_pretrained(path / "decoder")
        torch.save(self.head.state_dict(), path / "value_head.pt")

    def forward(self, batch: PaddedBatch) -> torch.Tensor:
        hidden_BTH = self.decoder(input_ids=batch.ids_BT, attention_mask=batch.attention_BT).last_hidden_state
        values_BT = torch.zeros(batch.mask_BT.shape, dtype=torch.float, device=hidden_BTH.device)
        values_BT[:, 1:] = self.head(hidden_BTH[:, :-1]).squeeze(-1).float()
        return values_BT * batch.mask_BT


class CriticWorker:
    """The value model, its optimiser, and the clipped value-loss update."""

    def __init__(self, model: ValueModel, pad_id: int, *, lr: float, value_clip: float | None,
                 grad_clip: float = 1.0, ppo_epochs: int = 1, mini_batches: int = 1,
                 micro_batch_tokens: int = 4096, bf16_autocast: bool = False, seed: int = 0):
        self.model = model.train()
        self.device = next(model.parameters()).device
        self.pad_id, self.value_clip, self.grad_clip = pad_id, value_clip, grad_clip
        self.ppo_epochs, self.mini_batches, self.micro_batch_tokens = ppo_epochs, mini_batches, micro_batch_tokens
        self.bf16_autocast = bf16_autocast
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.rng = random.Random(seed)

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast)

    @torch.no_grad()
    def values(self, sequences: list[list[int]], masks: list[list[int]]) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in sequences]
        for idx, batch in padded_micro_batches(list(range(len(sequences))), sequences, masks,
                                               self.micro_batch_tokens, self.pad_id, self.device):
            with self._autocast():
                values_BT = self.model(batch)
            for row, i in enumerate(idx):
                out[i] = values_BT[row, : len(sequences[i])].tolist()
        return out

    def update(self, sequences: list[list[int]], masks: list[list[int]], returns: list[list[float]],
               old_values: list[list[float]]) -> dict[str, float]:
        """Epochs over mini-batches of the clipped value loss (token mean over each mini-batch)."""
        totals = {"value_loss": 0.0, "critic_grad_norm": 0.0}
        for mini in mini_batch_schedule(self.rng, len(sequences), self.ppo_epochs, self.mini_batches):
            total = max(sum(sum(masks[i][1:]) for i in mini), 1)
            self.optimizer.zero_grad(set_to_none=True)
            for idx, batch in padded_micro_batches(mini, sequences, masks, self.micro_batch_tokens, self.pad_id,
                                                   self.device):
                width = batch.ids_BT.shape[1]
                with self._autocast():
                    values_BT = self.model(batch)
                loss = value_loss(values_BT, pad_values([old_values[i] for i in idx], width, self.device),
                                  pad_values([returns[i] for i in idx], width, self.device), batch.mask_BT,
                                  self.value_clip) * (batch.num_tokens / total)
                loss.backward()
                totals["value_loss"] += loss.item()
            totals["critic_grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
            self.optimizer.step()
        passes = self.ppo_epochs * self.mini_batches
        return {key: value / passes for key, value in totals.items()}
