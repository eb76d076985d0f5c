"""Tools from an MCP server (a stdio command or a Streamable HTTP URL), through the `mcp` SDK.

    tools:
      - class: agentrl.tools.mcp:MCPTools
        config: {command: [python, servers/search.py], allow: [search], env: {API_KEY: "${SEARCH_KEY}"}}
      - class: agentrl.tools.mcp:MCPTools
        config: {url: "https://host/mcp", allow: [fetch], headers: {Authorization: "Bearer ${FETCH_TOKEN}"}}

Only the tools named in `allow` reach the model; a name the server does not offer is a
ConfigError when the file loads. Each allowed tool's MCP description and input schema become an
OpenAI function schema (JSON-Schema `title` annotations dropped: they cost prompt tokens and say
nothing the property names do not). A result's text blocks are joined; a result flagged as an
error raises MCPToolError, which ToolEnv reports to the model. `${NAME}` in a value of `env` (a
stdio server's environment, merged over the SDK's minimal one) or `headers` (an HTTP server's
request headers) is the environment variable NAME, so secrets stay out of the file; an unset one is
an error naming it, and so is a header value an HTTP request cannot carry (a newline from a secret
read from a file), without showing the value. Error messages show no header value, nor any value
taken from the environment.

Session lifetime: one MCP session per tool-file entry, for the whole run. The SDK's session is a
set of anyio task groups bound to the event loop and the task that entered them, while the
rollout runs every step under a fresh event loop. A session per event loop would restart a
stdio server (losing its state) every step and leave sessions to be closed from loops that are
already gone, so the session lives instead in one task on a BackgroundLoop thread, entered and
exited there; episodes of every step submit calls to it concurrently (MCP multiplexes requests by
id). `close()`, or the exit hook, ends that task, which closes the session and stops the server.

A session that ends (a stdio server that exits, an HTTP server that restarts or drops the
connection) fails the calls in flight, and the next call opens a new one, with a warning: a run of
hours should not lose a tool for good to one blip. Attempts that fail back off (1 s, doubling to
60 s), and calls meanwhile fail at once, saying when the next attempt is due. A restarted stdio
server has lost whatever state it kept. `reconnect: false` keeps a closed session closed.

A stdio server's messages are read a line at a time, each at most MAX_MESSAGE_MB (64 MB): at a
longer one (a runaway tool's output) the session ends, reading no further, so the calls in flight
fail at once saying so, and the next call reconnects.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import contextlib
import functools
import inspect
import json
import os
import re
import shlex
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from agentrl.tools.background_loop import BackgroundLoop
from agentrl.tools.base import Tool, ToolResult
from agentrl.tools.loader import url_shown
from agentrl.tools.remote import seconds_problem, unsendable

# Maps keyed by property (or definition) name, whose keys are never annotations: a property called
# "title" stays. dependentRequired's values are name lists, which the walk leaves as they are.
_NAMED_SCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentRequired", "dependentSchemas",
                  "dependencies"}
_DATA = {"default", "enum", "const", "examples"}  # values, not schemas: left as they are
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.IGNORECASE)
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0
MAX_MESSAGE_MB = 64.0  # the longest line read from a stdio server


class MCPToolError(RuntimeError):
    """An MCP tool call that failed or that the server flagged as an error."""


class MCPTools:
    """An MCP server as one tool-file entry; `tools()` gives one Tool per allowed server tool."""

    def __init__(self, allow: list[str], command: list[str] | str | None = None, url: str | None = None,
                 env: dict[str, str] | None = None, headers: dict[str, str] | None = None, cwd: str | None = None,
                 timeout_s: float = 30.0, connect_timeout_s: float = 30.0, reconnect: bool = True):
        if (command is None) == (url is None):
            raise ValueError("give exactly one of 'command' (a stdio server) and 'url' (Streamable HTTP)")
        if not isinstance(allow, list) or not allow or not all(isinstance(n, str) for n in allow):
            raise ValueError("'allow' must be a non-empty list of tool names")
        if url is not None and env is not None:
            raise ValueError("'env' sets a stdio server's environment; an HTTP server ('url') takes 'headers'")
        if command is not None and headers is not None:
            raise ValueError("'headers' go with an HTTP server ('url'); a stdio server ('command') takes 'env'")
        for key, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            problem = seconds_problem(key, value)
            if problem:
                raise ValueError(problem)
        self.label = url_shown(url) if url is not None else command if isinstance(command, str) else shlex.join(command)
        self.timeout_s, self.connect_timeout_s, self.reconnect = timeout_s, connect_timeout_s, reconnect
        if url is not None:
            self._server: Any = (url, _expanded(headers, "headers"))
        else:
            self._server = _stdio(command, _expanded(env, "env"), cwd)
        self._hidden = _secrets(headers, env)
        self._client: Any = None
        self._cut: Any = None  # the client whose session ended at a message over MAX_MESSAGE_MB
        self._holder: asyncio.Task[None] | None = None  # the task that owns the session, and its stop
        self._stop: asyncio.Event | None = None
        self._failure = "not connected yet"
        self._backoff_s, self._next_attempt = FIRST_BACKOFF_S, 0.0
        self._attempt: asyncio.Task[Any] | None = None  # the reconnection under way, shared by every call
        self._loop = BackgroundLoop("agentrl-mcp")
        self._loop.on_close(lambda: self._end_session())
        waiting_for = "session"
        try:  # (the loop's own wait is a backstop, should the cancellation at connect_timeout_s hang)
            self._loop.run_sync(asyncio.wait_for(self._connect(), connect_timeout_s), connect_timeout_s + 5)
            waiting_for = "tool list"
            offered = self._loop.run_sync(self._list_tools(), connect_timeout_s)
        except Exception as e:
            self.close()
            timed_out = isinstance(e, (asyncio.TimeoutError, concurrent.futures.TimeoutError))
            reason = f"no {waiting_for} within {connect_timeout_s:g} s" if timed_out else _describe(e, self._hidden)
            raise ValueError(f"cannot reach the MCP server {self.label}: {reason}") from None
        missing = [name for name in allow if name not in offered]
        if missing:
            self.close()
            raise ValueError(f"allow-list names '{missing[0]}', which the MCP server {self.label} does not offer "
                             f"(it offers: {', '.join(sorted(offered)) or 'nothing'})")
        self._members = [MCPTool(self, offered[name]) for name in allow]

    def tools(self) -> list[Tool]:
        return list(self._members)

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call a server tool from any event loop; its text, or MCPToolError."""
        return await self._loop.run(self._call(name, arguments))

    def close(self) -> None:
        self._loop.close()

    async def _connect(self) -> None:
        """Open a session in a task of its own (`_hold`) and wait until it is ready or has failed."""
        stop = asyncio.Event()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        holder = asyncio.create_task(self._hold(ready, stop))
        self._holder, self._stop = holder, stop
        try:
            await ready
        except BaseException:
            holder.cancel()
            raise
        self._failure = "not connected yet"

    async def _hold(self, ready: asyncio.Future[None], stop: asyncio.Event) -> None:
        """Owns one session: enters it, waits for its stop, exits it, all in this one task."""
        from contextlib import AsyncExitStack

        from mcp import Client

        client = None
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    Client(await self._transport(stack, stop), read_timeout_seconds=self.timeout_s))
                self._client = client
                ready.set_result(None)
                await stop.wait()
        except Exception as e:
            if client is None or self._client is client:
                self._failure = _describe(e, self._hidden)
            if not ready.done():
                ready.set_exception(e)
        finally:
            if client is not None and self._client is client:  # a newer session is not this one's to clear
                self._client = None
                if not stop.is_set() and self._failure == "not connected yet":
                    self._failure = "the session ended"

    async def _transport(self, stack: Any, stop: asyncio.Event) -> Any:
        """What `Client` connects to: a stdio transport, the URL, or (with headers) an HTTP
        transport on a client that sends them."""
        if not isinstance(self._server, tuple):
            lines = functools.partial(_LineReader, max_bytes=int(MAX_MESSAGE_MB * 2**20),
                                      too_long=lambda: self._cut_session(stop))
            # The server's stderr goes to the process's own. The SDK's default is whatever
            # sys.stderr was when it was imported, a stream that may be closed since (a capture).
            return _stdio_client(lines)(self._server, errlog=sys.__stderr__ or sys.stderr)
        url, headers = self._server
        if not headers:
            return url
        import httpx2  # the mcp SDK's HTTP client
        from mcp.client.streamable_http import streamable_http_client

        http = await stack.enter_async_context(httpx2.AsyncClient(
            headers=headers, timeout=httpx2.Timeout(self.connect_timeout_s, read=max(300.0, self.timeout_s))))
        return streamable_http_client(url, http_client=http)

    def _cut_session(self, stop: asyncio.Event) -> None:
        """Ends the session `stop` stops, at a message over MAX_MESSAGE_MB: its calls in flight
        fail now, instead of at their timeout, and the next call reconnects."""
        if self._stop is stop and self._client is not None:
            self._cut, self._client = self._client, None
            self._failure = f"it sent a message of more than {MAX_MESSAGE_MB:g} MB"
        stop.set()

    def _end_session(self) -> Any:
        """A coroutine that ends the session open now (not whichever is open when it runs)."""
        holder, stop = self._holder, self._stop

        async def end() -> None:
            if holder is not None and stop is not None:
                stop.set()
                await asyncio.wait({holder}, timeout=10)

        return end()

    async def _list_tools(self) -> dict[str, dict[str, Any]]:
        schemas, cursor = {}, None
        for _ in range(100):  # pages; a server that pages forever cannot hang loading
            page = await self._client.list_tools(cursor=cursor)
            for t in page.tools:
                schemas[t.name] = {"type": "function", "function": {
                    "name": t.name, "description": inspect.cleandoc(t.description or ""),
                    "parameters": _without_titles(t.input_schema or {"type": "object", "properties": {}})}}
            cursor = page.next_cursor
            if cursor is None:
                break
        return schemas

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        from mcp import MCPError

        client = self._client
        if client is None:
            client = await self._reconnected()
        try:
            result = await client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s)
        except MCPError as e:  # the server exited (or dropped the session): say which one
            if not _session_gone(e):
                raise
            if self._cut is client:
                raise MCPToolError(f"the MCP server {self.label} sent a message of more than {MAX_MESSAGE_MB:g} MB "
                                   "(the most read from a stdio server), so its session was ended"
                                   + ("; the next call reconnects" if self.reconnect else ", and it is not restarted")
                                   ) from None
            if self._client is client:  # the first call to see it ends the session; the next reconnects
                self._client, self._failure = None, "it closed the connection"
                self._ending = asyncio.create_task(self._end_session())  # in the background: this call answers now
            raise MCPToolError(f"the MCP server {self.label} closed the connection: it exited or dropped the session"
                               + ("; the next call reconnects" if self.reconnect else ", and it is not restarted")
                               ) from None
        self._backoff_s = FIRST_BACKOFF_S  # a call went through: the next failure retries at once
        parts = [_block_text(block) for block in result.content]
        if not parts and result.structured_content is not None:
            parts.append(json.dumps(result.structured_content, ensure_ascii=False))
        text = "\n".join(parts)
        if result.is_error:
            raise MCPToolError(text or f"{name} reported an error")
        return text

    async def _reconnected(self) -> Any:
        """A new session for a call that found none, or MCPToolError saying why there is none. One
        attempt at a time, shared: a call cancelled by its own timeout leaves the attempt running
        (shielded) for the calls after it, and its failure still sets the backoff."""
        if not self.reconnect:
            raise MCPToolError(f"the MCP server {self.label} is not connected ({self._failure})")
        if self._attempt is None:
            wait_s = self._next_attempt - time.monotonic()
            if wait_s > 0:
                raise MCPToolError(f"the MCP server {self.label} is not connected ({self._failure}); "
                                   f"the next attempt to reconnect is in {wait_s:.0f} s")
            self._attempt = asyncio.create_task(self._reconnect())
            # read, so an attempt whose callers all gave up logs no "exception was never retrieved"
            self._attempt.add_done_callback(lambda task: task.cancelled() or task.exception())
        return await asyncio.shield(self._attempt)

    async def _reconnect(self) -> Any:
        cause = self._failure
        try:
            await self._end_session()
            try:
                await asyncio.wait_for(self._connect(), self.connect_timeout_s)
            except Exception as e:
                self._failure = (f"no session within {self.connect_timeout_s:g} s"
                                 if isinstance(e, asyncio.TimeoutError) else _describe(e, self._hidden))
                self._next_attempt = time.monotonic() + self._backoff_s
                self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)
                raise MCPToolError(f"the MCP server {self.label} is not connected ({cause}), and reconnecting failed "
                                   f"({self._failure}); the next attempt is in {self._next_attempt - time.monotonic():.0f} s"
                                   ) from None
        finally:
            self._attempt = None
        print(f"agentrl: warning: reconnected to the MCP server {self.label} ({cause}); a restarted server has "
              "lost any state it kept", file=sys.stderr)
        return self._client


