"""`agentrl tools serve`: the tools of a tool file behind an authenticated HTTP API.

FastAPI (run by uvicorn) does the routing and validates every body with pydantic; this module adds
what a tool server shared by many rollout workers needs: a bearer token on every call but
`/health`, a semaphore bounding tool calls in flight, a cap on request bodies (uvicorn has none),
a cap on live instances with expiry of those a client never releases, a per-call timeout (calls
whose client has left are not started, or are cancelled), and
per-tool call counts, errors and latencies at `/stats` (`abandoned_calls`: timed-out calls still
running, their cancellation ignored or their thread busy). A tool that raises or times out answers
200 with `error` set, so a 5xx always means the server itself failed; a bad request answers 4xx
with a one-line `detail`.

API (JSON): `GET /tools` → `{"tools": [schema, ...]}`; `POST /instances {"tool", "kwargs",
"instance_id"}` → `{"instance_id", "error"}`; `POST /instances/{id}/execute {"arguments"}` →
`{"text", "reward", "metrics", "error"}`; `POST /instances/{id}/reward` → `{"reward", "error"}`
(both with `"invalid": N` when N of the tool's reward and metric values were dropped: no finite
number, or a metric name that is no text; the client counts them as ToolEnv counts a local tool's);
`DELETE /instances/{id}` → `{"error"}`; `GET /stats`; `GET /health`. Clients name their instances
(or the server does): a create is safe to resend, and one given up on is still released. Not a
sandbox: tools run in this process with its rights (the `python` tool brings its own).
"""

from __future__ import annotations

import asyncio
import hmac
import sys
import time
import uuid
from collections import Counter, defaultdict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.finite import finite_number
from agentrl.tools.base import REWARD_LIMIT, Tool, ToolResult, argument_problem, as_text, tool_name
from agentrl.tools.threads import CallTimeout, abandoned_calls, call_plugin, failure_text, run_with_daemon_threads


DISCONNECT_POLL_S = 0.25  # how often a running call checks that its client is still there


@dataclass(frozen=True)
class ServerSettings:
    token: str
    max_concurrency: int = 32  # tool calls running at once; more wait
    max_body_bytes: int = 1_000_000
    max_instances: int = 4096  # live instances; creating more answers 429
    instance_ttl_s: float = 600.0  # an instance unused this long is released
    call_timeout_s: float = 60.0  # from the request's arrival: waiting for a slot counts
    max_output_chars: int = 1_000_000  # of a tool's text; the rest is cut (the client keeps far less)


class CreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool: str
    kwargs: dict[str, Any] = {}
    instance_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{8,64}$")


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    arguments: dict[str, Any]


@dataclass
class OpStats:
    calls: int = 0
    errors: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        mean = self.total_s / self.calls if self.calls else 0.0
        return {"calls": self.calls, "errors": self.errors, "mean_s": mean, "max_s": self.max_s}


@dataclass
class Live:
    tool: str
    tool_id: str  # the id the tool's create returned, which its other methods take; clients use theirs
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0  # calls running on it: never expired meanwhile
    release_pending: bool = False  # released by a client while busy: the last call to end releases it


@dataclass
class Creating:
    """A create still running: its tool, its answer once it has one, and whether a release came."""

    tool: str
    answer: asyncio.Future[tuple[str, str | None]]
    released: bool = False


