"""An event loop in a daemon thread, for connections that must outlive the caller's event loops.

The rollout runs every step under an event loop of its own, and an asyncio connection (an httpx
pool, an MCP session with its anyio task group) belongs to the loop that opened it: reused from the
next step's loop it fails. Remote and MCP tools therefore open their connection once on this loop
and every episode of every step submits its calls here with `await loop.run(coro)`; cancelling the
caller (ToolEnv's timeout) cancels the call. `close()` lets what `submit()` started finish (for
a while), runs a last coroutine (closing the connection), stops the loop and joins the thread; an
atexit hook does it for whatever is left open.

This is not a worker pool: coroutines run concurrently on one thread, so they must not block it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """One running event loop in a daemon thread, shared by every caller loop."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        self._cleanup: Callable[[], Awaitable[Any]] | None = None
        self._submitted: set[concurrent.futures.Future] = set()  # what submit() started and close() waits for
        atexit.register(self.close)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the background loop from any other loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start `coro` on the background loop and wait for nothing (a no-op once closed)."""
        try:
            if not self._closed:
                started = asyncio.run_coroutine_threadsafe(coro, self.loop)
                self._submitted.add(started)
                started.add_done_callback(self._submitted.discard)
                return
        except RuntimeError:  # closed meanwhile
            pass
        coro.close()

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the background loop from plain synchronous code (construction, tests)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except BaseException:  # a timeout, a Ctrl-C, a wait too long for this platform: no work left behind
            future.cancel()
            raise

    def on_close(self, cleanup: Callable[[], Awaitable[Any]]) -> None:
        """A coroutine function `close()` runs on the loop before stopping it."""
        self._cleanup = cleanup

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        # What submit() started (a release sent in the background) gets half the time to finish,
        # then is cancelled: a task left pending on a closed loop is destroyed mid-request.
        _, unfinished = concurrent.futures.wait(list(self._submitted), timeout_s / 2)
        for started in unfinished:
            started.cancel()
        if unfinished:
            concurrent.futures.wait(unfinished, timeout_s / 2)
        if self._cleanup is not None:
            try:
                self.run_sync(self._cleanup(), timeout_s)
            except Exception:  # closing must finish even when the connection is already broken
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
