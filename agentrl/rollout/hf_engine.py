"""The transformers engine: batches the generate calls of many concurrent episodes.

Episodes call `await engine.generate(ids, sampling)` independently; a worker thread gathers the
requests waiting at that moment (same sampling settings; pending.py queues them) and decodes them together, left-padded and
KV-cached. The batch keeps running: a row that stops leaves it at once and its caller gets its
tokens, and requests with the same settings that arrive meanwhile (episodes back from their tools)
join it at the next step (running_batch.py), so no episode waits for the slowest row of a batch;
their new tokens go through the running rows' next decode step, packed into one forward pass
(packed_attention.py). The event loop keeps running tools throughout.

The decode loop is written here instead of calling `model.generate` because it needs per-row stop
tokens and token budgets, rows joining and leaving mid-decode, and the sampled tokens' logprobs
without keeping every step's full vocabulary logits (`output_logits` would hold steps × batch ×
vocab floats). transformers' own continuous batching (paged attention) was measured slower than
padded decoding on CPU (FACTS.md), so the running batch stays padded. Between calls the engine keeps
each request's keys and values in a prefix cache (kv_cache.py), so an episode's next turn prefills
only its new tokens, and prompts that open with the same message of at least 64 tokens (a system
prompt with tool schemas; `message_end_ids` says where a chat message ends) compute it once.
Requests joining together that would compute the same (a group's episodes back from the same tool
call with the same next prompt) compute it once: the others join as copies and draw their own
tokens from it (kv_cache.split_copies). A weight update with `flush_cache` drops that cache.
Models with sliding-window or linear-attention layers are refused at construction: neither the
running batch's slots nor the prefix cache represent keys a layer drops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Iterable

import torch

from agentrl.rollout.kv_cache import PrefixKVCache, cache_keyword, check_cache_layout, plan_reuse, split_copies
from agentrl.rollout.running_batch import Row, RunningBatch
from agentrl.rollout.sampling import sample_tokens
from agentrl.rollout.memory_saver import TAGS, MemorySaver
from agentrl.rollout.pending import PendingRequests, Request, check_request, deliver
from agentrl.rollout.packed_attention import install, packed
from agentrl.types import Completion, SamplingParams

DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


class HFEngine:
    """A transformers causal LM behind the Engine protocol."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, max_batch_size: int = 32,
                 batch_wait_s: float = 0.002, seed: int = 0, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                 memory_saver: MemorySaver | None = None, message_end_ids: Iterable[int] = ()):
        self.model = model.eval()  # on CUDA, moved there inside memory_saver.region("weights")
        self.memory_saver = memory_saver or MemorySaver()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s  # how long a new batch waits for episodes about to ask
        self.weight_version = 0
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0,
                      "joined_requests": 0, "copied_requests": 0, "kv_cache_bytes": 0, "kv_cache_evictions": 0}
        check_cache_layout(model)  # the running batch and the prefix cache hold plain per-layer keys and values
        self.prefix_cache = PrefixKVCache(kv_cache_bytes)  # 0 bytes turns prefix reuse off
        self.message_end_ids = frozenset(message_end_ids)  # a prompt's first message is shared (kv_cache.py)
        self.cache_keyword = cache_keyword(model)
        self.mixed_passes = install(model)  # rows join running ones in one packed pass (SDPA models)
        self._pending = PendingRequests()  # the event loop adds requests, the decode thread takes them
        self._lock = threading.Lock()  # decoding, weight updates and memory release never overlap
        self._released: set[str] = set()  # memory tags paused by release_memory and not resumed yet
        self._closed = False

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        if self._closed:
            raise RuntimeError("HFEngine.generate: the engine is closed")
        check_request(self.model, token_ids, sampling)
        loop = asyncio.get_running_loop()
        request = Request(list(token_ids), sampling, loop.create_future())
        if self._pending.add(request, loop):
            # Started once this turn of the loop is over, so that the requests its other tasks make
            # meanwhile (a group of episodes starting together) queue first and decode as one batch:
            # how requests batch decides the order they draw from the sampling RNG.
            loop.call_soon(self._start_decode_thread)
        return await request.future

    def _start_decode_thread(self) -> None:
        """A thread of its own, not the loop's executor: tool calls that timed out keep their
        executor slots, and a decode queued behind them would leave every request waiting. Not a
        daemon: the interpreter waits for it at exit (it stops once no request waits), since a
        process that exits while it is still inside torch can abort in torch's C++ teardown."""
        self._pending.starting()
        try:
            threading.Thread(target=self._serve, name="agentrl-decode").start()
        except Exception as e:  # no thread: every waiting request fails, and the next one asks again
            for waiting in self._pending.abandon():
                deliver(waiting.future, e)

    def _serve(self) -> None:
        """The decode thread: one running batch after another until no request waits."""
        try:
            if self.device.type == "cuda":  # a new thread starts on device 0, whatever the engine's is
                torch.cuda.set_device(self.device)
            while self._serve_one():
                pass
        except BaseException:  # something unforeseen broke: the next request starts a new thread
            self._pending.stopped()
            raise

    @property
    def serving(self) -> bool:
        """Whether a decode thread is running (it stops once no request waits)."""
        return self._pending.serving

    def wait_idle(self, timeout_s: float | None = 30.0) -> bool:
        """Block until the decode thread has stopped; False on timeout. The rollout calls this before
        returning, so that a rollout's end is the engine's (the thread may still be tidying the
        batch after its last result)."""
        return self._pending.wait_idle(timeout_s)

    def _serve_one(self) -> bool:
        """One running batch, from the oldest waiting request's settings; False when none waits."""
        time.sleep(self.batch_wait_s)  # episodes about to ask join the first step
        key = self._pending.next_key()
        if key is None:
            return False
        rows: list[Row] = []
        settled: set[int] = set()

        def admit(room: int) -> list[Row]:
            new = []
            for request in self._pending.take(key, room):
                try:  # a request whose row cannot be made fails alone, not the batch it would join
                    new.append(Row(request.token_ids, request.sampling, owner=request))
                except Exception as e:
                    deliver(request.future, e)
            rows.extend(new)
            return new

        def settle(row: Row, result: Completion | Exception) -> None:
            settled.add(id(row))
            deliver(row.owner.future, result)

        try:
            # The KV cache and activations are allocated in the region release_memory frees.
            with self._lock, torch.no_grad(), self.memory_saver.region("kv_cache"):
                self._decode(admit(self.max_batch_size), lambda row: settle(row, self._completion(row)), admit)
        except Exception as e:  # the callers decide what a failed generation means
            for row in rows:
                if id(row) not in settled:
                    settle(row, e)
        return True

    def _completion(self, row: Row) -> Completion:
        return Completion(row.ids, row.logprobs, row.finish, self.weight_version)  # type: ignore[arg-type]

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[Completion]:
        """Synchronous batched sampling; every request must share `sampling[0].batch_key()`."""
        results: list[Completion | None] = [None] * len(prompts)

        def done(row: Row) -> None:
            results[row.owner] = self._completion(row)

        with self._lock, self.memory_saver.region("kv_cache"):
            self._decode([Row(p, s, owner=i) for i, (p, s) in enumerate(zip(prompts, sampling))], done)
        return results  # type: ignore[return-value]

    def _decode(self, rows: list[Row], done: Callable[[Row], None],
                admit: Callable[[int], list[Row]] | None = None) -> None:
        """Decode `rows`, and those `admit` hands over while they run, until every one stopped."""
        self._check_resident("generate", TAGS)
        batch = RunningBatch(self.model.config, self.pad_token_id, self.device, next(self.model.parameters()).dtype,
                             max_rows=max(self.max_batch_size, len(rows)), cache_keyword=self.cache_keyword)
        incoming = rows
        while incoming or len(batch):
            self._retire(batch, done)
            if incoming and len(batch) and self.mixed_passes:
                self._mixed(batch, incoming)
            else:
                if incoming:
                    self._prefill(batch, incoming)
                    self._retire(batch, done)
                if len(batch):
                    self._step(batch)
            room = self.max_batch_size - len(batch)
            incoming = admit(room) if admit and room > 0 else []
            if len(batch):
                self.stats["joined_requests"] += len(incoming)

    def _prefill(self, batch: RunningBatch, rows: list[Row]) -> None:
        """New rows' uncached tokens in one forward pass, their first token sampled, then they join."""
        computed, rows, copies = self._plan(rows)
        n = len(batch)
        out = self.model(**batch.join_inputs(rows), logits_to_keep=1)
        tokens_B = self._sample_with_copies(rows, out.logits[:, -1, :], copies, 0)
        batch.joined(tokens_B[:len(rows)])
        self._join_copies(batch, n, rows, copies, tokens_B, computed)

    def _mixed(self, batch: RunningBatch, rows: list[Row]) -> None:
        """The running rows' next token and the new rows' uncached tokens in one packed forward
        pass (packed_attention.py), the new rows' first token sampled; then they run too."""
        computed, rows, copies = self._plan(rows)
        n = len(batch)
        inputs, plan = batch.mixed_inputs(rows)
        with packed(plan):
            out = self.model(**inputs)
        tokens_B = self._sample_with_copies(batch.rows + rows, out.logits[0], copies, n)
        batch.mixed_done(tokens_B[:n + len(rows)])
        self._join_copies(batch, n, rows, copies, tokens_B, computed)

    def _plan(self, rows: list[Row]) -> tuple[int, list[Row], list[tuple[int, Row]]]:
        """What joining rows reuse (kv_cache.plan_reuse), and which of them are copies of another
        (kv_cache.split_copies; not with prefix reuse off): (tokens the prefix passes computed,
        rows that compute, copies)."""
        computed = plan_reuse(self.prefix_cache, self.model, rows, self.message_end_ids)
        if self.prefix_cache.budget_bytes == 0:
            return computed, rows, []
        computing, copies = split_copies(rows)
        return computed, computing, copies

    def _sample_with_copies(self, rows: list[Row], logits_BV: torch.Tensor, copies: list[tuple[int, Row]],
                            offset: int) -> torch.Tensor:
        """Tokens for `rows` (their logits) and then for each copy, from the logits of the joining row
        it copies (at `offset` + its index): one draw for all, in slot order."""
        if copies:
            sources = torch.tensor([offset + i for i, _ in copies], device=logits_BV.device)
            logits_BV = torch.cat([logits_BV, logits_BV[sources]])
            rows = rows + [row for _, row in copies]
        return self._sample(rows, logits_BV)

    def _join_copies(self, batch: RunningBatch, n: int, rows: list[Row], copies: list[tuple[int, Row]],
                     tokens_B: torch.Tensor, computed: int) -> None:
        """The copies join after the rows they copy (now at n + index), then the join is counted: a
        copy's tokens count as reused, like a cache hit's."""
        if copies:
            batch.copy_rows([n + i for i, _ in copies], [row for _, row in copies], tokens_B[-len(copies):])
        everyone = rows + [row for _, row in copies]
        self.stats["batches"] += 1
        self.stats["requests"] += len(everyone)
        self.stats["copied_requests"] += len(copies)
        prefilled = sum(len(r.prompt) - r.hit.length for r in rows) + computed
        self.stats["prefill_tokens"] += prefilled
        self.stats["cached_tokens"] += sum(len(r.prompt) for r in everyone) - prefilled

    def _step(self, batch: RunningBatch) -> None:
        """One token for every running row."""
        out = self.model(**batch.step_inputs())
        batch.tokens_B = self._sample(batch.rows, out.logits[:, -1, :])

    def _sample(self, rows: list[Row], logits_BV: torch.Tensor) -> torch.Tensor:
        sampling = rows[0].sampling
        tokens_B, logp_B = sample_tokens(logits_BV, sampling.temperature, sampling.top_p, self.generator,
                                         [row.generator for row in rows])
        for row, token, logp in zip(rows, tokens_B.tolist(), logp_B.tolist()):
            if row.sampling.max_new_tokens <= 0:
                row.done = True
            elif not row.done:
                row.take(token, logp)
        return tokens_B

    def _retire(self, batch: RunningBatch, done: Callable[[Row], None]) -> None:
        """Rows that stopped leave the batch: their keys and values go to the prefix cache, their
        result to the caller. A row whose caller was cancelled (an HTTP client that hung up) stops too."""
        for row in batch.rows:
            if isinstance(row.owner, Request) and row.owner.future.cancelled():
                row.done = True
        finished = [row for row in batch.rows if row.done]
        if not finished:
            return
        for i, row in enumerate(batch.rows):
            if row.done and self.prefix_cache.budget_bytes > 0:
                self.prefix_cache.store(row.fed_ids(), batch.row_kv(i),
                                        replaces=row.hit.key if row.hit.covers_entry else None,
                                        weights=row.hit.weights if row.hit.length else None)
        batch.keep([i for i, row in enumerate(batch.rows) if not row.done])
        self.stats["kv_cache_bytes"] = self.prefix_cache.bytes
        self.stats["kv_cache_evictions"] = self.prefix_cache.evictions
        # Callers hear last, after the copies: each result wakes an episode's own work (parsing,
        # tools, the next prompt) in the event loop's thread, which would otherwise share the CPU with them.
        for row in finished:
            self.stats["generated_tokens"] += len(row.ids)
            done(row)

    @torch.no_grad()
    def score(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(token t | tokens < t) for t ≥ start, under softmax(logits / temperature)."""
        if not 1 <= start < len(token_ids):
            raise ValueError(f"score: start must be in [1, {len(token_ids)}), got {start}")
        with self._lock:
            self._check_resident("score", ("weights",))
            ids_1T = torch.tensor([token_ids], device=self.device)
            logits_TV = self.model(input_ids=ids_1T).logits[0, start - 1:-1].float()
        if temperature > 0:
            logits_TV = logits_TV / temperature
        return torch.log_softmax(logits_TV, dim=-1).gather(1, ids_1T[0, start:, None]).squeeze(1).tolist()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush_cache: bool = True) -> None:
        """Copy tensors into the model in place (names as in `state_dict()`). `flush_cache` drops the
        prefix cache, whose keys and values the old weights computed; without it they are reused."""
        with self._lock:
            self._check_resident("update_weights", ("weights",))
            targets = self.model.state_dict()  # shares storage with the live parameters
            named_tensors = list(named_tensors)  # all checked before any is copied: no half-updated model
            for name, tensor in named_tensors:  # (a sync sends one call per bucket: earlier ones stay applied)
                if name not in targets:
                    raise KeyError(f"update_weights: the engine's model has no tensor '{name}'; "
                                   f"none of this call's tensors were copied")
                if targets[name].shape != tensor.shape:
                    raise ValueError(f"update_weights: '{name}' has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(targets[name].shape)}; none of this call's tensors were copied")
            if flush_cache:
                self.prefix_cache.clear()
                self.stats["kv_cache_bytes"] = 0
            else:  # kept entries are reused, but never taken for what the new weights compute
                self.prefix_cache.weights += 1
            for name, tensor in named_tensors:
                targets[name].copy_(tensor)
            self.weight_version = version

    def release_memory(self) -> None:
        """Hand back the KV cache's and the weights' memory (on CUDA with torch-memory-saver), under
        the lock: a decode still running finishes first, and none starts until `resume_memory`."""
        with self._lock:  # the prefix cache's tensors live in the released region: drop them first
            self.prefix_cache.clear()
            self.stats["kv_cache_bytes"] = 0
            for tag in reversed(TAGS):
                self.memory_saver.pause(tag)
                self._released.add(tag)

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        unknown = set(tags or ()) - set(TAGS)  # a misspelt tag would leave that memory released
        if unknown:
            raise ValueError(f"resume_memory: unknown tags {sorted(unknown)}; expected {', '.join(TAGS)}")
        with self._lock:
            for tag in TAGS if tags is None else [t for t in TAGS if t in tags]:
                self.memory_saver.resume(tag)
                self._released.discard(tag)

    def close(self) -> None:
        """Nothing lives outside this process: requests still waiting fail, new ones are refused,
        and the decode thread stops once the batch it runs is done. The prefix cache's keys and
        values are dropped then, so that their memory goes with the last request."""
        self._closed = True
        for waiting in self._pending.drain():
            deliver(waiting.future, RuntimeError("HFEngine: the engine was closed before this request ran"))
        with self._lock:
            self.prefix_cache.clear()
            self.stats["kv_cache_bytes"] = 0

    def _check_resident(self, what: str, tags: tuple[str, ...]) -> None:
        """A RuntimeError instead of reading memory release_memory handed back (a crash on CUDA)."""
        missing = [tag for tag in tags if tag in self._released]
        if missing:
            raise RuntimeError(f"HFEngine.{what}: the engine's {' and '.join(missing)} memory is released; "
                               f"call resume_memory first")
