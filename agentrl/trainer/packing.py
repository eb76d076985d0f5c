"""Packed micro-batches: the rows of a GRPO group run their shared prompt once, in one decoder call.

A group's episodes start with the same prompt, often most of each sequence (the quickstart: ~250 of
330–440 tokens). A packed row lays that prompt out once, followed by each member's own tokens:
`[prompt | rest_1 | rest_2 | ...]`. A 4D attention mask lets a member's tokens see the prompt and
their own earlier tokens only, and position ids continue the prompt's for every member, so each
member's hidden states are those of its full row (only float rounding differs). A micro-batch is
a few packed rows padded to the longest, run through the decoder in one call: the linear layers
see all of a micro-batch's tokens at once, with the prompt counted once and little padding, and the
backward pass sums each member's gradient into the prompt by itself.

Attention over a packed row is where the layouts differ. On a CPU, a model with SDPA attention
gets segmented attention (`enable_packing`, segment_attention.py): the prompt, the members over
the prompt and each member over itself are separate kernel calls, so a member costs the same pairs
as in a row of its own and every member of a group joins (within the micro-batch's token budget);
micro-batches where that does not pay (narrow ones, see `segment_layout`) keep the mask.
Elsewhere (eager attention, a GPU) the 4D mask is applied and a packed row of length L costs L²
query-key pairs where its members alone would have Σ len²; a member then joins only while that
costs less than starting another packed row that repeats the prompt (`PackCost`, estimated from
the model's size), so long completions split a group over several packed rows and short ones
share one. bench/packed_update.py and the README have the figures.

Packing needs attention that honours a custom 4D mask and position ids (transformers' SDPA and
eager attention) over every key (a sliding-window layer given the full mask would see too much,
GPT-Neo's local layers too, set by `attention_layers` rather than by cache layers), with positions
from the position ids (ALiBi's bias, MPT's and Bloom's, counts key indices, which packing moves):
`pack_cost` returns None for any other model, whose rows then run in full, one per padded row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.models import plain_attention_layers
from agentrl.trainer import segment_attention
from agentrl.trainer.segment_attention import SegmentPlan, segment_plan

MIN_SHARED_PREFIX = 16  # below this, repeating the prompt per row costs less than the mask's bookkeeping
# Narrower packed rows run the 4D mask even where segmented attention is installed: over short
# rows the masked kernel's one call costs less than three calls over their pieces (bf16 on 2 cores,
# one layer's forward and backward: 262 columns 39 vs 47 ms; 462 and more 1.1-1.8x in favour of
# segments).
MIN_SEGMENTED_WIDTH = 384
MIN_PAIRS_SAVED = 1.5  # measured from 462 columns up: 1.95-4.9x fewer pairs ran 1.14-1.84x faster


@dataclass(frozen=True)
class PackCost:
    """A decoder pass's multiply-adds: `token` per token (the linear layers) and `pair` per
    query-key pair (attention scores and their weighted sum, every layer and head). `segmented`:
    the model's attention computes only the pairs a packed row allows (segment_attention.py)."""

    token: float
    pair: float
    segmented: bool = False

    def of(self, length: int) -> float:
        return self.token * length + self.pair * length * length

    def joins(self, length: int, shared: int, rest: int) -> bool:
        """Whether a row's `rest` tokens should join a packed row of `length` rather than start a
        new packed row of the `shared` prefix and `rest`. With segmented attention they always do
        (the member's pairs are the same either way and the prefix is not run again; micro-batches
        too narrow to segment keep the mask, over rows short enough that its extra pairs cost
        little); with the mask, while the pairs between the member and the other members cost less
        than running the prefix again."""
        if shared == 0:
            return False
        return self.segmented or self.of(length + rest) - self.of(length) <= self.of(shared + rest)


def pack_cost(model: torch.nn.Module) -> PackCost | None:
    """The model's PackCost, or None when its rows cannot be packed (module docstring). Call it
    before sharding: it counts parameters."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager", segment_attention.NAME) or plain_attention_layers(config):
        return None
    alibi = config.model_type == "bloom" or getattr(config, "alibi", False) or \
        getattr(getattr(config, "attn_config", None), "alibi", False)
    if alibi or "local" in (getattr(config, "attention_layers", None) or ()):
        return None
    embeddings = model.get_input_embeddings().weight.numel()
    token = sum(p.numel() for p in model.get_decoder().parameters()) - embeddings
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return PackCost(token=float(token), pair=2.0 * config.num_hidden_layers * heads * head_dim,
                    segmented=implementation == segment_attention.NAME)


def enable_packing(model: torch.nn.Module) -> PackCost | None:
    """Give a CPU model segmented attention where it can take it, then its PackCost (`pack_cost`)."""
    if pack_cost(model) is not None:
        segment_attention.install(model)
    return pack_cost(model)


@dataclass
class PackedRow:
    """Rows of the batch laid out as `[shared prefix | rest of each row]`; one row alone is just itself."""

    rows: list[int]
    shared: int  # leading tokens common to all rows, laid out once
    length: int = 0  # shared + Σ (len(row) - shared)


def first_trainable(mask: list[int]) -> int:
    """Position of a row's first trainable token (position 0 never is); len(mask) when none."""
    return next((t for t, m in enumerate(mask) if m and t > 0), len(mask))