class ToolHost:
    """The tools, their live instances, and the gate and clock every call goes through."""

    def __init__(self, tools: list[Tool], settings: ServerSettings):
        self.tools = {tool_name(t): t for t in tools}
        self.settings = settings
        self.instances: dict[str, Live] = {}
        self.creating: dict[str, Creating] = {}  # instances whose create is running
        self.gate = asyncio.Semaphore(settings.max_concurrency)
        self.stats: dict[str, dict[str, OpStats]] = defaultdict(lambda: defaultdict(OpStats))
        self.expired, self.responses = 0, Counter[int]()

    async def call(self, name: str, op: str, start: Callable[[], Awaitable[Any]],
                   gone: Callable[[], Awaitable[bool]] | None = None) -> tuple[Any, str | None]:
        """Run one tool method under the gate and the timeout, which counts the wait for a slot;
        (value, None) or (None, error). `gone` says whether the client left: a call is then not
        started (its side effects would happen for an answer nobody reads), or cancelled."""
        value, error, _ = await self._call(name, op, start, gone)
        return value, error

    async def _call(self, name: str, op: str, start: Callable[[], Awaitable[Any]],
                    gone: Callable[[], Awaitable[bool]] | None = None) -> tuple[Any, str | None, bool]:
        """`call`, and whether the tool method was started at all. A release waits for its slot
        without a limit and then has the whole timeout: the instance is gone from the server's
        table already, and a release given up on would leak what the tool holds."""
        arrived, limit = time.perf_counter(), self.settings.call_timeout_s
        try:
            if op == "release":
                await self.gate.acquire()
            else:
                await asyncio.wait_for(self.gate.acquire(), limit)
        except asyncio.TimeoutError:
            return (*self._count(name, op, None, 0.0, f"TimeoutError: {name} did not start within {limit:g} s: all "
                                 f"{self.settings.max_concurrency} of the server's call slots stayed busy"), False)
        running = time.perf_counter()
        waited = 0.0 if op == "release" else running - arrived
        try:
            if waited >= limit:
                return (*self._count(name, op, None, 0.0, f"TimeoutError: {name} did not start within {limit:g} s: "
                                     "a call slot came free only then"), False)
            if gone is not None and await gone():
                return (*self._count(name, op, None, 0.0, "the client disconnected before the call started; it "
                                     "was not run"), False)
            try:  # call_plugin: a tool's sys.exit() fails its call, not the server
                value, error = await self._watched(call_plugin(start(), limit - waited, f"the tool '{name}' ({op})"),
                                                   gone)
            except CallTimeout:
                spent = f" ({waited:.1f} s of it waiting for a call slot)" if waited >= 0.1 else ""
                value, error = None, f"TimeoutError: {name} did not finish within {limit:g} s{spent}"
            except Exception as e:
                value, error = None, as_text(failure_text(e))  # JSON cannot carry lone surrogates
            return (*self._count(name, op, value, time.perf_counter() - running, error), True)
        finally:
            self.gate.release()

    def _count(self, name: str, op: str, value: Any, elapsed: float, error: str | None) -> tuple[Any, str | None]:
        """Record one call in /stats (its time is the tool's, not the wait for a slot)."""
        stats = self.stats[name][op]
        stats.calls, stats.errors = stats.calls + 1, stats.errors + (error is not None)
        stats.total_s, stats.max_s = stats.total_s + elapsed, max(stats.max_s, elapsed)
        return value, error

    @staticmethod
    async def _watched(call: Awaitable[Any], gone: Callable[[], Awaitable[bool]] | None) -> tuple[Any, str | None]:
        """The call's (value, None); with `gone`, it is cancelled once its client has left (a
        client's own timeout, an episode cancelled), freeing its slot for calls still wanted."""
        task = asyncio.ensure_future(call)
        try:
            while gone is not None:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await gone():
                    task.cancel()
                    await asyncio.wait({task})  # call_plugin gives the tool its grace, then abandons it
                    return None, "the client disconnected during the call; it was cancelled"
            return await task, None
        finally:
            if not task.done():  # this request itself cancelled: the call goes with it, before its slot is freed
                task.cancel()
                await asyncio.wait({task})

    async def create(self, tool: str, kwargs: dict[str, Any], instance_id: str) -> tuple[str, str | None]:
        """Make `instance_id` once: (id, None), or (id, error) if the tool failed or a release came
        meanwhile. Creates in flight count against the cap and hold their id from the first wait on.
        The same create sent again meanwhile (a client's retry after a dropped connection or a
        proxy's 5xx) waits for the first and gets its answer: refused, the client would release
        the instance the first one is making."""
        live = self.instances.get(instance_id)
        if live is not None and live.tool == tool:  # sent again: the first create made it
            live.last_used = time.monotonic()
            return instance_id, None
        pending = self.creating.get(instance_id)
        if live is None and pending is not None and pending.tool == tool:
            return await asyncio.shield(pending.answer)  # this request's end does not cancel the first
        if live is not None or pending is not None:
            raise HTTPException(409, as_text(f"instance '{instance_id}' exists or is being created"))
        pending = self.creating[instance_id] = Creating(tool, asyncio.get_running_loop().create_future())
        # read, so an answer no resend waited for logs no "exception was never retrieved"
        pending.answer.add_done_callback(lambda answer: answer.cancelled() or answer.exception())
        try:
            answer = await self._create(tool, kwargs, instance_id, pending)
        except HTTPException as e:  # refused (the cap): so is a resend
            pending.answer.set_exception(e)
            raise
        except BaseException:  # this request was cancelled: a resend is told to send it again
            pending.answer.set_exception(HTTPException(503, as_text(f"the create of instance '{instance_id}' was "
                                                                    "interrupted; send it again")))
            raise
        finally:
            self.creating.pop(instance_id, None)
        pending.answer.set_result(answer)
        return answer

    async def _create(self, tool: str, kwargs: dict[str, Any], instance_id: str,
                      pending: Creating) -> tuple[str, str | None]:
        if len(self.instances) + len(self.creating) > self.settings.max_instances:
            await self.expire()
        if len(self.instances) + len(self.creating) > self.settings.max_instances:
            raise HTTPException(429, f"{self.settings.max_instances} instances are live; release some first")
        made, error, started = await self._call(tool, "create", lambda: self.tools[tool].create(instance_id, **kwargs))
        tool_id = made if isinstance(made, str) and made else instance_id
        if not started:  # the tool never saw it: nothing to free (and `error` says why)
            return instance_id, error
        if error is not None or pending.released:  # what a failed create made is the tool's to free, as in ToolEnv
            await self.call(tool, "release", lambda: self.tools[tool].release(tool_id))
            error = error or "released while it was being created"
        else:
            self.instances[instance_id] = Live(tool, tool_id)
        return instance_id, error

    def instance(self, instance_id: str) -> Live:
        live = self.instances.get(instance_id)
        if live is None:
            raise HTTPException(404, as_text(f"unknown instance '{instance_id}' (never created, released or expired)"))
        live.last_used = time.monotonic()
        return live

    @asynccontextmanager
    async def using(self, live: Live) -> AsyncIterator[None]:
        """A call on `live`: it is busy meanwhile, and used when it ends."""
        live.busy += 1
        try:
            yield
        finally:
            live.busy -= 1
            live.last_used = time.monotonic()
            if not live.busy and live.release_pending:
                live.release_pending = False
                await self.call(live.tool, "release", lambda: self.tools[live.tool].release(live.tool_id))

    async def expire(self) -> None:
        """Release every instance idle for longer than the TTL (none with a call running)."""
        cutoff = time.monotonic() - self.settings.instance_ttl_s
        for instance_id, live in list(self.instances.items()):
            if live.last_used < cutoff and not live.busy and self.instances.pop(instance_id, None) is not None:
                self.expired += 1
                await self.call(live.tool, "release", lambda: self.tools[live.tool].release(live.tool_id))

    async def release_all(self) -> None:
        """At shutdown: release every live instance, its clients gone with the server."""
        while self.instances:
            instance_id, live = self.instances.popitem()
            await self.call(live.tool, "release", lambda: self.tools[live.tool].release(live.tool_id))

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, min(self.settings.instance_ttl_s / 2, 30.0)))
            await self.expire()


