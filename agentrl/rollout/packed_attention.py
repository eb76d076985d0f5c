"""Attention for the transformers engine's mixed passes: running rows and joining rows in one
forward pass, packed without padding.

When requests join a running batch (episodes back from their tools), a pass of their own for the
joining rows' new tokens followed by the decode step costs two passes, and on a CPU each pass
pays a fixed price for reading every weight and launching every layer's kernels (for
SmolLM2-135M on 2 cores a 1-token pass costs about as much as 50 tokens' worth of a long prefill).
A mixed pass feeds the running rows' one token each and the joining rows' new tokens as one
sequence of batch 1, so the linear layers see exactly the real tokens; only attention is split by
group, over the rows' slots in the running batch's buffers (running_batch.py): running rows with
one query each over their columns, joining rows with their new tokens as queries (left-padded to
the longest, causal) over their block. Both calls are transformers' own SDPA attention, the one a
plain decode step uses.

transformers looks attention up by name (`AttentionInterface`). `install` switches the engine's
model from `sdpa` to `agentrl_slots`, which is transformers' SDPA attention (with SDPA's masks) in
every ordinary forward pass (one-token queries without a mask on CPU group their heads themselves,
see `grouped_decode_attention`) and splits by group only while a `PackedPlan` is active. The plan goes
through a context variable instead of a model keyword so that it reaches the attention function
whichever keywords a model's layers pass on.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "agentrl_slots"


@dataclass
class PackedPlan:
    """Which packed positions belong to which rows, and what each group attends to. The keys and
    values attention receives are the whole slot buffers (R, kv_heads, W, head_dim), the packed
    tokens already written into them."""

    running: int  # rows 0..n-1 feed one token each, packed positions 0..n-1
    running_mask: torch.Tensor  # (n, 1, 1, end - start) bool: the running rows' columns [start, end)
    join_grid: torch.Tensor  # (J, N) packed position of each joining row's new tokens, left-padded
    join_real: torch.Tensor  # (J, N) bool: the grid's real tokens (the rest are padding)
    join_mask: torch.Tensor  # (J, 1, N, end - first) bool: the joining rows' columns [first, end)
    start: int
    first: int
    end: int
    _grouped: tuple[int, torch.Tensor] | None = None  # (group, join_mask repeated per group), built once per pass

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> tuple[torch.Tensor, None]:
        q_HTD, n, joining = query[0], self.running, self.join_grid.shape[0]
        out_THD = query.new_empty((q_HTD.shape[1], q_HTD.shape[0], value.shape[-1]))  # values may have their own head size
        if n:
            q_BH1D = q_HTD[:, :n, None].transpose(0, 1)
            columns = slice(self.start, self.end)
            o_B1HD, _ = sdpa_attention_forward(module, q_BH1D, key[:n, :, columns], value[:n, :, columns],
                                               self.running_mask, scaling=scaling)
            out_THD[:n] = o_B1HD[:, 0]
        if joining:
            # Query heads grouped by the key head they share, as the queries of that head (the
            # grouped-query trick transformers applies to one-token queries): no key or value is
            # repeated per query head.
            heads, kv_heads, width = q_HTD.shape[0], key.shape[1], self.join_grid.shape[1]
            group = heads // kv_heads
            q_JKGD = q_HTD[:, self.join_grid].view(kv_heads, group, joining, width, -1).permute(2, 0, 1, 3, 4)
            rows, columns = slice(n, n + joining), slice(self.first, self.end)
            o_JKGD = torch.nn.functional.scaled_dot_product_attention(
                q_JKGD.reshape(joining, kv_heads, group * width, -1), key[rows, :, columns], value[rows, :, columns],
                attn_mask=self.grouped_join_mask(group), scale=scaling)
            o_JNHD = o_JKGD.view(joining, heads, width, -1).transpose(1, 2)
            out_THD[n:] = o_JNHD[self.join_real]
        return out_THD[None], None

    def grouped_join_mask(self, group: int) -> torch.Tensor:
        """`join_mask` for queries grouped `group` per key head: (J, 1, group * N, end - first)."""
        if self._grouped is None or self._grouped[0] != group:
            self._grouped = group, self.join_mask.repeat(1, 1, group, 1)
        return self._grouped[1]


class ScatterLayer(DynamicLayer):
    """One layer of a mixed pass's cache: each packed token's key and value go to its row's slot
    and column; attention gets the whole buffers (the pass's PackedPlan slices them per group)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots_T: torch.Tensor, columns_T: torch.Tensor):
        super().__init__()
        self.buffers, self.slots_T, self.columns_T = (keys, values), slots_T, columns_T
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.buffers
        keys[self.slots_T, :, self.columns_T] = key_states[0].transpose(0, 1)
        values[self.slots_T, :, self.columns_T] = value_states[0].transpose(0, 1)
        return keys, values


_active: ContextVar[PackedPlan | None] = ContextVar("agentrl_packed_plan", default=None)


def slot_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs):
    plan = _active.get()
    if plan is not None:
        return plan.attend(module, query, key, value, scaling)
    if attention_mask is None and query.shape[2] == 1 and query.device.type == "cpu":
        return grouped_decode_attention(query, key, value, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scaling: float | None) -> tuple[torch.Tensor, None]:
    """One-token queries without a mask (every row's columns all real), query heads grouped per key
    head. transformers hands this case to SDPA's `enable_gqa`, whose CPU kernel runs one-token
    queries several times slower in bfloat16 (bench/decode_step.py); with a mask it groups the heads
    as done here. Written out rather than calling transformers' `pack_gqa`, which transformers
    5.12 (the version SGLang pins, run by `make test-sglang`) does not have."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    out_BKGD = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(rows, kv_heads, heads // kv_heads, dim), key, value, scale=scaling)
    return out_BKGD.reshape(rows, 1, heads, value.shape[-1]), None


AttentionInterface.register(NAME, slot_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def install(model: torch.nn.Module) -> bool:
    """Switch a model that uses SDPA attention to `agentrl_slots` (the same attention outside mixed
    passes); False, and nothing changed, for any other implementation: the engine then runs joining
    rows in a pass of their own."""
    if model.config._attn_implementation not in ("sdpa", NAME):
        return False
    model.set_attn_implementation(NAME)
    return True


@contextmanager
def packed(plan: PackedPlan) -> Iterator[None]:
    """Forward passes inside split attention by `plan`."""
    token = _active.set(plan)
    try:
        yield
    finally:
        _active.reset(token)
