"""Daemon threads for synchronous code that may never return (tool functions, blocking plug-ins).

`concurrent.futures.ThreadPoolExecutor` is the library answer for running blocking calls off the
event loop, and it is the wrong one here: its workers are joined when the interpreter exits, and
`asyncio.run` waits (without a time limit on Python 3.11) for every default-executor thread when it
shuts its loop down. A tool function stuck in `time.sleep(3600)` would then hold up the end of every
rollout and the exit of the process, although its episode moved on after one timeout.

`DaemonExecutor` runs each call on its own daemon thread and lets at most `max_workers` of them run
at once. A call that times out is abandoned: its thread keeps its slot until the function really
returns (so a tool that hangs cannot start an unbounded number of threads), nobody waits for it,
and the process exits without joining it. A call cancelled before it started never runs.
This module does not kill threads (Python cannot); code that must be stopped runs in a subprocess
(the `python` tool does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")
_names = itertools.count(1)


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
        self._slots = threading.BoundedSemaphore(max_workers)
        self._running = 0
        self._count_lock = threading.Lock()

    @property
    def running(self) -> int:
        """Calls executing right now, abandoned ones included."""
        return self._running

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def work() -> None:
            with self._slots:
                if not future.set_running_or_notify_cancel():  # cancelled while waiting for a slot
                    return
                with self._count_lock:
                    self._running += 1
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # handed to the caller, like any executor does
                    future.set_exception(e)
                else:
                    future.set_result(result)
                finally:
                    with self._count_lock:
                        self._running -= 1

        threading.Thread(target=work, name=f"{self.name}-{next(_names)}", daemon=True).start()
        return future

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
