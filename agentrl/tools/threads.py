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
it started never runs and is dropped from the queue. The event loop's own name lookups
(`loop.getaddrinfo`, which every connection to a host name makes) run on a thread of their own,
outside that bound: a plug-in whose `to_thread` calls all hung would otherwise stall every client's
connections too. This module does not kill threads (Python
cannot); code that must be stopped runs in a subprocess (the `python` tool does).

`call_plugin` is the same rule for a plug-in's coroutines. It also times each stretch a coroutine
runs without yielding: an `async def` tool that calls blocking code (`time.sleep`, `requests`)
holds the whole event loop, every episode waits and no timeout can fire; past BLOCK_WARN_S a
warning names the plug-in once, since nothing can interrupt it. `asyncio.wait_for` cancels a call that
ran out of time and then waits for it to end, without a limit: a tool that swallows cancellation
(a retry loop under a bare `except:`) would hold its episode, and the whole step, forever. And what a
plug-in raises outside `Exception` (`SystemExit` from an argparse or click wrapper, a
`CancelledError` or another BaseException of its own) would end the rollout, or the tool server,
instead of the one call. A KeyboardInterrupt raised on the event loop's thread stays one: it may be
the user's Ctrl-C, landing while a plug-in runs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import socket
import sys
import threading
import time
import weakref
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")
_names = itertools.count(1)
GRACE_S = 1.0  # how long a cancelled plug-in coroutine may take to end before it is abandoned
BLOCK_WARN_S = 1.0  # a plug-in coroutine holding the event loop this long in one stretch is named
_blockers_named: set[str] = set()
_abandoned: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones
_plugin_calls: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()  # every call_plugin task still alive
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
        if fn in name_lookups():  # they end by themselves (the resolver's own timeouts)
            if future.set_running_or_notify_cancel():
                threading.Thread(target=_settle, args=(future, lambda: fn(*args, **kwargs)),
                                 name=f"{self.name}-lookup-{next(_names)}", daemon=True).start()
            return future
        with self._lock:
            # Calls that timed out while queued behind hung ones would otherwise pile up here.
            self._pending = collections.deque(w for w in self._pending if not w[0].cancelled())
            self._pending.append((future, lambda: fn(*args, **kwargs)))
            start = self._slots_taken < self.max_workers
            self._slots_taken += int(start)
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{next(_names)}", daemon=True).start()
        return future

    def grow(self, max_workers: int) -> None:
        """Let at least `max_workers` calls run at once from now on (queued ones start at once)."""
        with self._lock:
            self.max_workers = max(self.max_workers, max_workers)
            start = max(0, min(len(self._pending), self.max_workers - self._slots_taken))
            self._slots_taken += start
        for _ in range(start):
            threading.Thread(target=self._work, name=f"{self.name}-{next(_names)}", daemon=True).start()

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
            _settle(*work)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Returns at once: threads still running are abandoned, by design."""
        return None


def name_lookups() -> tuple[Callable[..., Any], ...]:
    """What the loop's getaddrinfo and getnameinfo hand to the executor: socket's functions as they
    are now, so that a wrapper installed after this module loaded (a test's network guard, an
    instrumentation library) is still recognised."""
    return socket.getaddrinfo, socket.getnameinfo


def _settle(future: concurrent.futures.Future, call: Callable[[], Any]) -> None:
    try:
        result = call()
    except BaseException as e:  # handed to the caller, like any executor does
        future.set_exception(e)
    else:
        future.set_result(result)


def run_with_daemon_threads(coro: Coroutine[Any, Any, T], max_workers: int = 32) -> T:
    """`asyncio.run(coro)` with a DaemonExecutor as the loop's default executor, so that blocking
    code a plug-in hands to `asyncio.to_thread` cannot keep the loop (or the process) from ending;
    and at the end, like `asyncio.run`, every task left is cancelled and awaited, except plug-in
    calls, which get GRACE_S to end (asyncio.run would wait forever for one that ignores its
    cancellation) and are then abandoned with the loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise RuntimeError("run_with_daemon_threads() cannot be called from a running event loop")
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        loop.set_default_executor(DaemonExecutor(max_workers, name="agentrl-default"))
        return loop.run_until_complete(coro)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            # Not the plug-in calls themselves: their callers, cancelled, give each its grace
            # (call_plugin), so every task awaited here ends within GRACE_S of its cancellation.
            others = [task for task in left if task not in _plugin_calls]
            if others:
                loop.run_until_complete(asyncio.gather(*others, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
            gone = [task for task in _abandoned if task.get_loop() is loop]
            _abandoned.difference_update(gone)
            _strand([task for task in gone if not task.done()])


def _strand(tasks: list[asyncio.Task]) -> None:
    """Keep plug-in calls that outlive their loop from ever being finalized. Freeing a suspended
    coroutine closes it: GeneratorExit is thrown in at its `await`, and a retry loop under a bare
    `except:` swallows that too and spins forever (its next await fails without a loop, and that
    is swallowed as well), hanging the process at its next garbage collection. A daemon thread
    that never returns holds them (Python stops it at exit without freeing what its frame
    references); one such thread holds every call stranded this way."""
    global _holder
    if not tasks:
        return
    _stranded.extend(tasks)
    if _holder is None:
        _holder = threading.Thread(target=_hold, args=(_stranded,), name="agentrl-stranded-calls", daemon=True)
        _holder.start()


def _hold(tasks: list[asyncio.Task]) -> None:
    threading.Event().wait()  # never set: `tasks` stays referenced by this frame


_stranded: list[asyncio.Task] = []
_holder: threading.Thread | None = None


class CallTimeout(TimeoutError):
    """call_plugin's own timeout: the call ran past its limit. A TimeoutError the plug-in raises
    itself (its HTTP client's, say) is an ordinary failure of the call and keeps its message."""


class PluginError(Exception):
    """What a plug-in raised outside `Exception` (`SystemExit`, its own `CancelledError` or other
    BaseException), as an ordinary failure of the one call."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


# What a plug-in running on the event loop's thread may raise that is not its own failure: a
# cancellation (of its task, by its caller), the user's Ctrl-C landing while it runs, the closing of
# its coroutine. Everything else outside `Exception` is the plug-in's own and fails only its call.
NOT_A_PLUGINS_OWN = (asyncio.CancelledError, KeyboardInterrupt, GeneratorExit)


def on_worker_thread(fn: Callable[..., T], /, **arguments: Any) -> T:
    """`fn(**arguments)` as a plug-in's synchronous call on a worker thread. No real Ctrl-C or
    cancellation lands on such a thread, so whatever it raises outside `Exception` (a
    KeyboardInterrupt, a SystemExit, a BaseException of its own) is the plug-in's: it fails this
    call, as a PluginError, instead of ending the run."""
    try:
        return fn(**arguments)
    except Exception:
        raise
    except BaseException as e:
        raise PluginError(e) from e


def failure_text(error: BaseException) -> str:
    """`Type: message` of a plug-in's exception, the original type for a PluginError."""
    error = error.error if isinstance(error, PluginError) else error
    try:
        detail = str(error)
    except Exception:  # noqa: BLE001 - a plug-in's exception may fail to print
        detail = "<unprintable>"
    return f"{type(error).__name__}{': ' + detail if detail else ''}"


async def call_plugin(coro: Coroutine[Any, Any, T], timeout_s: float | None, name: str | None = None) -> T:
    """Await a plug-in's coroutine for at most `timeout_s`: CallTimeout when it runs over, even if
    it ignores its cancellation (it gets GRACE_S to end, then is abandoned); PluginError for what
    it raises outside `Exception`. Cancelling the caller cancels the call (with the same grace).
    `name` (default: the coroutine's qualified name) is what a warning about blocking says."""
    name = name or getattr(coro, "__qualname__", type(coro).__name__)
    # The task too: a call still running when its loop closes is logged by name.
    task = asyncio.get_running_loop().create_task(_contained(_Stepwise(coro, name)), name=f"plug-in call {name}")
    _plugin_calls.add(task)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await _stop(task)
        raise
    if not done:
        await _stop(task)
        raise CallTimeout
    if task.cancelled():  # the plug-in raised CancelledError itself: nobody cancelled it
        raise PluginError(asyncio.CancelledError())
    return task.result()


def abandoned_calls() -> int:
    """Plug-in calls given up on (timed out, or their caller was cancelled) that are still running:
    coroutines of the running loop that ignored their cancellation, and synchronous functions,
    which a thread cannot stop, still busy on their threads (each holds one of its tool's slots)."""
    loop = asyncio.get_running_loop()
    return sum(1 for task in _abandoned if task.get_loop() is loop and not task.done()) + ThreadCall.abandoned


class ThreadCall:
    """One call of a synchronous function on a thread, counted in `abandoned_calls` from the moment
    its caller gives up (`abandon`) until the function returns."""

    abandoned = 0  # of every ThreadCall in the process
    _lock = threading.Lock()

    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self._started = self._finished = self._given_up = False

    def run(self) -> T:
        with ThreadCall._lock:
            self._started = True
            ThreadCall.abandoned += int(self._given_up)
        try:
            return self.fn()
        finally:
            with ThreadCall._lock:
                self._finished = True
                ThreadCall.abandoned -= int(self._given_up)

    def abandon(self) -> None:
        """Counted while it runs; a call still queued (its executor drops it) never is."""
        with ThreadCall._lock:
            if not self._given_up:
                self._given_up = True
                ThreadCall.abandoned += int(self._started and not self._finished)


class _Stepwise:
    """Awaits a coroutine one step at a time, as a Task would, timing each step: what the step
    yields goes to the Task unchanged, and what the Task sends or throws in (a result, a
    cancellation, the GeneratorExit of closing) goes on to the coroutine."""

    def __init__(self, coro: Coroutine[Any, Any, T], name: str):
        self.coro, self.name = coro, name

    def __await__(self) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            started = time.perf_counter()
            try:
                step = self.coro.send(value) if error is None else self.coro.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                self._check(time.perf_counter() - started)
            try:
                value, error = (yield step), None
            except BaseException as e:  # noqa: BLE001 - handed on to the coroutine, which decides
                value, error = None, e

    def _check(self, held_s: float) -> None:
        warn_if_blocking(self.name, held_s, "run blocking code with `await asyncio.to_thread(...)`, or write the "
                                            "function without async (it then runs on a thread)")


def warn_if_blocking(name: str, held_s: float, advice: str) -> None:
    """One warning per plug-in `name` that held the event loop past BLOCK_WARN_S."""
    if held_s > BLOCK_WARN_S and name not in _blockers_named:
        _blockers_named.add(name)
        print(f"agentrl: warning: {name} held the event loop for {held_s:.1f} s without yielding: every episode "
              f"waited and no timeout could fire meanwhile; {advice}", file=sys.stderr)


async def _contained(coro: Coroutine[Any, Any, T] | _Stepwise) -> T:
    try:
        return await coro
    except (Exception, *NOT_A_PLUGINS_OWN):
        # An ordinary failure, a cancellation (call_plugin tells its own from the plug-in's), a
        # Ctrl-C landing on the loop's thread while the plug-in runs there, the coroutine's closing.
        raise
    except BaseException as e:
        # SystemExit: a Task would re-raise it out of the event loop, ending the process. A
        # plug-in's own BaseException (gevent's Timeout, an Abort of its own) would pass every
        # `except Exception` of a create, reward or release, leaving the other instances unreleased.
        raise PluginError(e) from e


async def _stop(task: asyncio.Task) -> None:
    """Cancel a plug-in call and give it GRACE_S to end. It is registered as abandoned first, so
    that a second cancellation of the caller during the grace leaves it registered too."""
    # Nobody awaits the task any more: take its outcome so asyncio does not log it as lost.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    _abandoned.add(task)
    task.add_done_callback(_abandoned.discard)
    task.cancel()
    await asyncio.wait({task}, timeout=GRACE_S)