def shareable_prefix(sequences: list[list[int]], masks: list[list[int]]) -> int:
    """Length of the prefix every row has in common and whose hidden states nothing needs: it ends
    before the last position ahead of each row's first trainable token (that position's hidden
    state predicts it) and leaves every row at least one token of its own; 0 when not worth it."""
    if len(sequences) < 2:
        return 0
    limit = min(min(len(s) for s in sequences) - 1,
                min(first_trainable(mask) - 1 for mask in masks))
    first = sequences[0]
    shared = 0
    while shared < limit and all(s[shared] == first[shared] for s in sequences):
        shared += 1
    return shared if shared >= MIN_SHARED_PREFIX else 0


def packed_rows(indices: list[int], sequences: list[list[int]], masks: list[list[int]],
                cost: PackCost | None, token_budget: int | None = None) -> list[PackedRow]:
    """`indices` as packed rows: rows whose tokens before their first trainable one are the same
    (a GRPO group's prompt) share packed rows, in order, while that is cheaper than a new one and
    stays within `token_budget` (a micro-batch's); every other row (and every row when `cost` is
    None) is a packed row of its own."""
    if cost is None:
        return [PackedRow([i], 0, len(sequences[i])) for i in indices]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        by_prompt.setdefault(tuple(sequences[i][:first_trainable(masks[i])]), []).append(i)
    packed: list[PackedRow] = []
    for members in by_prompt.values():
        shared = shareable_prefix([sequences[i] for i in members], [masks[i] for i in members])
        current: PackedRow | None = None
        for i in members:
            rest = len(sequences[i]) - shared
            fits = current is not None and (token_budget is None or current.length + rest <= token_budget)
            if fits and cost.joins(current.length, shared, rest):
                current.rows.append(i)
                current.length += rest
            else:
                current = PackedRow([i], shared, shared + rest)
                packed.append(current)
    return packed


def plan_micro_batches(packed: list[PackedRow], token_budget: int) -> list[list[PackedRow]]:
    """Packed rows grouped by length so that each micro-batch's padded tokens (rows × longest) fit
    `token_budget`; a single longer row always runs, alone."""
    plan: list[list[PackedRow]] = []
    current: list[PackedRow] = []
    for row in sorted(packed, key=lambda p: (p.length, p.rows[0])):
        if current and (len(current) + 1) * row.length > token_budget:
            plan.append(current)
            current = []
        current.append(row)
    if current:
        plan.append(current)
    return plan


@dataclass
class PackedInputs:
    """A micro-batch's decoder inputs in the packed layout, and where each row's tokens went."""

    ids_GL: torch.Tensor
    positions_GL: torch.Tensor
    attention_G1LL: torch.Tensor  # bool: query position may attend to key position
    where_BT: torch.Tensor  # flat index into G × L of row b's token t (0 past the row's end)
    segments: SegmentPlan | None  # the same layout for segmented attention


def packed_inputs(micro_batch: list[PackedRow], sequences: list[list[int]], pad_id: int,
                  device: torch.device | str) -> PackedInputs:
    """The layout of `micro_batch`, whose rows (in order, as `idx` lists them) are the batch rows."""
    width = max(p.length for p in micro_batch)
    ids_GL = torch.full((len(micro_batch), width), pad_id, dtype=torch.long)
    positions_GL = torch.zeros((len(micro_batch), width), dtype=torch.long)
    segment_GL = torch.full((len(micro_batch), width), -1, dtype=torch.long)  # -1 padding, 0 prefix, k member k
    rows = [i for p in micro_batch for i in p.rows]
    where_BT = torch.zeros((len(rows), max(len(sequences[i]) for i in rows)), dtype=torch.long)
    b = 0
    for g, packed in enumerate(micro_batch):
        shared = packed.shared
        ids_GL[g, :shared] = torch.tensor(sequences[packed.rows[0]][:shared], dtype=torch.long)
        positions_GL[g, :shared] = torch.arange(shared)
        segment_GL[g, :shared] = 0
        start = shared
        for k, i in enumerate(packed.rows, start=1):
            rest = len(sequences[i]) - shared
            ids_GL[g, start:start + rest] = torch.tensor(sequences[i][shared:], dtype=torch.long)
            positions_GL[g, start:start + rest] = torch.arange(shared, shared + rest)
            segment_GL[g, start:start + rest] = k
            where_BT[b, :shared] = torch.arange(shared) + g * width
            where_BT[b, shared:shared + rest] = torch.arange(start, start + rest) + g * width
            start += rest
            b += 1
    query, key = segment_GL[:, :, None], segment_GL[:, None, :]
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    attention = causal & (query >= 0) & ((key == query) | ((key == 0) & (query > 0)))
    attention |= torch.eye(width, dtype=torch.bool)  # padding sees itself: no softmax over nothing
    return PackedInputs(ids_GL.to(device), positions_GL.to(device), attention[:, None].to(device), where_BT.to(device),
                        segment_layout(micro_batch, sequences, width, device))


def segment_layout(micro_batch: list[PackedRow], sequences: list[list[int]], width: int,
                   device: torch.device | str) -> SegmentPlan | None:
    """The micro-batch's layout for segment_attention: each packed row's prefix (all of a row by
    itself), then its members' own tokens. None (the 4D mask applies) below MIN_SEGMENTED_WIDTH
    columns, or when the three calls would not compute MIN_PAIRS_SAVED times fewer pairs than the
    mask (a long row by itself beside packed rows widens everyone's prompt call)."""
    if width < MIN_SEGMENTED_WIDTH:
        return None
    prompts = [packed.shared or packed.length for packed in micro_batch]
    members = [[len(sequences[i]) - packed.shared for i in packed.rows] if packed.shared else []
               for packed in micro_batch]
    plan = segment_plan(prompts, members, width, device)
    if plan is None or plan.pairs() * MIN_PAIRS_SAVED > len(micro_batch) * width * width:
        return None
    return plan
