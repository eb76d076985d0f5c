"""The transformers engine: batches the generate calls of many concurrent episodes.

Episodes call `await engine.generate(ids, sampling)` independently; a single server task gathers the
requests waiting at that moment (same sampling settings), runs one left-padded, KV-cached decode for
all of them in a worker thread, and resolves each caller with its own tokens. While a batch decodes,
the event loop keeps running tools, and requests that arrive meanwhile form the next batch.

The decode loop is written here instead of calling `model.generate` because the loop needs per-row
stop tokens and token budgets, and the sampled tokens' logprobs without keeping every step's full
vocabulary logits (`output_logits` would hold steps × batch × vocab floats). transformers'
continuous batching was measured slower than padded decoding on CPU (FACTS.md). This engine keeps no
KV cache between calls, so a weight update has nothing to flush.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Iterable

import torch
from transformers import DynamicCache

from agentrl.rollout.memory_saver import TAGS, MemorySaver
from agentrl.types import Completion, SamplingParams


@dataclass
class _Request:
    token_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future


def sample_tokens(logits_BV: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids and their logprobs under softmax(logits / temperature), before top-p.

    Temperature 0 is greedy, with logprobs of the unscaled distribution. The logprob reported is
    of the distribution the trainer recomputes, so top-p truncation is not reflected in it.
    """
    logits_BV = logits_BV.float()
    if temperature <= 0:
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        ids_B = logp_BV.argmax(dim=-1)
    else:
        logp_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
        probs_BV = logp_BV.exp()
        if top_p < 1.0:
            sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
            outside_BV = sorted_BV.cumsum(dim=-1) - sorted_BV > top_p  # keeps at least the top token
            probs_BV = torch.zeros_like(probs_BV).scatter(1, order_BV, sorted_BV.masked_fill(outside_BV, 0.0))
        ids_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return ids_B, logp_BV.gather(1, ids_B[:, None]).squeeze(1)


class HFEngine:
    """A transformers causal LM behind the Engine protocol."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, max_batch_size: int = 32,
                 batch_wait_s: float = 0.002, seed: int = 0, memory_saver: MemorySaver | None = None):
        self.model = model.eval()  # on CUDA, moved there inside memory_saver.region("weights")
        self.memory_saver = memory_saver or MemorySaver()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s  # how long a new batch waits for episodes about to ask
        self.weight_version = 0
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0}
        self._pending: list[_Request] = []
        self._server: asyncio.Task | None = None
        self._lock = threading.Lock()  # decoding and weight updates never overlap

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        if not token_ids:
            raise ValueError("generate needs at least one prompt token")
        loop = asyncio.get_running_loop()
        request = _Request(list(token_ids), sampling, loop.create_future())
        self._pending.append(request)
        if self._server is None or self._server.done():
            self._server = loop.create_task(self._serve())
        return await request.future

    async def _serve(self) -> None:
        while self._pending:
            await asyncio.sleep(self.batch_wait_s)
            batch = self._take_batch()
            try:
                results = await asyncio.to_thread(
                    self.generate_batch, [r.token_ids for r in batch], [r.sampling for r in batch])
            except Exception as e:  # the callers decide what a failed generation means
                results = [e] * len(batch)
            for request, result in zip(batch, results):
                if request.future.done():  # the caller was cancelled
                    continue
                if isinstance(result, Exception):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)

    def _take_batch(self) -> list[_Request]:
        key = self._pending[0].sampling.batch_key()
        batch = [r for r in self._pending if r.sampling.batch_key() == key][: self.max_batch_size]
        taken = {id(r) for r in batch}
        self._pending = [r for r in self._pending if id(r) not in taken]
        return batch

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[Completion]:
        """Synchronous batched sampling; every request must share `sampling[0].batch_key()`."""
        with self._lock, self.memory_saver.region("kv_cache"):  # the KV cache and activations
            return self._decode(prompts, sampling)

    def _decode(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[Completion]:
        batch, width = len(prompts), max(len(p) for p in prompts)
        ids_BT = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask_BT = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding keeps every row's last token aligned
            ids_BT[row, width - len(prompt):] = torch.tensor(prompt)
            mask_BT[row, width - len(prompt):] = 1
        ids_BT, mask_BT = ids_BT.to(self.device), mask_BT.to(self.device)
        positions_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        temperature, top_p = sampling[0].temperature, sampling[0].top_p
        stops = [set(s.stop_token_ids) for s in sampling]
        budgets = [s.max_new_tokens for s in sampling]
        new_ids: list[list[int]] = [[] for _ in prompts]
        new_logprobs: list[list[float]] = [[] for _ in prompts]
        finish = ["length"] * batch
        done = [b <= 0 for b in budgets]
        out = self.model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=positions_BT,
                         past_key_values=DynamicCache(config=self.model.config), use_cache=True, logits_to_keep=1)
        next_pos_B = positions_BT[:, -1] + 1
        while not all(done):
            tok_B, logp_B = sample_tokens(out.logits[:, -1, :], temperature, top_p, self.generator)
            for row, (tok, logp) in enumerate(zip(tok_B.tolist(), logp_B.tolist())):
                if done[row]:
                    continue
                new_ids[row].append(tok)
                new_logprobs[row].append(logp)
                if tok in stops[row]:
                    done[row], finish[row] = True, "stop"
                elif len(new_ids[row]) >= budgets[row]:
                    done[row] = True
            if all(done):
                break
            mask_BT = torch.cat([mask_BT, mask_BT.new_ones((batch, 1))], dim=1)
            out = self.model(input_ids=tok_B[:, None], attention_mask=mask_BT, position_ids=next_pos_B[:, None],
                             past_key_values=out.past_key_values, use_cache=True)
            next_pos_B = next_pos_B + 1
        self.stats["batches"] += 1
        self.stats["requests"] += batch
        self.stats["generated_tokens"] += sum(len(t) for t in new_ids)
        return [Completion(ids, lps, fin, self.weight_version)  # type: ignore[arg-type]
                for ids, lps, fin in zip(new_ids, new_logprobs, finish)]

    @torch.no_grad()
    def score(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(token t | tokens < t) for t ≥ start, under softmax(logits / temperature)."""
        if not 1 <= start < len(token_ids):
            raise ValueError(f"score: start must be in [1, {len(token_ids)}), got {start}")
        with self._lock:
            ids_1T = torch.tensor([token_ids], device=self.device)
            logits_TV = self.model(input_ids=ids_1T).logits[0, start - 1:-1].float()
        if temperature > 0:
            logits_TV = logits_TV / temperature
        return torch.log_softmax(logits_TV, dim=-1).gather(1, ids_1T[0, start:, None]).squeeze(1).tolist()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush_cache: bool = True) -> None:
        """Copy tensors into the model in place (names as in `state_dict()`)."""
        with self._lock:
            targets = self.model.state_dict()  # shares storage with the live parameters
            for name, tensor in named_tensors:
                if name not in targets:
                    raise KeyError(f"update_weights: the engine's model has no tensor '{name}'")
                if targets[name].shape != tensor.shape:
                    raise ValueError(f"update_weights: '{name}' has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(targets[name].shape)}")
                targets[name].copy_(tensor)
            self.weight_version = version

    def release_memory(self) -> None:
        for tag in reversed(TAGS):
            self.memory_saver.pause(tag)

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        for tag in TAGS if tags is None else [t for t in TAGS if t in tags]:
            self.memory_saver.resume(tag)
