"""The rows the transformers engine is decoding right now, and their keys and values in slots.

Rows join while others decode (an episode back from its tool does not wait for the whole batch to
finish) and leave as soon as they stop (a finished row costs no more compute). Each layer keeps its
keys and values in one buffer of R row slots × W columns; the running rows hold slots 0..n-1 and
every row's tokens end at the same column `end`, so a decode step writes one column for all rows
in place, and the model reads views of the buffers, never copies. An attention-mask row marks
exactly the columns holding its row's tokens, in order; other columns hold stale but finite values
(zeros, or keys of a row that left), masked out.

- A step appends column `end` in place; when the buffer is full it moves into a new one with ROOM
  spare columns (one copy per ROOM steps).
- Joining rows take slots n..n+J-1. Their cached keys and values (from the engine's prefix cache)
  are written right-aligned to end N columns before `end`, where N is the most new tokens any of
  them brings, and their new tokens go in place into the last N columns, so they end where the
  running rows end: in a forward pass of their own, or together with the running rows' next step
  in one packed pass (`mixed_inputs`, packed_attention.py), ending one column later with them.
  The rows' layout within the block is `[pad | cached | pad | new]`, with the mask hiding both gaps
  and position ids counting only real tokens, which is what each row would see alone (keys carry
  their rotary positions from when they were computed). The running rows are not touched.
- A row that would compute exactly what a joining row does (kv_cache.split_copies) joins as a copy
  of it after the pass: its slot gets that row's columns, mask and position.
- A leaving row's slot is filled by the last running row (one row's columns copied), and columns no
  remaining row uses are dropped from the left by moving `start`.

Only plain full-attention cache layers (transformers' `DynamicLayer`) fit this layout; the engine
refuses models with sliding-window or linear-attention layers. This module holds tensors and
bookkeeping; the engine decides when rows join, runs the model, samples and stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agentrl.rollout.kv_cache import KV, Hit, kv_layout
from agentrl.rollout.packed_attention import PackedPlan, ScatterLayer
from agentrl.rollout.sampling import request_generator
from agentrl.types import SamplingParams

ROOM = 128  # spare columns per reallocation: one copy of the cache per ROOM decode steps


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
    generator: torch.Generator | None = None  # a seeded request's own random stream

    def __post_init__(self) -> None:
        self.generator = request_generator(self.sampling.seed)

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


class SlotLayer(DynamicLayer):
    """One layer of a forward pass's cache: the columns [start, end) of some row slots of the
    batch's buffers. `update` writes the new columns at `end` in place (the batch made room)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: slice, start: int, end: int):
        super().__init__()
        self.buffers, self.row_slots, self.start, self.end = (keys, values), rows, start, end
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = keys[rows, :, start:end], values[rows, :, start:end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.buffers
        new = key_states.shape[2]
        keys[self.row_slots, :, self.end:self.end + new] = key_states
        values[self.row_slots, :, self.end:self.end + new] = value_states
        self.end += new
        self.keys = keys[self.row_slots, :, self.start:self.end]
        self.values = values[self.row_slots, :, self.start:self.end]
        return self.keys, self.values


@dataclass
class _Joining:
    """What `join_inputs` laid out, for `joined` to adopt once the forward pass has run."""

    rows: list[Row]
    mask_BT: torch.Tensor
    next_pos_B: torch.Tensor
    start: int
    end: int


class RunningBatch:
    """Rows, their key/value buffers, mask, next positions and last sampled tokens."""

    def __init__(self, config, pad_token_id: int, device: torch.device, dtype: torch.dtype, max_rows: int, *,
                 cache_keyword: str):
        self.config, self.pad_token_id, self.device = config, pad_token_id, device
        self.cache_keyword = cache_keyword  # the forward pass's name for its cache (kv_cache.cache_keyword)
        self.max_rows = max_rows  # how many slots to grow to at once (more are added if asked for)
        self.rows: list[Row] = []
        heads, dim = kv_layout(config)
        # All layers in one tensor (layers, R, kv_heads, W, head_dim): moving a row is one copy, not one per layer.
        self.keys = torch.zeros((config.num_hidden_layers, 0, heads, 0, dim), dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.start = self.end = 0  # the columns the running rows use
        self.mask_BT: torch.Tensor | None = None  # (n, end - start)
        self.next_pos_B: torch.Tensor | None = None
        self.tokens_B: torch.Tensor | None = None  # each row's last sampled token, fed by the next step
        self._joining: _Joining | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def _cache(self, rows: slice, start: int, end: int) -> DynamicCache:
        cache = DynamicCache(config=self.config)
        cache.layers = [SlotLayer(k, v, rows, start, end) for k, v in zip(self.keys, self.values)]
        return cache

    def _reserve(self, slots: int, left: int, right: int) -> None:
        """Make the buffers hold `slots` rows and columns [start - left, end + right) (reallocating,
        with ROOM spare columns on either side, when they do not)."""
        have = self.keys.shape[1:]
        if slots <= have[0] and self.start - left >= 0 and self.end + right <= have[2]:
            return
        used, n = self.end - self.start, len(self.rows)
        # Spare columns on the left too: rows joining later with longer contexts than the running
        # ones (episodes back from their tools) then fit without moving every running row.
        left += ROOM
        width = left + used + right + ROOM
        if slots > have[0]:  # grow by doubling up to max_rows, so rows trickling in do not each copy the cache
            slots = max(slots, min(2 * have[0], self.max_rows))
        else:
            slots = have[0]

        def moved(old: torch.Tensor) -> torch.Tensor:
            new = old.new_zeros((old.shape[0], slots, old.shape[2], width, old.shape[4]))
            new[:, :n, :, left:left + used] = old[:, :n, :, self.start:self.end]
            return new

        self.keys, self.values = moved(self.keys), moved(self.values)
        self.start, self.end = left, left + used

    def _place(self, rows: list[Row], right: int) -> tuple[list[int], list[int], torch.Tensor, int, int]:
        """Lay out joining rows (their `hit`s set) in free slots n.. so that their new tokens will
        end `right` columns after the running rows' (reserving those columns): their cached keys
        and values are copied in and their `_Joining` is set. Returns each row's cached and new
        token counts, their new tokens' positions (J, N) left-padded, and the columns [first, stop)
        of their block."""
        cached = [r.hit.length for r in rows]
        new = [len(r.prompt) - c for r, c in zip(rows, cached)]
        width_c, width_n = max(cached), max(new)
        n, joining = len(self.rows), len(rows)
        block = width_c + width_n  # the joining rows' columns: [stop - block, stop) once they ran
        if n:
            self._reserve(n + joining, max(0, block - (self.end + right - self.start)), right)
        else:
            self.start = self.end = 0
            self._reserve(joining, 0, block)
            self.end = self.start + block - right
        stop = self.end + right
        first = stop - block
        for j, (row, c) in enumerate(zip(rows, cached)):
            if c:
                k_LHTD, v_LHTD = row.hit.entry.kv
                self.keys[:, n + j, :, first + width_c - c:first + width_c] = k_LHTD[:, :, :c]
                self.values[:, n + j, :, first + width_c - c:first + width_c] = v_LHTD[:, :, :c]
            # Copied: the row no longer holds the entry, which the cache may evict (or never kept,
            # a prefix over its whole budget) while the row runs.
            row.hit.entry = None
        mask_BT = torch.zeros((joining, block), dtype=torch.long)
        for j, (c, m) in enumerate(zip(cached, new)):
            mask_BT[j, width_c - c:width_c] = 1
            mask_BT[j, block - m:] = 1
        mask_BT = mask_BT.to(self.device)
        positions_BN = (mask_BT.cumsum(-1) - 1).clamp(min=0)[:, width_c:]
        self._joining = _Joining(list(rows), mask_BT, positions_BN[:, -1] + 1, first, stop)
        return cached, new, positions_BN, first, stop

    def join_inputs(self, rows: list[Row]) -> dict[str, Any]:
        """Lay out joining rows (their `hit`s set) in free slots and return their forward pass's
        inputs, left-padded; `joined` adopts them after it."""
        cached, new, positions_BN, first, stop = self._place(rows, 0)
        ids_BN = torch.full(tuple(positions_BN.shape), self.pad_token_id, dtype=torch.long)
        for j, (row, c, m) in enumerate(zip(rows, cached, new)):
            ids_BN[j, ids_BN.shape[1] - m:] = torch.tensor(row.prompt[c:])
        n = len(self.rows)
        return {"input_ids": ids_BN.to(self.device), "attention_mask": self._joining.mask_BT,
                "position_ids": positions_BN, "use_cache": True,
                self.cache_keyword: self._cache(slice(n, n + len(rows)), first, stop - ids_BN.shape[1])}

    def mixed_inputs(self, rows: list[Row]) -> tuple[dict[str, Any], PackedPlan]:
        """One packed pass (packed_attention.py) for the running rows' next token and the joining
        rows' new tokens: its inputs, and the plan attention follows. `mixed_done` adopts the result."""
        n = len(self.rows)
        cached, new, positions_BN, first, stop = self._place(rows, 1)
        width_n = positions_BN.shape[1]
        real_BN = torch.arange(width_n)[None, :] >= width_n - torch.tensor(new)[:, None]
        ids = self.tokens_B.tolist() + [t for row, c in zip(rows, cached) for t in row.prompt[c:]]
        slots = list(range(n)) + [n + j for j, m in enumerate(new) for _ in range(m)]
        columns = [self.end] * n + [c for m in new for c in range(stop - m, stop)]
        offsets = torch.tensor([n] + new[:-1]).cumsum(0) - (width_n - torch.tensor(new))  # packed index of grid column 0
        grid_BN = torch.where(real_BN, offsets[:, None] + torch.arange(width_n), offsets[:, None] + width_n - 1)
        block_mask_BT = self._joining.mask_BT.bool().cpu()  # built beside the other index tensors, moved once
        width_c = block_mask_BT.shape[1] - width_n
        key_col, query_col = torch.arange(block_mask_BT.shape[1]), width_c + torch.arange(width_n)
        causal_NT = key_col[None, :] <= query_col[:, None]
        join_mask = (block_mask_BT[:, None, :] & causal_NT) | ((~real_BN)[:, :, None] & (key_col == query_col[:, None]))
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones((n, 1))], dim=1)
        plan = PackedPlan(n, self.mask_BT.bool()[:, None, None, :], grid_BN.to(self.device),
                          real_BN.to(self.device), join_mask[:, None].to(self.device), self.start, first, stop)
        positions = torch.cat([self.next_pos_B.cpu(), positions_BN.cpu()[real_BN]])
        cache = DynamicCache(config=self.config)
        slots_T, columns_T = torch.tensor(slots, device=self.device), torch.tensor(columns, device=self.device)
        cache.layers = [ScatterLayer(k, v, slots_T, columns_T) for k, v in zip(self.keys, self.values)]
        # A 4-D attention mask is passed through untouched: the plan's masks are the ones attention uses.
        inputs = {"input_ids": torch.tensor([ids], device=self.device), "position_ids": positions[None].to(self.device),
                  "attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device),
                  self.cache_keyword: cache, "use_cache": True,
                  "logits_to_keep": torch.tensor(list(range(n)) + grid_BN[:, -1].tolist(), device=self.device)}
        self.end += 1
        self.next_pos_B = self.next_pos_B + 1
        return inputs, plan

    def mixed_done(self, tokens_B: torch.Tensor) -> None:
        """The pass `mixed_inputs` laid out ran and sampled `tokens_B`, running rows first."""
        n = len(self.rows)
        self.tokens_B = tokens_B[:n]
        self.joined(tokens_B[n:])

    def joined(self, tokens_B: torch.Tensor) -> None:
        """The rows `join_inputs` laid out ran their forward pass and sampled `tokens_B`: they run now."""
        joining, self._joining = self._joining, None
        start = min(self.start, joining.start) if self.rows else joining.start
        width = self.end - start
        masks = [_left_pad(joining.mask_BT, width)]
        if self.rows:
            masks.insert(0, _left_pad(self.mask_BT, width))
        self.mask_BT, self.start = torch.cat(masks), start
        self.next_pos_B = joining.next_pos_B if not self.rows else torch.cat([self.next_pos_B, joining.next_pos_B])
        self.tokens_B = tokens_B if not self.rows else torch.cat([self.tokens_B, tokens_B])
        self.rows += joining.rows

    def copy_rows(self, sources: list[int], rows: list[Row], tokens_B: torch.Tensor) -> None:
        """`rows` run from now on as copies of the running rows at `sources`, which computed what
        they would have (kv_cache.split_copies): each takes a free slot holding its source's keys
        and values, mask and next position, with its own last sampled token from `tokens_B`."""
        n = len(self.rows)
        self._reserve(n + len(rows), 0, 0)
        for slot, source in enumerate(sources, start=n):
            for buffer in (self.keys, self.values):
                buffer[:, slot, :, self.start:self.end] = buffer[:, source, :, self.start:self.end]
        index = torch.tensor(sources, device=self.mask_BT.device)
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT[index]])
        self.next_pos_B = torch.cat([self.next_pos_B, self.next_pos_B[index]])
        self.tokens_B = torch.cat([self.tokens_B, tokens_B])
        for row in rows:
            row.hit.entry = None  # as for a placed row: the cache may evict the entry while it runs
        self.rows += rows

    def row_kv(self, index: int) -> KV:
        """Copies of one row's keys and values, its tokens in order."""
        runs = _runs(self.mask_BT[index])  # a few contiguous runs of columns: slices copy faster than an index
        return tuple(torch.cat([buffer[:, index, :, self.start + a:self.start + b] for a, b in runs], dim=2)
                     for buffer in (self.keys, self.values))

    def keep(self, indices: list[int]) -> None:
        """Only the rows at `indices` (ascending) stay: the last ones move into the freed slots."""
        n, kept = len(self.rows), len(indices)
        if kept == 0:
            self.rows, self.mask_BT, self.next_pos_B, self.tokens_B = [], None, None, None
            return
        staying = set(indices)
        holes = [i for i in range(kept) if i not in staying]
        movers = [i for i in range(kept, n) if i in staying]
        for hole, mover in zip(holes, movers):  # slice copies: an index over slots is the slow path
            for buffer in (self.keys, self.values):
                buffer[:, hole, :, self.start:self.end] = buffer[:, mover, :, self.start:self.end]
            for tensor in (self.mask_BT, self.next_pos_B, self.tokens_B):
                tensor[hole] = tensor[mover]
            self.rows[hole] = self.rows[mover]
        self.rows = self.rows[:kept]
        self.mask_BT, self.next_pos_B, self.tokens_B = self.mask_BT[:kept], self.next_pos_B[:kept], self.tokens_B[:kept]
        first = int(self.mask_BT.any(dim=0).nonzero()[0])
        self.start += first
        self.mask_BT = self.mask_BT[:, first:]

    def step_inputs(self) -> dict[str, Any]:
        """The next forward pass: every row's last token at its next position, one more column."""
        self._reserve(len(self.rows), 0, 1)
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones((len(self.rows), 1))], dim=1)
        inputs = {"input_ids": self.tokens_B[:, None], "attention_mask": self.mask_BT,
                  "position_ids": self.next_pos_B[:, None], "use_cache": True,
                  self.cache_keyword: self._cache(slice(0, len(self.rows)), self.start, self.end)}
        self.end += 1
        self.next_pos_B = self.next_pos_B + 1
        return inputs


def _runs(mask_T: torch.Tensor) -> list[tuple[int, int]]:
    """The [begin, end) column ranges where a mask row is 1, left to right."""
    edges = torch.diff(torch.nn.functional.pad(mask_T.to(torch.int8), (1, 1))).nonzero().squeeze(1).tolist()
    return list(zip(edges[::2], edges[1::2]))


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """A mask `t` (B, T) with zero columns on the left up to `width`."""
    missing = width - t.shape[1]
    return t if missing == 0 else torch.cat([t.new_zeros((t.shape[0], missing)), t], dim=1)
