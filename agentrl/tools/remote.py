"""Tools served by `agentrl tools serve` elsewhere, used as if they were local.

One tool-file entry pulls one, some or all of a server's tools (their schemas are fetched when the
file loads, so a wrong URL, token or tool name stops the run before it starts):

    tools:
      - class: agentrl.tools.remote:RemoteTools
        config: {url: "http://10.0.0.5:8765", token_env: AGENTRL_TOOL_TOKEN, tools: [python]}

Calls go through httpx, each attempt bounded by `connect_timeout_s` + `timeout_s` from connecting
to the answer's last byte (httpx's timeouts are per read: a server trickling its answer would hold
a call, or the load, forever), with retries and exponential backoff on connection failures and 5xx
answers (the server answers a failing tool with 200 and an error, so a 5xx means the server
itself, or a proxy before it, failed). A tool call is not repeatable: it is
sent again only after an error that proves it never left (a refused connection, a connect
timeout), or a 503. A connection that broke after sending it, a read timeout or another 5xx may
come after the tool ran, and running it twice could repeat its effect (a payment, a file
written). A 4xx (or a 3xx: redirects are not followed), a tool error, retries running out, an
answer that is not the JSON object the server's API defines, or one longer than `max_response_mb`
(read no further, and asked for uncompressed: a runaway tool's output costs no memory beyond the
cap, unless a proxy compresses all the same) raise RemoteToolError, which ToolEnv turns into an
error message for the model. The client names each instance it creates, so a create is retried
like any repeatable call, and one that got no answer or was cancelled (ToolEnv's timeout) is
released anyway: the server may have made it after all. A release sent again that finds its
instance unknown (404) succeeded: an attempt before it got there.

The constructor only checks its arguments; the connection opens at the first `tools()` (which the
loader calls while it loads the file), so the loader's own checks of the entry, a `schema` key it
does not take, come first and a mistake in the file is not hidden behind a server that is down.
The httpx connection pool lives on a BackgroundLoop (see there why: every rollout step runs under a
new event loop), closed by `close()` or at exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import uuid
from typing import Any

import httpx

from agentrl.tools.background_loop import BackgroundLoop
from agentrl.tools.base import Tool, ToolResult
from agentrl.tools.loader import url_shown

RETRY_STATUS = range(500, 600)
# Connection errors after which a request may have been delivered (the server closed or reset the
# connection while the answer was due): retried only for a repeatable call.
MAYBE_SENT_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# A tool call is not idempotent: after a 500 from the server or a 502/504 from a proxy in front of
# it, the tool may already have run, and running it again could repeat its effect. Only 503 (the
# server refusing before any work) is retried for it.
NOT_RUN_STATUS = (503,)


class RemoteToolError(RuntimeError):
    """A remote call that failed: the server refused it, the tool failed, or the server is gone.
    `refused`: the server answered that it did nothing (a 4xx), and no earlier attempt got there."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


MAX_SECONDS = 86_400.0  # a day; past threading.TIMEOUT_MAX (~292 years) a thread's wait raised OverflowError


def seconds_problem(key: str, value: float, zero_allowed: bool = False) -> str | None:
    """Why `value` cannot be the config key `key`'s seconds (a timeout, a backoff), or None."""
    if math.isfinite(value) and (value >= 0 if zero_allowed else value > 0) and value <= MAX_SECONDS:
        return None
    return (f"'{key}' must be a finite number of seconds {'(0 or more)' if zero_allowed else 'above 0'} "
            f"and at most {MAX_SECONDS:g}, not {value}")


