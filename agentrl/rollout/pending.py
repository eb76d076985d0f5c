"""The requests waiting for the transformers engine's decode thread, and whether that thread runs.

The event loop queues requests (`add`); the decode thread takes them batch by batch (`next_key`,
`take`) and stops when none waits. Both sides decide under one lock, so a request queued while the
thread is deciding to stop starts a new thread rather than waiting for one that is ending. A
request whose caller was cancelled (an HTTP client that hung up) is dropped unseen.

This module does not decode; hf_engine.py does. `check_request` is what a request must satisfy
before it is queued.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from agentrl.types import Completion, SamplingParams


@dataclass
class Request:
    token_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future


def check_request(model, token_ids: list[int], sampling: SamplingParams) -> None:
    """A ValueError for a request that cannot run: inside a batch it would fail every row (a token
    outside the vocabulary, a position past the model's: GPT-2's IndexError), or, on a rotary
    model past its positions, decode garbage silently."""
    if not token_ids:
        raise ValueError("generate needs at least one prompt token")
    seed = sampling.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
        raise ValueError(f"generate: seed {seed!r} is no integer from 0 to 2**64 - 1 (a torch.Generator's seed)")
    vocabulary = model.get_input_embeddings().num_embeddings
    if not all(0 <= t < vocabulary for t in token_ids):
        bad = next(t for t in token_ids if not 0 <= t < vocabulary)
        raise ValueError(f"generate: token id {bad} is outside the model's vocabulary (0..{vocabulary - 1})")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and len(token_ids) + sampling.max_new_tokens > positions:
        raise ValueError(f"generate: {len(token_ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} "
                         f"exceed the model's max_position_embeddings ({positions})")


def resolve(future: asyncio.Future, result: Completion | Exception) -> None:
    """Hand a result (or failure) to a waiting caller, in the caller's event loop."""
    if future.done():  # the caller was cancelled
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


def deliver(future: asyncio.Future, result: Completion | Exception) -> None:
    """resolve() scheduled in the caller's event loop, from the decode thread. A loop that has
    closed meanwhile (the run was interrupted and its loop torn down) has no one left to tell."""
    loop = future.get_loop()
    try:
        loop.call_soon_threadsafe(resolve, future, result)
    except RuntimeError:
        if not loop.is_closed():
            raise


class PendingRequests:
    def __init__(self) -> None:
        self._requests: list[Request] = []
        self._lock = threading.Lock()
        self._serving = False  # a decode thread runs, or its start is scheduled
        self._start_on: asyncio.AbstractEventLoop | None = None  # the loop a scheduled start waits on
        self._stopped = threading.Condition(self._lock)  # notified when it ends

    def add(self, request: Request, loop: asyncio.AbstractEventLoop) -> bool:
        """Queue a request; True when no decode thread runs and the caller must start one on
        `loop` (and call `starting` then). A start scheduled on a loop that closed before it ran
        never comes: the next request schedules another."""
        with self._lock:
            self._requests.append(request)
            start = not self._serving or (self._start_on is not None and self._start_on.is_closed())
            self._serving = True
            if start:
                self._start_on = loop
        return start

    def starting(self) -> None:
        """The decode thread is being started (its start no longer waits on a loop)."""
        with self._lock:
            self._start_on = None

    def next_key(self) -> tuple | None:
        """The sampling settings of the oldest waiting request; None when none waits, and then the
        decode thread counts as stopped."""
        with self._lock:
            self._drop_cancelled()
            if not self._requests:
                self._serving = False
                self._stopped.notify_all()
                return None
            return self._requests[0].sampling.batch_key()

    def take(self, key: tuple, room: int) -> list[Request]:
        """Up to `room` waiting requests with sampling settings `key`, oldest first, and none while
        the oldest waiting request has other settings: a stream of requests joining a running batch
        would otherwise keep it waiting for as long as the stream lasts."""
        with self._lock:
            self._drop_cancelled()
            if self._requests and self._requests[0].sampling.batch_key() != key:
                return []
            taken = [r for r in self._requests if r.sampling.batch_key() == key][:room]
            ids = {id(r) for r in taken}
            self._requests = [r for r in self._requests if id(r) not in ids]
        return taken

    def stopped(self) -> None:
        """The decode thread ended without `next_key` saying so (it broke)."""
        with self._lock:
            self._serving = False
            self._stopped.notify_all()

    def drain(self) -> list[Request]:
        """Every waiting request, taken out for its caller to fail (the engine closed); a running
        decode thread then finds none and stops."""
        with self._lock:
            requests, self._requests = self._requests, []
        return requests

    def abandon(self) -> list[Request]:
        """No decode thread could start: every waiting request, taken out for its caller to fail."""
        with self._lock:
            requests, self._requests, self._serving = self._requests, [], False
            self._stopped.notify_all()
        return requests

    @property
    def serving(self) -> bool:
        with self._lock:
            return self._serving

    def wait_idle(self, timeout_s: float | None) -> bool:
        with self._stopped:
            return self._stopped.wait_for(lambda: not self._serving, timeout_s)

    def _drop_cancelled(self) -> None:
        self._requests = [r for r in self._requests if not r.future.done()]
