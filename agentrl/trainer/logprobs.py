"""Token log-probabilities of a batch of sequences, without the full-vocabulary logits in memory.

The decoder runs once over the padded batch; the output head and log-softmax then run only on the
positions whose next token is wanted (the trainable ones), in chunks of rows, each chunk under
activation checkpointing when gradients are needed. So at most one chunk × vocabulary of logits is
alive at a time, in the forward and in the backward pass (FACTS.md: the full 8×256×49152 logits are
a large part of an 8 GB peak).

Results are aligned with token positions: out[b, t] = log p(token t | tokens < t), 0 where not
wanted, exactly as Trajectory.logprobs stores the engine's values. Models whose logits get extra
processing after the output head (soft-capping, scaling) are not covered by this shortcut.

A GRPO group's episodes start with the same prompt, often most of each sequence (the quickstart:
~250 of ~330 tokens). Micro-batches keep a group's rows together (`prompt_groups`), and a batch
whose rows share a prefix runs the decoder over that prefix once and over each row's remainder
against the prefix's KV cache, repeated along the batch. The result is the same function (the
prefix's keys and values are the ones every row would compute; their gradients sum over the rows),
so only float rounding differs from running every row in full. Two exceptions run every row in
full: a micro-batch whose counterpart on another FSDP rank cannot share (`prefix_sharing`; the
ranks' decoder calls must match), and activation checkpointing in train mode, where transformers'
layers keep no cache.
"""

from __future__ import annotations

import random
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class PaddedBatch:
    ids_BT: torch.Tensor
    attention_BT: torch.Tensor
    mask_BT: torch.Tensor  # float, 1 on trainable tokens
    shared_prefix: int = 0  # leading tokens identical in every row, run through the decoder once

    @property
    def num_tokens(self) -> int:
        return int(self.mask_BT.sum().item())


MIN_SHARED_PREFIX = 16  # below this, a second decoder call costs more than it saves


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


def pad_sequences(sequences: list[list[int]], masks: list[list[int]], pad_id: int, device: str = "cpu",
                  share_prefix: bool = False) -> PaddedBatch:
    width = max(len(s) for s in sequences)
    ids_BT = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_BT = torch.zeros((len(sequences), width), dtype=torch.long)
    mask_BT = torch.zeros((len(sequences), width), dtype=torch.float)
    for row, (seq, mask) in enumerate(zip(sequences, masks)):  # right padding
        ids_BT[row, : len(seq)] = torch.tensor(seq)
        attention_BT[row, : len(seq)] = 1
        mask_BT[row, : len(mask)] = torch.tensor(mask, dtype=torch.float)
    mask_BT[:, 0] = 0.0  # the first token has no context to be predicted from
    shared = shareable_prefix(sequences, masks) if share_prefix else 0
    return PaddedBatch(ids_BT.to(device), attention_BT.to(device), mask_BT.to(device), shared)


def pad_values(rows: list[list[float]], width: int, device: torch.device | str) -> torch.Tensor:
    """Per-token float rows (logprobs, advantages, values) right-padded with 0 to `width`."""
    out = torch.zeros((len(rows), width), dtype=torch.float)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float)
    return out.to(device)


@contextmanager
def evaluation(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) for a pass without gradients, its mode restored after:
    old logprobs, reference logprobs and values must be those of the weights, not of a dropout mask."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def mini_batch_schedule(rng: random.Random, size: int, epochs: int, mini_batches: int) -> Iterator[list[int]]:
    """Indices of each optimizer step: every epoch reshuffles, then deals into `mini_batches` parts."""
    order = list(range(size))
    for _ in range(epochs):
        rng.shuffle(order)
        for part in (order[i::mini_batches] for i in range(mini_batches)):
            if part:
                yield part