class RemoteTools:
    """A tool server as one tool-file entry; `tools()` gives one Tool per selected remote tool."""

    def __init__(self, url: str, token: str | None = None, token_env: str | None = None,
                 tools: list[str] | None = None, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 retries: int = 3, backoff_s: float = 0.25, max_response_mb: float = 16.0):
        if (token is None) == (token_env is None):
            raise ValueError("give exactly one of 'token' and 'token_env' (the name of a variable holding it)")
        if token_env is not None:
            token = os.environ.get(token_env)
            if not token:
                raise ValueError(f"environment variable '{token_env}' (token_env) is not set")
        problem = token_problem(token)
        if problem:
            raise ValueError(f"{'the variable ' + repr(token_env) if token_env else 'token'}: {problem}")
        if retries < 0:
            raise ValueError(f"'retries' must be 0 or more (0: one attempt, no retry), not {retries}")
        if not max_response_mb > 0:
            raise ValueError(f"'max_response_mb' must be more than 0, not {max_response_mb}")
        for key, value, zero_allowed in (("timeout_s", timeout_s, False),
                                         ("connect_timeout_s", connect_timeout_s, False), ("backoff_s", backoff_s, True)):
            problem = seconds_problem(key, value, zero_allowed)
            if problem:
                raise ValueError(problem)
        self.url, self.retries, self.backoff_s = url.rstrip("/"), retries, backoff_s
        self.shown = url_shown(self.url)  # what messages show: no password or query string
        self.max_response_bytes = int(max_response_mb * 2**20)
        self._wanted, self._token = tools, token
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.attempt_s = connect_timeout_s + timeout_s  # connecting, then the whole answer
        self._loop: BackgroundLoop | None = None
        self._members: list[Tool] | None = None

    def tools(self) -> list[Tool]:
        """The selected tools; the first call connects and fetches their schemas."""
        if self._members is None:
            self._members = self._open()
        return list(self._members)

    def _open(self) -> list[Tool]:
        self._loop = BackgroundLoop("agentrl-remote-tools")
        # identity: a compressed answer is decoded a network chunk at a time, and one chunk of a
        # gzip bomb is megabytes past max_response_mb before the cap is checked
        headers = {"Authorization": f"Bearer {self._token}", "Accept-Encoding": "identity"}
        self._client: httpx.AsyncClient = self._loop.run_sync(_open_client(self.url, headers, self._timeout))
        self._loop.on_close(self._client.aclose)
        # Each attempt has its limit; this one is for the whole load, backoff included, should a
        # wait the attempts' limits do not cover (a name lookup) hang it.
        deadline_s = (self.retries + 1) * self.attempt_s + self.backoff_s * (2 ** self.retries - 1) + 5
        try:
            offered = _schemas(self._loop.run_sync(self._request("GET", "/tools"), deadline_s))
        except Exception as e:
            self.close()
            if isinstance(e, concurrent.futures.TimeoutError):
                e = RemoteToolError(f"no answer within {deadline_s:g} s")
            reason = str(e) if isinstance(e, RemoteToolError) else _what(e)
            raise RemoteToolError(reason if reason.startswith(self.shown) else f"{self.shown}/tools: {reason}") \
                from None
        return _select(offered, self._wanted, self.shown, self)

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                      repeatable: bool = True) -> dict[str, Any]:
        """One API call from any event loop; retried on connection errors, and on 5xx when it is
        `repeatable` (when not, a tool call, only on errors before sending it and on 503)."""
        assert self._loop is not None, "tools() opens the connection"
        return await self._loop.run(self._request(method, path, body, repeatable))

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                       repeatable: bool = True) -> dict[str, Any]:
        problem, reached = "", False  # reached: an earlier attempt may have got to the server
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, content = await asyncio.wait_for(self._send(method, path, body), self.attempt_s)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never sent: safe to send again
                problem = _what(e)
                continue
            except MAYBE_SENT_ERRORS as e:
                # A connection dropped while the answer was due (a proxy's idle timeout, a worker
                # restart): the request may have been delivered, so a refusal after it does not prove
                # nothing ran, and a tool call is not sent again.
                if not repeatable:
                    raise RemoteToolError(f"the connection broke before the answer came ({_what(e)}); "
                                          "the tool may have run, so the call was not sent again") from None
                problem, reached = _what(e), True
                continue
            except httpx.TimeoutException as e:
                raise RemoteToolError(f"{method} {path}: no answer ({type(e).__name__})") from None
            except asyncio.TimeoutError:  # wait_for's: the answer came, but too slowly
                raise RemoteToolError(f"{method} {path}: no complete answer within {self.attempt_s:g} s "
                                      "(connect_timeout_s + timeout_s)") from None
            if status in (RETRY_STATUS if repeatable else NOT_RUN_STATUS):
                problem, reached = f"HTTP {status}: {_detail(content)}", True
                continue
            if method == "DELETE" and status == 404 and reached:  # an earlier attempt released it after all
                return {"error": None}
            if not 200 <= status < 300:  # a redirect did nothing either: it is not followed, a tool call not sent on
                raise RemoteToolError(f"HTTP {status}: {_detail(content)}", refused=status < 500 and not reached)
            reply = _json(content)
            if not isinstance(reply, dict):
                raise RemoteToolError(f"{method} {path}: HTTP {status} with an answer that is no JSON object: "
                                      f"{_start(content)}")
            return reply
        raise RemoteToolError(f"{self.shown}{path}: {problem} (after {self.retries + 1} attempts)")

    async def _send(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
        """One attempt: the status and the body, read up to the size cap."""
        async with self._client.stream(method, path, json=body) as response:
            content = bytearray()
            async for chunk in response.aiter_bytes():
                content += chunk
                if len(content) > self.max_response_bytes:
                    raise RemoteToolError(f"{method} {path}: the answer is longer than "
                                          f"{self.max_response_bytes / 2**20:g} MB (max_response_mb); "
                                          "it was not read further")
            return response.status_code, bytes(content)

    def release_later(self, path: str) -> None:
        """Send `DELETE path` without waiting for it (an instance whose create failed on the way);
        whatever the answer, the server's instance expiry is the fallback."""
        async def release() -> None:
            try:
                await self._request("DELETE", path)
            except Exception:  # unknown there (it never arrived), or the connection is gone
                pass

        self._loop.submit(release())

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()


class RemoteTool:
    """One remote tool; maps this process's instance ids to the server's."""

    def __init__(self, source: RemoteTools, schema: dict[str, Any]):
        self.source, self.schema = source, schema
        self.name: str = schema["function"]["name"]
        self._remote_ids: dict[str, str] = {}

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        remote = uuid.uuid4().hex
        try:
            reply = await self.source.request("POST", "/instances", {"tool": self.name, "kwargs": kwargs,
                                                                     "instance_id": remote})
        except BaseException as e:  # no answer, or cancelled: it may exist on the server all the same
            if not (isinstance(e, RemoteToolError) and e.refused):
                self.source.release_later(f"/instances/{remote}")
            raise
        _raise_for(reply)  # a create the tool failed: the server freed what it made
        try:
            self._remote_ids[instance_id] = _field(reply, "instance_id", str)
        except RemoteToolError:  # an answer of the wrong shape, to a create that may have happened
            self.source.release_later(f"/instances/{remote}")
            raise
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        reply = await self.source.request("POST", f"/instances/{self._remote(instance_id)}/execute",
                                          {"arguments": arguments}, repeatable=False)
        _raise_for(reply)
        # reward and metrics are checked by ToolEnv like a local tool's (a bad one is dropped and
        # counted), and so are those the server dropped already
        return ToolResult(_field(reply, "text", str), reply.get("reward"), reply.get("metrics") or {},
                          dropped=_invalid(reply))

    async def reward(self, instance_id: str) -> float | None:
        reply = await self.source.request("POST", f"/instances/{self._remote(instance_id)}/reward")
        _raise_for(reply)
        return math.nan if _invalid(reply) else reply.get("reward")  # one the server dropped, for ToolEnv to count

    async def release(self, instance_id: str) -> None:
        remote = self._remote_ids.pop(instance_id, None)
        if remote is not None:
            _raise_for(await self.source.request("DELETE", f"/instances/{remote}"))

    def _remote(self, instance_id: str) -> str:
        if instance_id not in self._remote_ids:
            raise RemoteToolError(f"instance '{instance_id}' of {self.name} was never created")
        return self._remote_ids[instance_id]


async def _open_client(url: str, headers: dict[str, str], timeout: httpx.Timeout) -> httpx.AsyncClient:
    # No cap on connections: with httpx's default of 100, the calls of a large rollout (64 episodes
    # of up to 4 calls each) queued for one inside their attempt's time, and failed as timeouts
    # after the tool had run. How many calls run at once is the rollout's, and the server's, to bound.
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))


