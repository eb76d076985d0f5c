"""The transformers engine's prefix KV cache: an episode's keys and values kept between its turns.

Every request leaves an entry when it stops: the token ids the model has seen (prompt plus every
sampled token but the last, which was never fed back) and their keys and values (copies, all
layers stacked in one tensor so that a row moves in one copy, accounted by tensor bytes). The
engine reuses only entries a request's computation does not depend on the timing of (`reusable`):
the longest entry the request extends (its episode's previous turn, so the next turn prefills only
the tool or user output and the generation prompt; the extended entry is then dropped), or an
entry holding all of the request's tokens but the last (a GRPO group's shared prompt, which the
engine computes once and stores, see hf_engine). Prompts of different tasks share their first chat
message (the system prompt and the tool schemas, often most of a first prompt): `plan_reuse`
computes that message in a pass of its own, split where the prompt's own tokens say (after the
first message-end token), and keeps it as a shared entry, so every later prompt that starts with
it computes only the rest. Entries are evicted least recently used first once their bytes pass
the budget; a miss simply prefills everything again. A weight update drops every entry.

The running batch (running_batch.py) copies a hit's keys and values into the row's slot; `plan_reuse`
sets the hits of the rows about to join it.

Why not transformers' own: its caches hold one batch for one `generate` call, with no notion of
entries that outlive it. This module is not a radix tree (a shared first message is computed once
but also stored inside every whole prompt's entry, and siblings store their shared prompt once each)
and not paged memory; it holds models whose every layer is a plain `DynamicLayer` (no sliding
windows, no linear attention) caching keys and values of the config's shape (`check_cache_layout`),
the only ones the transformers engine decodes.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from agentrl.errors import ConfigError
from agentrl.models import plain_attention_layers

KV = tuple[torch.Tensor, torch.Tensor]  # keys and values of every layer, each (layers, kv_heads, tokens, head_dim)


@dataclass
class CacheEntry:
    ids_T: torch.Tensor  # int64, on the CPU: the tokens whose keys and values are held
    kv: KV
    nbytes: int
    shared: bool = False  # a first message, reused only by `plan_reuse`'s split (`shared_prefix`)
    weights: int = 0  # the oldest of the cache's `weights` its keys and values were computed under


@dataclass
class Hit:
    """What a request reuses: `length` leading tokens of `entry` (0: nothing)."""

    entry: CacheEntry | None = None
    key: int = -1
    length: int = 0
    covers_entry: bool = False  # the entry is a prefix of the request: its successor replaces it
    weights: int = 0  # the entry's `weights`: what an entry stored after reusing this hit holds keys from


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword that hands a model its KV cache: `cache` from transformers 5.24 on (which
    still takes `past_key_values`, warning that 5.40 will not), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out) -> DynamicCache:
    """The KV cache a forward pass returned, under either name (see cache_keyword)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def kv_layout(config) -> tuple[int, int]:
    """(key/value heads, head size) of every layer's cached keys and values, as the running batch
    lays out its buffers, from the model's config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_cache_layout(model: torch.nn.Module) -> None:
    """ConfigError unless every layer of `model` caches plain keys and values of `kv_layout`'s
    shape: not sliding windows or linear attention (by the config's cache layers), and not another
    shape (checked on a 2-token forward pass: e.g. multi-head latent attention, whose keys and
    values have head sizes of their own)."""
    name = type(model).__name__
    others = plain_attention_layers(model.config)
    if others:
        raise ConfigError(f"engine 'hf' decodes models whose attention layers all keep every key; "
                          f"{name} has {', '.join(sorted(others))} layers. Use engine.name=sglang")
    device = next(model.parameters()).device
    with torch.no_grad():
        cache = returned_cache(model(input_ids=torch.tensor([[1, 2]], device=device), use_cache=True, logits_to_keep=1))
    heads, dim = kv_layout(model.config)
    shapes = {f"{kind} {tuple(t.shape[1:])}" for layer in cache.layers
              for kind, t in (("keys", layer.keys), ("values", layer.values)) if tuple(t.shape[1:]) != (heads, 2, dim)}
    if shapes:
        raise ConfigError(f"engine 'hf' decodes models that cache {heads} key/value heads of size {dim} per layer "
                          f"(from the config); {name} caches {', '.join(sorted(shapes))} (heads, tokens, size) "
                          f"for 2 tokens. Use engine.name=sglang")


class PrefixKVCache:
    """Entries keyed by token-id sequence, least recently used evicted first beyond `budget_bytes`."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.weights = 0  # counts weight updates that kept the entries (`flush_cache=False`)
        self.bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def reusable(self, ids: list[int]) -> Hit:
        """What the engine may reuse for `ids`: the longest entry that is a prefix of them (its
        length, at most len(ids) - 1), else an entry whose first len(ids) - 1 tokens are ids[:-1];
        nothing otherwise. A partial match with another episode's tokens is not reused: whether it
        exists depends on timing, and a prompt split at a different point rounds differently. Shared
        first messages are skipped: only `plan_reuse`'s split, always at the same point, loads them."""
        if not self._entries or len(ids) < 2:
            return Hit()
        ids_T = torch.tensor(ids)
        extended: tuple[int, CacheEntry] | None = None
        whole: tuple[int, CacheEntry] | None = None
        for key, entry in self._entries.items():
            n = len(entry.ids_T)
            if entry.shared:
                continue
            if n <= len(ids) and (extended is None or n > len(extended[1].ids_T)) and torch.equal(entry.ids_T, ids_T[:n]):
                extended = key, entry
            elif whole is None and n >= len(ids) - 1 and torch.equal(entry.ids_T[:len(ids) - 1], ids_T[:-1]):
                whole = key, entry
        if extended is not None:
            key, entry = extended
            hit = Hit(entry, key, min(len(entry.ids_T), len(ids) - 1), covers_entry=True, weights=entry.weights)
        elif whole is not None:
            key, entry = whole
            hit = Hit(entry, key, len(ids) - 1, weights=entry.weights)
        else:
            return Hit()
        self._entries.move_to_end(key)
        return hit

    def shared_prefix(self, ids: list[int]) -> CacheEntry | None:
        """The shared entry holding exactly `ids` (a first message), if kept."""
        ids_T = torch.tensor(ids)
        for key, entry in self._entries.items():
            if entry.shared and len(entry.ids_T) == len(ids) and torch.equal(entry.ids_T, ids_T):
                self._entries.move_to_end(key)
                return entry
        return None

    def store(self, ids: list[int], kv: KV, replaces: int | None = None, shared: bool = False,
              weights: int | None = None) -> None:
        """Add an entry (dropping `replaces`, an entry it extends), then evict down to the budget.
        An entry larger than the whole budget is not kept. `weights`: the oldest weights its keys
        and values come from, when some were reused (default: the current ones)."""
        nbytes = sum(t.numel() * t.element_size() for t in kv) + 8 * len(ids)
        if nbytes > self.budget_bytes:
            return
        if replaces is not None and replaces in self._entries:
            self.bytes -= self._entries.pop(replaces).nbytes
        self._entries[self._next_key] = CacheEntry(torch.tensor(ids), kv, nbytes, shared,
                                                   self.weights if weights is None else weights)
        self._next_key += 1
        self.bytes += nbytes
        while self.bytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1


MIN_SHARED_TOKENS = 64  # a shorter first message costs less to recompute than a pass of its own


def split_point(prefix: list[int], message_end_ids: frozenset[int]) -> int:
    """Where a prefix pass splits `prefix`: after its first message-end token, when that message is
    at least MIN_SHARED_TOKENS long and tokens follow it; 0 (no split) otherwise. It depends on the
    prompt's own tokens only, so a prompt is split at the same point whoever computed its message."""
    end = next((i + 1 for i, token in enumerate(prefix) if token in message_end_ids), 0)
    return end if MIN_SHARED_TOKENS <= end < len(prefix) else 0


def plan_reuse(cache: PrefixKVCache, model: torch.nn.Module, rows: list,
               message_end_ids: frozenset[int] = frozenset()) -> int:
    """Set each row's cache `hit` (rows: the running batch's `Row`s) so that how a request is
    computed never depends on which other requests came first or arrived with it (that changes
    float rounding, and a resumed or rescheduled run must sample the same tokens): rows reuse only
    what `reusable` allows. A row with nothing to reuse first computes all its tokens but the last
    alone (batch 1, no padding) and stores them, so the rows of a GRPO group, which share their
    prompt, compute it once whether they arrive together or not. That prefix pass is split after
    the prompt's first message (`split_point`), whose keys and values are kept as a shared entry:
    the message is computed the same way whether this row or an earlier one with the same message
    computed it, and only once. A first message no other prompt shares costs one more pass and an
    entry nobody reuses. A prefix too large for the whole budget is not kept, and its row alone
    reuses what its pass computed (it used to compute it all again when it joined), as do the rows
    after it with the same prompt. Returns the tokens of the rows' hits that these passes computed."""
    for row in rows:
        row.hit = cache.reusable(row.prompt)
    if cache.budget_bytes == 0:
        return 0
    computed = 0
    unkept: dict[tuple[int, ...], Hit] = {}  # prefixes over the whole budget, computed in this call
    for row in rows:
        if row.hit.length or len(row.prompt) < 2:
            continue
        row.hit = cache.reusable(row.prompt)  # a row before it may have stored it
        if not row.hit.length and tuple(row.prompt) in unkept:
            row.hit = replace(unkept[tuple(row.prompt)])  # its own: placing a row lets go of its hit's entry
        elif not row.hit.length:
            prefix = row.prompt[:-1]
            split = split_point(prefix, message_end_ids)
            first = cache.shared_prefix(prefix[:split]) if split else None
            past = first.kv if first is not None else None
            if split and first is None:
                past = prefix_pass(model, prefix[:split], None)
                cache.store(prefix[:split], past, shared=True)
            kv = prefix_pass(model, prefix[split:], past)
            weights = first.weights if first is not None else cache.weights
            cache.store(prefix, kv, weights=weights)
            row.hit = cache.reusable(row.prompt)
            if not row.hit.length:  # over the whole budget, so not kept
                entry = CacheEntry(torch.tensor(prefix), kv, 0, weights=weights)
                row.hit = unkept[tuple(row.prompt)] = Hit(entry, length=len(prefix), weights=weights)
            computed += len(prefix) - (split if first is not None else 0)
    return computed


def split_copies(rows: list) -> tuple[list, list[tuple[int, object]]]:
    """Rows about to join (their hits set by `plan_reuse`), split into the rows that compute and
    the copies: rows with the same prompt as an earlier row, reusing as many of its tokens' keys
    and values computed by the same weights. A GRPO group's episodes often sample the same tool
    call, get the same tool output and come back with the same next prompt; a copy takes its row's
    keys, values and next-token logits instead of computing them again (`RunningBatch.copy_rows`)
    and draws its own token from them. Two such rows' reused keys and values are one computation
    done in different batch slots: they differ at most by the rounding that the batch a row is
    decoded in already gives every row's numbers (about 1e-7 in float32, bf16's own rounding in
    bf16). Returns (computing rows, [(index of the computing row a copy takes after, copy)])."""
    computing: list = []
    copies: list[tuple[int, object]] = []
    first: dict[tuple[int, ...], int] = {}
    for row in rows:
        key = tuple(row.prompt)
        i = first.get(key)
        if i is not None and _same_reuse(computing[i].hit, row.hit):
            copies.append((i, row))
            continue
        first.setdefault(key, len(computing))
        computing.append(row)
    return computing, copies


def _same_reuse(a: Hit, b: Hit) -> bool:
    """Whether two hits of one prompt reuse its first tokens' keys and values from the same weights
    (a hit's tokens are the prompt's: only the length and the weights can differ)."""
    return a.length == b.length and a.weights == b.weights


def prefix_pass(model: torch.nn.Module, ids: list[int], past: KV | None) -> KV:
    """Keys and values of every layer for `past`'s tokens followed by `ids`, computed at batch 1."""
    cache = DynamicCache()
    if past is not None:  # a computed first message goes through here too: the same tensors either way
        for layer, (keys, values) in enumerate(zip(*past)):
            cache.update(keys[None], values[None], layer)
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1,
                **{cache_keyword(model): cache})
    layers = returned_cache(out).layers
    return torch.stack([layer.keys[0] for layer in layers]), torch.stack([layer.values[0] for layer in layers])