def prompt_groups(sequences: list[list[int]], masks: list[list[int]]) -> list[tuple[int, int]]:
    """Per row, (group, shared length): rows whose tokens before their first trainable one are the
    same (a GRPO group's prompt) form a group, and share all but the last of those tokens; a row
    whose prompt no other row has gets a group of its own and 0."""
    keys = [tuple(seq[:first_trainable(mask)]) for seq, mask in zip(sequences, masks)]
    ids: dict[tuple[int, ...], int] = {}
    counts: dict[tuple[int, ...], int] = {}
    for key in keys:
        ids.setdefault(key, len(ids))
        counts[key] = counts.get(key, 0) + 1
    return [(ids[key], max(len(key) - 1, 0) if counts[key] > 1 else 0) for key in keys]


def pack_micro_batches(lengths: list[int], token_budget: int,
                       groups: list[tuple[int, int]] | None = None) -> list[list[int]]:
    """Indices grouped so that each micro-batch's decoder tokens fit `token_budget` (a single long
    row always fits). Without `groups` (see prompt_groups) the cost is rows × longest row; with
    them, rows sharing a prompt are packed together and their prompt counts once:
    shared + rows × (longest − shared), and rows with nothing to share are packed among themselves."""
    if groups is None:
        groups = [(-1 - i, 0) for i in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda i: (groups[i][1] == 0, groups[i][0] if groups[i][1] else 0,
                                                       lengths[i], i))
    packed: list[list[int]] = []
    current: list[int] = []
    for i in order:
        group, shared = groups[i]
        same = bool(current) and shared > 0 and groups[current[0]] == (group, shared)
        cost = shared + (len(current) + 1) * (lengths[i] - shared) if same else (len(current) + 1) * lengths[i]
        alone = shared == 0 and bool(current) and groups[current[0]][1] == 0
        if current and (not (same or alone) or cost > token_budget):
            packed.append(current)
            current = []
        current.append(i)
    if current:
        packed.append(current)
    return packed


def prefix_sharing(plans: list[list[list[int]]], sequences: list[list[int]], masks: list[list[int]]) -> list[bool]:
    """Per micro-batch position of every rank's plan (distributed.Ranks.micro_batch_plans), whether
    to run a shared prefix separately. That takes two decoder calls instead of one, and FSDP's
    collectives need every rank to make the same calls, so it is done only where every rank's
    micro-batch has a prefix to share (never beside a dummy). Every rank has the whole batch, so
    every rank reaches the same answer without communicating."""
    return [all(idx and shareable_prefix([sequences[i] for i in idx], [masks[i] for i in idx]) for idx in column)
            for column in zip(*plans)]


def padded_micro_batches(plan: list[list[int]], sequences: list[list[int]], masks: list[list[int]], pad_id: int,
                         device: torch.device | str, share_prefix: list[bool] | None = None
                         ) -> Iterator[tuple[list[int], PaddedBatch]]:
    """Each planned micro-batch padded: (its indices, the batch), its shared prefix found where
    `share_prefix` (one flag per micro-batch, see prefix_sharing) says so. An empty entry of the plan
    (a rank with fewer micro-batches than another, see distributed.Ranks) yields ([], a two-token
    dummy with one position to predict), which the caller weighs by zero; it keeps FSDP's
    collectives in step."""
    for n, idx in enumerate(plan):
        if idx:
            yield idx, pad_sequences([sequences[i] for i in idx], [masks[i] for i in idx], pad_id, device,
                                     bool(share_prefix and share_prefix[n]))
        else:
            yield [], pad_sequences([[pad_id, pad_id]], [[0, 1]], pad_id, device)


