"""Daemon threads for synchronous code that may never return (tool functions, blocking plug-ins).

`concurrent.futures.ThreadPoolExecutor` is the library answer for running blocking calls off the
event loop, and it is the wrong one here: its workers are joined when the interpreter exits, and
`asyncio.run` waits (without a time limit on Python 3.11) for every default-executor thread when it
shuts its loop down. A tool function stuck in `time.sleep(3600)` would then hold up the end of every
rollout and the exit of the process, although its episode moved on after one timeout.

`DaemonExecutor` runs calls on daemon threads, at most `max_workers` at once; calls beyond that
wait in a queue and own no thread. A call that times out is abandoned: its thread keeps its slot
until the function really returns (so a tool that hangs cannot start an unbounded number of
threads), nobody waits for it, and the process exits without joining it. A call cancelled before
it started never runs and is dropped from the queue. This module does not kill threads (Python
cannot); code that must be stopped runs in a subprocess (the `python` tool does).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import threading
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")
_names = itertools.count(1)
_Work = tuple[concurrent.futures.Future, Callable[[], Any]]


class DaemonExecutor(concurrent.futures.ThreadPoolExecutor):
    """An executor whose threads never delay shutdown; at most `max_workers` calls run at once.

    It derives from ThreadPoolExecutor only because `loop.set_default_executor` accepts nothing
    else; `submit` and `shutdown` are its own, and no pool thread is ever started.
    """

    def __init__(self, max_workers: int = 8, name: str = "agentrl-sync"):
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        super().__init__(max_workers=1)
        self.max_workers = max_workers
        self.name = name
        self._pending: collections.deque[_Work] = collections.deque()
        self._slots_taken = 0  # live threads: each runs a call or is about to take the next
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """Calls executing right now, abandoned ones included."""
        return self._slots_taken

    @property
    def waiting(self) -> int:
        """Calls queued for a free slot (cancelled ones leave at the next submit or free slot)."""
        return len(self._pending)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            # Calls that timed out while queued behind hung ones would otherwise pile up here.
            self._pending = collections.deque(w for w in self._pending if not w[0].cancelled())
            self._pending.append((future, lambda: fn(*args, **kwargs)))
            start = self._slots_taken < self.max_workers
            self._slots_taken += int(start)
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{next(_names)}", daemon=True).start()
        return future

    def _next(self) -> _Work | None:
        """The oldest queued call that was not cancelled, marked running; None gives the slot back."""
        with self._lock:
            while self._pending:
                work = self._pending.popleft()
                if work[0].set_running_or_notify_cancel():
                    return work
            self._slots_taken -= 1
            return None

    def _work(self) -> None:
        while (work := self._next()) is not None:
            future, call = work
            try:
                result = call()
            except BaseException as e:  # handed to the caller, like any executor does
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Returns at once: threads still running are abandoned, by design."""
        return None


def run_with_daemon_threads(coro: Coroutine[Any, Any, T], max_workers: int = 32) -> T:
    """`asyncio.run(coro)` with a DaemonExecutor as the loop's default executor, so that blocking
    code a plug-in hands to `asyncio.to_thread` cannot keep the loop (or the process) from ending."""

    async def main() -> T:
        asyncio.get_running_loop().set_default_executor(DaemonExecutor(max_workers, name="agentrl-default"))
        return await coro

    return asyncio.run(main())