class Guard:
    """ASGI middleware: refuses a request without the bearer token with 401 (every route but
    /health) and bodies over the cap with 413, before any of the body is read, and counts
    responses by status. The token is checked here, not in a FastAPI dependency, because FastAPI
    reads and parses a route's body before it runs the route's dependencies: a client without the
    token had a megabyte parsed, and bad JSON answered 422 rather than 401."""

    def __init__(self, app: Any, host: ToolHost):
        self.app, self.host = app, host
        self._expected = f"Bearer {host.settings.token}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization")
        if scope["path"] != "/health" and (given is None or not hmac.compare_digest(given, self._expected)):
            self.host.responses[401] += 1
            return await JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                                      headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        cap = self.host.settings.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > cap:
            response = JSONResponse({"detail": f"request body over {cap} bytes"}, status_code=413)
            self.host.responses[413] += 1
            return await response(scope, receive, send)
        seen = 0

        async def capped_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > cap:  # a chunked body that declared no length
                raise HTTPException(413, f"request body over {cap} bytes")
            return message

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.host.responses[message["status"]] += 1
            await send(message)

        await self.app(scope, capped_receive, counting_send)


def create_app(tools: list[Tool], settings: ServerSettings) -> FastAPI:
    host = ToolHost(tools, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(host.sweep_forever())
        yield
        sweeper.cancel()
        await host.release_all()  # what live instances hold (a sandbox, a file) is freed, not left behind

    app = FastAPI(title="agentrl tools", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, host=host)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _internal_error)
    _info_routes(app, host)
    _instance_routes(app, host)
    app.state.host = host
    return app


def _info_routes(app: FastAPI, host: ToolHost) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/tools")
    async def list_tools() -> dict[str, Any]:
        return {"tools": [t.schema for t in host.tools.values()]}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {"tools": {name: {op: s.as_dict() for op, s in ops.items()} for name, ops in host.stats.items()},
                "live_instances": len(host.instances), "expired_instances": host.expired,
                "abandoned_calls": abandoned_calls(),
                "responses": {str(status): n for status, n in sorted(host.responses.items())}}


