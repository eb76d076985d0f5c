"""The rows the transformers engine is decoding right now, and their batched KV cache.

Rows join while others decode (an episode back from its tool does not wait for the whole batch to
finish) and leave as soon as they stop (a finished row costs no more compute). Joining rows are
prefilled on their own, then their cache is concatenated to the running one: whichever is narrower
gets zero key/value columns on the left, masked out. Leaving rows are dropped with the cache's
`batch_select_indices`, and columns no remaining row uses are cut from the left. Every row's
attention-mask row marks exactly the columns holding its tokens, in order, so a leaving row's keys
and values (for the prefix cache) are the columns its mask selects.

Each decode step appends one key and value column per layer. transformers' DynamicLayer does that
with `torch.cat`, copying the whole cache every step: for 32 rows of 500 tokens of SmolLM2-135M in
float32 that is ~0.7 GB moved per token, a large part of a CPU decode step. `RoomyLayer` keeps its
keys and values as views of buffers with room for `ROOM` more columns and writes new columns in
place, so the cache is copied once per ROOM steps (and when rows join or leave) instead.

This module holds tensors and bookkeeping; the engine decides when rows join, samples and stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agentrl.rollout.kv_cache import KV, Hit
from agentrl.types import SamplingParams


@dataclass
class Row:
    """One request being decoded: its prompt, what it reuses, and what it has sampled so far."""

    prompt: list[int]
    sampling: SamplingParams
    owner: Any = None  # whoever waits for the result (the engine's pending request, or a list slot)
    hit: Hit = field(default_factory=Hit)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"
    done: bool = False

    def take(self, token: int, logprob: float) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        if token in self.sampling.stop_token_ids:
            self.done, self.finish = True, "stop"
        elif len(self.ids) >= self.sampling.max_new_tokens:
            self.done = True

    def fed_ids(self) -> list[int]:
        """The tokens whose keys and values the cache holds: all but the last sampled one."""
        return self.prompt + self.ids[:-1]


ROOM = 128  # spare key/value columns per layer: one copy of the cache per ROOM decode steps


class RoomyLayer(DynamicLayer):
    """A DynamicLayer whose `keys` and `values` are views of larger buffers: `update` writes the new
    columns after the view when the buffer has room, and otherwise moves the view into a new buffer
    with ROOM spare columns. Anything that replaces `keys`/`values` with another tensor (joining,
    leaving, cutting columns) simply makes the next update move it."""

    @classmethod
    def adopt(cls, layer: DynamicLayer) -> "RoomyLayer":
        roomy = cls()
        roomy.__dict__.update(layer.__dict__)
        return roomy

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys = _append(self.keys, key_states)
        self.values = _append(self.values, value_states)
        return self.keys, self.values


def _append(view: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`view` (B, H, T, D) with `new` (B, H, N, D) after it along T, in place when `view` is the
    last columns of a buffer with room (a view of a view has the root buffer as `_base`)."""
    base = view._base
    if base is not None and base.dim() == 4 and base.shape[:2] == view.shape[:2] and base.stride() == view.stride():
        start = (view.storage_offset() - base.storage_offset()) // base.stride(2)
        end = start + view.shape[2]
        if end + new.shape[2] <= base.shape[2]:
            base[:, :, end:end + new.shape[2]] = new
            return base[:, :, start:end + new.shape[2]]
    batch, heads, length, dim = view.shape
    buffer = view.new_empty((batch, heads, length + new.shape[2] + ROOM, dim))
    buffer[:, :, :length] = view
    buffer[:, :, length:length + new.shape[2]] = new
    return buffer[:, :, :length + new.shape[2]]


def with_room(past: DynamicCache) -> DynamicCache:
    """`past` with its plain layers made RoomyLayers (no copy until the next update)."""
    past.layers = [RoomyLayer.adopt(layer) if type(layer) is DynamicLayer else layer for layer in past.layers]
    return past


class RunningBatch:
    """Rows, their cache (keys and values per layer), mask, next positions and last sampled tokens."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.past: DynamicCache | None = None
        self.mask_BT: torch.Tensor | None = None
        self.next_pos_B: torch.Tensor | None = None
        self.tokens_B: torch.Tensor | None = None  # each row's last sampled token, fed by the next step

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: list[Row], past: DynamicCache, mask_BT: torch.Tensor, next_pos_B: torch.Tensor,
             tokens_B: torch.Tensor) -> None:
        """Add freshly prefilled rows with their own cache (same layers, any width)."""
        if not self.rows:
            self.rows, self.past, self.mask_BT, self.next_pos_B, self.tokens_B = \
                list(rows), past, mask_BT, next_pos_B, tokens_B
            return
        width = max(self.mask_BT.shape[1], mask_BT.shape[1])
        for mine, theirs in zip(self.past.layers, past.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.mask_BT = torch.cat([_left_pad(self.mask_BT, width), _left_pad(mask_BT, width)])
        self.next_pos_B = torch.cat([self.next_pos_B, next_pos_B])
        self.tokens_B = torch.cat([self.tokens_B, tokens_B])
        self.rows += rows

    def row_kv(self, index: int) -> KV:
        """Copies of one row's keys and values, its tokens in order."""
        columns = self.mask_BT[index].nonzero().squeeze(1)
        return [(layer.keys[index].index_select(1, columns), layer.values[index].index_select(1, columns))
                for layer in self.past.layers]

    def keep(self, indices: list[int]) -> None:
        """Only the rows at `indices` stay; columns no remaining row uses are cut from the left."""
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            self.past = self.mask_BT = self.next_pos_B = self.tokens_B = None
            return
        index_B = torch.tensor(indices, device=self.mask_BT.device)
        self.past.batch_select_indices(index_B)
        self.mask_BT, self.next_pos_B, self.tokens_B = \
            self.mask_BT[index_B], self.next_pos_B[index_B], self.tokens_B[index_B]
        first = int(self.mask_BT.any(dim=0).nonzero()[0])
        if first:
            for layer in self.past.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask_BT = self.mask_BT[:, first:]

    def step_inputs(self) -> dict[str, Any]:
        """The next forward pass: every row's last token at its next position, one more mask column."""
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones((len(self.rows), 1))], dim=1)
        inputs = {"input_ids": self.tokens_B[:, None], "attention_mask": self.mask_BT,
                  "position_ids": self.next_pos_B[:, None], "past_key_values": self.past, "use_cache": True}
        self.next_pos_B = self.next_pos_B + 1
        return inputs


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` with zero columns on the left of its sequence dimension (dim 2 of keys, 1 of a mask)."""
    dim = 2 if t.dim() == 4 else 1
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
