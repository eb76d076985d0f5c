"""The tool protocol, its result type, and `@tool` for plain functions.

A tool object is shared by every episode of a run; per-episode state is keyed by `instance_id`
(the verl BaseTool lifecycle: create → execute* → reward → release). A plain function with type
hints and a Google-style docstring becomes a tool through `@tool`; its OpenAI schema is derived by
transformers' `get_json_schema` rather than by code of our own.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from transformers.utils import get_json_schema


@dataclass
class ToolResult:
    """What one tool execution returns to the loop."""

    text: str
    reward: float | None = None  # a step reward, summed into the trajectory when enabled
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    """An async tool with a per-trajectory lifecycle."""

    schema: dict[str, Any]  # OpenAI function schema: {"type": "function", "function": {...}}

    async def create(self, instance_id: str, **kwargs: Any) -> str | None: ...

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult | str: ...

    async def reward(self, instance_id: str) -> float | None: ...

    async def release(self, instance_id: str) -> None: ...


@runtime_checkable
class ToolSet(Protocol):
    """One tool-file entry that stands for several tools, e.g. everything a tool server offers."""

    def tools(self) -> list[Tool]: ...


def tool_name(t: Tool) -> str:
    return t.schema["function"]["name"]


class FunctionTool:
    """Adapts a plain (sync or async) function to the Tool protocol; stateless per instance."""

    def __init__(self, fn: Callable[..., Any], schema: dict[str, Any] | None = None):
        self.fn = fn
        self.schema = schema or function_schema(fn)

    async def create(self, instance_id: str, **kwargs: Any) -> str | None:
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult | str:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**arguments)
        else:
            # A thread keeps a slow synchronous tool from stalling every other episode.
            result = await asyncio.to_thread(self.fn, **arguments)
        return result if isinstance(result, ToolResult) else ToolResult(text=_as_text(result))

    async def reward(self, instance_id: str) -> float | None:
        return None

    async def release(self, instance_id: str) -> None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI schema from type hints and docstring; drops the 'return' entry models never see."""
    schema = get_json_schema(fn)
    schema["function"].pop("return", None)
    return schema


def tool(fn: Callable[..., Any]) -> FunctionTool:
    """Decorator: `@tool def search(query: str) -> str: '''...'''` is a Tool."""
    return FunctionTool(fn)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    import json

    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)