def _schemas(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool schemas of a `GET /tools` answer, each with a function name to select it by."""
    offered = _field(reply, "tools", list)
    for i, schema in enumerate(offered):
        function = schema.get("function") if isinstance(schema, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise RemoteToolError(f"the server's tool #{i + 1} is no schema with a function name: "
                                  f"{_start(json.dumps(schema))}")
    return offered


def _select(offered: list[dict[str, Any]], wanted: list[str] | None, url: str, source: RemoteTools) -> list[Tool]:
    by_name = {schema["function"]["name"]: schema for schema in offered}
    if wanted is None:
        return [RemoteTool(source, schema) for schema in offered]
    missing = [name for name in wanted if name not in by_name]
    if missing:
        source.close()
        raise ValueError(f"{url} has no tool '{missing[0]}' (it has: {', '.join(sorted(by_name)) or 'none'})")
    return [RemoteTool(source, by_name[name]) for name in wanted]


def _raise_for(reply: dict[str, Any]) -> None:
    if reply.get("error"):
        raise RemoteToolError(str(reply["error"]))


def _field(reply: dict[str, Any], key: str, kind: type) -> Any:
    """`reply[key]`, which the server's API says is a `kind`."""
    value = reply.get(key)
    if not isinstance(value, kind):
        raise RemoteToolError(f"the server's answer has no {kind.__name__} '{key}': {_start(json.dumps(reply))}")
    return value


def _invalid(reply: dict[str, Any]) -> int:
    """How many of the tool's values the server dropped (an older server sends no count)."""
    count = reply.get("invalid", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 100_000:
        raise RemoteToolError(f"the server's answer has no count 'invalid' from 0 to 100000: "
                              f"{_start(json.dumps(reply))}")
    return count


def unsendable(value: str, spaces_inside: bool = False) -> tuple[int, str] | None:
    """The first character of `value` that an HTTP header cannot carry, as (its position from 1,
    what it is), without showing the value; None when it can be sent. A bearer token is printable
    ASCII with no space; another header value (`spaces_inside`) may hold spaces and tabs inside."""
    def fits(i: int, c: str) -> bool:
        if spaces_inside and c in " \t":
            return 0 < i < len(value) - 1
        return "!" <= c <= "~"

    bad = next((i for i, c in enumerate(value) if not fits(i, c)), None)
    if bad is None:
        return None
    return bad + 1, "a newline" if value[bad] in "\r\n" else "a space" if value[bad].isspace() else "a character"


def token_problem(token: str) -> str | None:
    """Why `token` cannot be sent as a bearer token, without showing it; None when it can. An HTTP
    client would refuse the header with its value in the message."""
    found = unsendable(token)
    if found is None:
        return None
    position, kind = found
    return (f"the token has {kind} at position {position} of {len(token)}, which a bearer token cannot hold "
            "(only printable ASCII; a secret made from a file often ends in a newline)")


def _what(error: Exception) -> str:
    """'Type: message', or the type alone for errors without one (httpx's ReadError on a reset)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's limit
        return None


def _start(content: bytes | str) -> str:
    """The start of an answer, for a message."""
    text = content.decode(errors="replace") if isinstance(content, bytes) else content
    return text[:200] + ("..." if len(text) > 200 else "")


def _detail(content: bytes) -> str:
    """The server's `detail` (FastAPI's error body), else the start of whatever a proxy answered."""
    body = _json(content)
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return content.decode(errors="replace")[:200]