def _instance_routes(app: FastAPI, host: ToolHost) -> None:
    """Create, execute, reward and release: a tool instance's life over HTTP."""

    @app.post("/instances")
    async def create(body: CreateRequest) -> dict[str, Any]:
        if body.tool not in host.tools:
            raise HTTPException(404, as_text(f"unknown tool '{body.tool}'; available: {', '.join(sorted(host.tools))}"))
        instance_id, error = await host.create(body.tool, body.kwargs, body.instance_id or uuid.uuid4().hex)
        return {"instance_id": instance_id if error is None else None, "error": error}

    @app.post("/instances/{instance_id}/execute")
    async def execute(instance_id: str, body: ExecuteRequest, request: Request) -> dict[str, Any]:
        live = host.instance(instance_id)
        name = live.tool
        problem = argument_problem(host.tools[name], body.arguments)
        if problem:
            raise HTTPException(422, as_text(problem))
        async with host.using(live):  # a long call does not count as idle time
            result, error = await host.call(name, "execute", lambda: host.tools[name].execute(live.tool_id,
                                                                                               body.arguments),
                                            gone=request.is_disconnected)
        if error is not None:
            return {"text": "", "reward": None, "metrics": {}, "error": error}
        if not isinstance(result, ToolResult):
            result = ToolResult(result)
        text = capped_text(result.text, host.settings.max_output_chars)
        # Only finite numbers cross the wire (JSON has no NaN); the count of the others goes with
        # them, for the client's ToolEnv to count as it counts a local tool's (tool_invalid_results).
        metrics, invalid = {}, 0
        for key, value in (result.metrics.items() if isinstance(result.metrics, dict) else ()):
            number = finite_number(value)
            if number is None or not isinstance(key, str):
                invalid += 1
            else:
                metrics[as_text(key)] = number
        reward = finite_number(result.reward, REWARD_LIMIT)
        invalid += result.reward is not None and reward is None
        return with_invalid({"text": text, "reward": reward, "metrics": metrics, "error": None}, invalid)

    @app.post("/instances/{instance_id}/reward")
    async def reward(instance_id: str) -> dict[str, Any]:
        live = host.instance(instance_id)
        async with host.using(live):
            value, error = await host.call(live.tool, "reward", lambda: host.tools[live.tool].reward(live.tool_id))
        reward = finite_number(value, REWARD_LIMIT)
        return with_invalid({"reward": reward, "error": error}, int(value is not None and reward is None))

    @app.delete("/instances/{instance_id}")
    async def release(instance_id: str) -> dict[str, Any]:
        if instance_id in host.creating:  # its create releases it once the tool has made it
            host.creating[instance_id].released = True
            return {"error": None}
        live = host.instances.pop(instance_id, None) or host.instance(instance_id)  # 404 if unknown
        if live.busy:  # a call its client gave up on still runs (being cancelled): it releases when it ends
            live.release_pending = True
            return {"error": None}
        _, error = await host.call(live.tool, "release", lambda: host.tools[live.tool].release(live.tool_id))
        return {"error": error}


def with_invalid(answer: dict[str, Any], invalid: int) -> dict[str, Any]:
    """The answer, with the count of the values dropped from it when there are any."""
    return {**answer, "invalid": invalid} if invalid else answer


def capped_text(value: Any, max_chars: int) -> str:
    """A result's text (as_text: also escaping lone surrogates, which JSON cannot carry), cut to
    `max_chars` before the rest is converted or encoded: a 200 MB output would hold the server's
    event loop, and every other call, for as long as that takes."""
    if isinstance(value, str):
        value = value[: max_chars + 1]
    elif isinstance(value, (bytes, bytearray)):
        value = value[: 4 * (max_chars + 1)]  # UTF-8: at most 4 bytes a character
    text = as_text(value)
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[output cut to {max_chars} characters by the tool server]"


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
    where = ".".join(str(part) for part in first["loc"])
    return JSONResponse({"detail": f"invalid request: {where}: {first['msg']}"}, status_code=422)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # The traceback goes to the server's log (uvicorn prints it), never to the client. Starlette
    # answers this outside the Guard middleware, so the 500 is counted here.
    request.app.state.host.responses[500] += 1
    return JSONResponse({"detail": f"internal server error ({type(exc).__name__})"}, status_code=500)


def serve(path: str, host: str, port: int, settings: ServerSettings) -> None:
    """Load the tool file (ConfigError if bad) and serve it until interrupted."""
    import uvicorn

    from agentrl.tools.loader import close_tools, load_tools

    tools = load_tools(path)
    try:
        app = create_app(tools, settings)
        names = ", ".join(tool_name(t) for t in tools)
        print(f"agentrl: serving {len(tools)} tool(s) from {path} ({names}) on http://{host}:{port}", file=sys.stderr)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        # Not uvicorn.run: its loop's default executor is a plain thread pool, and on Ctrl-C the loop's
        # closing waited, with no limit, for a plug-in's `asyncio.to_thread` call that hangs.
        run_with_daemon_threads(server.serve())
    finally:  # a tool's own resources (an MCP server's process, a remote source's connections)
        close_tools(tools)