def _head_logprobs(head: torch.nn.Module, hidden_NH: torch.Tensor, targets_N: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits_NV = head(hidden_NH).float()
    if temperature > 0:
        logits_NV = logits_NV / temperature
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(dim=-1)
    return logp_NV.gather(1, targets_N[:, None]).squeeze(1), entropy_N


SHARDED_METHOD = "agentrl_token_logprobs"


def token_logprobs(model: torch.nn.Module, batch: PaddedBatch, temperature: float = 1.0,
                   chunk_rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, entropy_BT) on the batch's mask-1 positions, zeros elsewhere.

    `temperature` must be the sampling temperature, so these match the engine's logprobs.
    Gradients flow when grad mode is on. This path calls the decoder and the output head
    separately, bypassing the model's `forward`; an FSDP2-sharded model carries it as a registered
    forward method instead (`attach_token_logprobs`), so that its root parameters (embeddings, head)
    are gathered and their gradients reduced.
    """
    method = getattr(model, SHARDED_METHOD, None)
    if method is not None:
        return method(batch, temperature, chunk_rows)
    return compute_token_logprobs(model, batch, temperature, chunk_rows)


def attach_token_logprobs(model: torch.nn.Module) -> str:
    """Give the model this computation as a method (to register with FSDP2); returns its name."""
    setattr(model, SHARDED_METHOD, types.MethodType(compute_token_logprobs, model))
    return SHARDED_METHOD


def compute_token_logprobs(model: torch.nn.Module, batch: PaddedBatch, temperature: float = 1.0,
                           chunk_rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    hidden_BTH = _decoder_hidden(model, batch)
    head = model.get_output_embeddings()
    want_BT = batch.mask_BT[:, 1:] > 0  # token t+1 is predicted from position t
    hidden_NH = hidden_BTH[:, :-1][want_BT]
    targets_N = batch.ids_BT[:, 1:][want_BT]
    logps, entropies = [], []
    for start in range(0, hidden_NH.shape[0], chunk_rows):
        args = (head, hidden_NH[start:start + chunk_rows], targets_N[start:start + chunk_rows], temperature)
        if torch.is_grad_enabled():
            logp_N, entropy_N = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            logp_N, entropy_N = _head_logprobs(*args)
        logps.append(logp_N)
        entropies.append(entropy_N)
    logprobs_BT = torch.zeros(batch.mask_BT.shape, dtype=torch.float, device=hidden_BTH.device)
    entropy_BT = torch.zeros_like(logprobs_BT)
    if logps:
        full_want_BT = torch.zeros_like(batch.mask_BT, dtype=torch.bool)
        full_want_BT[:, 1:] = want_BT
        logprobs_BT = logprobs_BT.masked_scatter(full_want_BT, torch.cat(logps))
        entropy_BT = entropy_BT.masked_scatter(full_want_BT, torch.cat(entropies))
    return logprobs_BT, entropy_BT


def _decoder_hidden(model: torch.nn.Module, batch: PaddedBatch) -> torch.Tensor:
    """The decoder's last hidden states, [B, T, H]; a shared prefix runs once (module docstring)."""
    decoder = model.get_decoder()
    shared = batch.shared_prefix
    if not shared or _layers_drop_cache(decoder):
        return decoder(input_ids=batch.ids_BT, attention_mask=batch.attention_BT, use_cache=False).last_hidden_state
    rows = batch.ids_BT.shape[0]
    # One lookup for both calls: the embedding's backward builds a dense vocabulary × hidden
    # gradient per lookup (113 MB for SmolLM2, 0.1-0.15 s to fill on a 2-core CPU).
    embeds_BTH = model.get_input_embeddings()(batch.ids_BT)
    prefix = decoder(inputs_embeds=embeds_BTH[:1, :shared], use_cache=True)
    cache = prefix.past_key_values
    cache.batch_repeat_interleave(rows)  # differentiable: each row's gradient reaches the prefix
    rest = decoder(inputs_embeds=embeds_BTH[:, shared:], attention_mask=batch.attention_BT, past_key_values=cache,
                   use_cache=True).last_hidden_state
    return torch.cat([prefix.last_hidden_state.expand(rows, -1, -1), rest], dim=1)


def _layers_drop_cache(decoder: torch.nn.Module) -> bool:
    """Under activation checkpointing in train mode, transformers' layers neither fill nor read a
    KV cache (a recomputed layer would write it twice), so a prefix cannot be run separately. The
    answer depends on the model's state alone, the same on every rank."""
    return decoder.training and any(getattr(m, "gradient_checkpointing", False) for m in decoder.modules())