class MCPTool:
    """One allowed tool of an MCP server; stateless per episode (any state is the server's)."""

    def __init__(self, source: MCPTools, schema: dict[str, Any]):
        self.source, self.schema = source, schema
        self.name: str = schema["function"]["name"]

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(await self.source.call(self.name, arguments))

    async def reward(self, instance_id: str) -> float | None:
        return None

    async def release(self, instance_id: str) -> None:
        return None


def _block_text(block: Any) -> str:
    """One content block of a result as the model reads it: text as is, an embedded text resource
    as its text, a resource link or binary resource by its URI, anything else (an image) named."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return block.text
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        return text if isinstance(text, str) else f"[binary resource {resource.uri} omitted]"
    if kind == "resource_link":
        return f"[resource {block.uri}]"
    return f"[{kind} content omitted]"


def _expanded(values: dict[str, str] | None, key: str) -> dict[str, str] | None:
    """`env` or `headers` with each `${NAME}` replaced by the environment variable NAME."""
    if values is None:
        return None
    if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
        raise ValueError(f"'{key}' must map names to strings")

    def value_of(match: re.Match[str], name: str) -> str:
        variable = match.group(1)
        if variable not in os.environ:
            raise ValueError(f"{key}.{name} names the environment variable {variable}, which is not set")
        return os.environ[variable]

    expanded = {name: _VARIABLE.sub(lambda m, name=name: value_of(m, name), value) for name, value in values.items()}
    for name, value in expanded.items() if key == "headers" else ():
        problem = _header_problem(value)
        if problem:  # else the HTTP client refuses it later, quoting the value in its message
            raise ValueError(f"headers.{name}: {problem}")
    return expanded


def _header_problem(value: str) -> str | None:
    """Why `value` cannot be sent as an HTTP header value, without showing it; None when it can."""
    found = unsendable(value, spaces_inside=True)
    if found is None:
        return None
    position, kind = found
    return (f"its value has {kind} at position {position} of {len(value)}, which a header cannot hold (only "
            "printable ASCII, spaces only inside; a secret made from a file often ends in a newline)")


def _secrets(headers: dict[str, str] | None, env: dict[str, str] | None) -> tuple[str, ...]:
    """What error messages must not show: header values and values taken from the environment, as
    they are and as a repr (bytes in a message) writes them, longest first. Values under 4 characters
    are left: no secret, and hiding them would garble every message that contains them."""
    found: set[str] = set()
    for values, whole in ((headers, True), (env, False)):  # an env value may be a plain setting
        for value in (values or {}).values():
            taken = [os.environ.get(m.group(1), "") for m in _VARIABLE.finditer(value)]
            if whole:
                taken.append(_VARIABLE.sub(lambda m: os.environ.get(m.group(1), ""), value))
            for secret in taken:
                found.update({secret, secret.strip(), repr(secret)[1:-1]})
    return tuple(sorted((v for v in found if len(v) >= 4), key=len, reverse=True))


def _stdio(command: list[str] | str | None, env: dict[str, str] | None, cwd: str | None) -> Any:
    from mcp import StdioServerParameters

    argv = shlex.split(command) if isinstance(command, str) else list(command or [])
    if not argv:
        raise ValueError("'command' is empty")
    # "replace": the SDK's strict decoding drops everything a server prints after one byte that is
    # not UTF-8 (a library's stray print), and every later call hangs until its timeout.
    return StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=cwd, encoding_error_handler="replace")


class _LineReader:
    """A stdio server's stdout as the SDK's reader takes it (text with whole lines in it), read
    as a list of the pieces of the line that has not ended yet, joined once at its newline. The
    SDK's own reader joins what it holds to every piece that comes and splits the lot again: a
    message of 64 MB took half a minute, and every other call to the server waited behind it. A
    line longer than `max_bytes` is not read further: `too_long()` ends the session, and the
    stream ends."""

    def __init__(self, stdout: Any, encoding: str = "utf-8", errors: str = "strict", *, max_bytes: int,
                 too_long: Callable[[], None]):
        self._stdout, self._decoder = stdout, codecs.getincrementaldecoder(encoding)(errors=errors)
        self._max_bytes, self._too_long = max_bytes, too_long
        self._pieces: list[bytes] = []
        self._size = 0

    def __aiter__(self) -> _LineReader:
        return self

    async def __anext__(self) -> str:
        import anyio

        while True:
            try:
                chunk = await self._stdout.receive()
            except anyio.EndOfStream:  # a last line without its newline is no message
                raise StopAsyncIteration from None
            *ends, rest = chunk.split(b"\n")
            lines = []
            for piece in ends:
                if self._size + len(piece) > self._max_bytes:
                    break
                lines.append(b"".join([*self._pieces, piece]))
                self._pieces, self._size = [], 0
            else:
                self._pieces.append(rest)
                self._size += len(rest)
            if len(lines) < len(ends) or self._size > self._max_bytes:
                self._pieces, self._size = [], 0
                self._too_long()
                raise StopAsyncIteration
            if lines:
                return self._decoder.decode(b"\n".join(lines) + b"\n")


def _stdio_client(reader: Callable[..., Any]) -> Any:
    """The SDK's `stdio_client`, reading the server's stdout through `reader(stdout, encoding=...,
    errors=...)` where it takes anyio's TextReceiveStream: the same code under a copy of its
    module's names with that one replaced, so that nothing else using the SDK is changed, and its
    handling of the server process (spawning, draining, stopping) is kept as it is. An SDK whose
    stdio client is built otherwise is used as it is, with a warning: no cap, and its own reader."""
    from mcp.client import stdio

    inner = getattr(stdio.stdio_client, "__wrapped__", None)
    if inner is None or not any("TextReceiveStream" in getattr(code, "co_names", ())
                                for code in inner.__code__.co_consts):
        _warn_once("agentrl: warning: this version of the mcp SDK reads stdio servers its own way: their "
                   f"messages are read without agentrl's line reader and its {MAX_MESSAGE_MB:g} MB cap")
        return stdio.stdio_client
    names = {**vars(stdio), "TextReceiveStream": reader}
    copy = types.FunctionType(inner.__code__, names, inner.__name__, inner.__defaults__, inner.__closure__)
    copy.__kwdefaults__ = inner.__kwdefaults__
    return contextlib.asynccontextmanager(copy)


@functools.cache
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr)


def _without_titles(schema: Any) -> Any:
    """A JSON Schema without `title` annotations; property *names* called "title" are kept."""
    if isinstance(schema, list):
        return [_without_titles(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key in _DATA:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _without_titles(sub) for name, sub in value.items()}
        else:
            out[key] = _without_titles(value)
    return out


def _session_gone(error: Any) -> bool:
    """Whether an MCPError says the session is over: the connection closed (a stdio server that
    exited), or a server that no longer knows the session (an HTTP server restarted: 404)."""
    from mcp.types import CONNECTION_CLOSED, INVALID_REQUEST

    return error.code == CONNECTION_CLOSED or (error.code == INVALID_REQUEST and "session" in str(error).lower())


def _describe(error: BaseException, hidden: tuple[str, ...] = ()) -> str:
    """One line for an error, looking inside the exception groups anyio raises; URLs in it keep no
    password or query string (where tokens travel), as the server's label keeps none, and each of
    `hidden` (the secrets of the config) is shown as '***'."""
    while getattr(error, "exceptions", None):  # BaseExceptionGroup, without needing Python 3.11
        error = error.exceptions[0]
    text = f"{type(error).__name__}: {error}"
    for secret in hidden:
        text = text.replace(secret, "***")
    return _URL.sub(lambda m: url_shown(m.group(0)), text)
