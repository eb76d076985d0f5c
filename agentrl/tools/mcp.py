"""Tools from an MCP server (a stdio command or a Streamable HTTP URL), through the `mcp` SDK.

    tools:
      - class: agentrl.tools.mcp:MCPTools
        config: {command: [python, servers/search.py], allow: [search]}   # or url: http://host/mcp

Only the tools named in `allow` reach the model; a name the server does not offer is a
ConfigError when the file loads. Each allowed tool's MCP description and input schema become an
OpenAI function schema (JSON-Schema `title` annotations dropped: they cost prompt tokens and say
nothing the property names do not). A result's text blocks are joined; a result flagged as an
error raises MCPToolError, which ToolEnv reports to the model.

Session lifetime: one MCP session per tool-file entry, for the whole run. The SDK's session is a
set of anyio task groups bound to the event loop and the task that entered them, while the
rollout runs every step under a fresh event loop. A session per event loop would restart a
stdio server (losing its state) every step and leave sessions to be closed from loops that are
already gone, so the session lives instead in one task on a BackgroundLoop thread, entered and
exited there; episodes of every step submit calls to it concurrently (MCP multiplexes requests by
id). `close()`, or the exit hook, ends that task, which closes the session and stops the server.
A server that dies is not restarted: later calls fail with a message naming it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import shlex
from typing import Any

from agentrl.tools.background_loop import BackgroundLoop
from agentrl.tools.base import Tool, ToolResult

# Maps keyed by property (or definition) name, whose keys are never annotations: a property called
# "title" stays. dependentRequired's values are name lists, which the walk leaves as they are.
_NAMED_SCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentRequired", "dependentSchemas",
                  "dependencies"}
_DATA = {"default", "enum", "const", "examples"}  # values, not schemas: left as they are


class MCPToolError(RuntimeError):
    """An MCP tool call that failed or that the server flagged as an error."""


class MCPTools:
    """An MCP server as one tool-file entry; `tools()` gives one Tool per allowed server tool."""

    def __init__(self, allow: list[str], command: list[str] | str | None = None, url: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 30.0,
                 connect_timeout_s: float = 30.0):
        if (command is None) == (url is None):
            raise ValueError("give exactly one of 'command' (a stdio server) and 'url' (Streamable HTTP)")
        if not isinstance(allow, list) or not allow or not all(isinstance(n, str) for n in allow):
            raise ValueError("'allow' must be a non-empty list of tool names")
        self.label = url or (command if isinstance(command, str) else shlex.join(command))
        self.timeout_s = timeout_s
        self._server = url if url is not None else _stdio(command, env, cwd)
        self._client: Any = None
        self._failure = "not connected yet"
        self._loop = BackgroundLoop("agentrl-mcp")
        self._loop.on_close(self._disconnect)
        try:
            self._loop.run_sync(self._connect(), connect_timeout_s + 5)
            offered = self._loop.run_sync(self._list_tools(), connect_timeout_s)
        except Exception as e:
            self.close()
            raise ValueError(f"cannot reach the MCP server {self.label}: {_describe(e)}") from None
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
        self._stop = asyncio.Event()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._holder = asyncio.create_task(self._hold(ready))
        try:
            await ready
        except BaseException:
            self._holder.cancel()
            raise

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        """Owns the session: enters it, waits for close, exits it, all in this one task."""
        from mcp import Client

        try:
            async with Client(self._server, read_timeout_seconds=self.timeout_s) as client:
                self._client = client
                ready.set_result(None)
                await self._stop.wait()
        except Exception as e:
            self._failure = _describe(e)
            if not ready.done():
                ready.set_exception(e)
        finally:
            self._client = None
            if self._failure == "not connected yet":
                self._failure = "closed"

    async def _disconnect(self) -> None:
        if getattr(self, "_holder", None) is not None:
            self._stop.set()
            await asyncio.wait({self._holder}, timeout=10)

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
        client = self._client
        if client is None:
            raise MCPToolError(f"the MCP server {self.label} is not connected ({self._failure})")
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED

        try:
            result = await client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s)
        except MCPError as e:  # the server exited (or dropped the session): say which one
            if e.code != CONNECTION_CLOSED:
                raise
            raise MCPToolError(f"the MCP server {self.label} closed the connection: it exited or dropped the session, "
                               "and it is not restarted") from None
        parts = [_block_text(block) for block in result.content]
        if not parts and result.structured_content is not None:
            parts.append(json.dumps(result.structured_content, ensure_ascii=False))
        text = "\n".join(parts)
        if result.is_error:
            raise MCPToolError(text or f"{name} reported an error")
        return text


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


def _stdio(command: list[str] | str | None, env: dict[str, str] | None, cwd: str | None) -> Any:
    from mcp import StdioServerParameters

    argv = shlex.split(command) if isinstance(command, str) else list(command or [])
    if not argv:
        raise ValueError("'command' is empty")
    # "replace": the SDK's strict decoding drops everything a server prints after one byte that is
    # not UTF-8 (a library's stray print), and every later call hangs until its timeout.
    return StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=cwd, encoding_error_handler="replace")


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


def _describe(error: BaseException) -> str:
    """One line for an error, looking inside the exception groups anyio raises."""
    while getattr(error, "exceptions", None):  # BaseExceptionGroup, without needing Python 3.11
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"
