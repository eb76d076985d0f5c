"""The tool protocol, its result type, and `@tool` for plain functions.

A tool object is shared by every episode of a run; per-episode state is keyed by `instance_id`
(the verl BaseTool lifecycle: create → execute* → reward → release). A plain function with type
hints and a Google-style docstring becomes a tool through `@tool`; its OpenAI schema is derived by
transformers' `get_json_schema` rather than by code of our own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import jsonschema
import pydantic
from transformers.utils import get_json_schema

from agentrl.tools.schema import with_nullable
from agentrl.tools.threads import DaemonExecutor, ThreadCall, on_worker_thread


@dataclass
class ToolResult:
    """What one tool execution returns to the loop."""

    text: str
    reward: float | None = None  # a step reward, summed into the trajectory when enabled
    metrics: dict[str, float] = field(default_factory=dict)
    dropped: int = 0  # reward and metric values a tool server dropped on the way (not finite numbers)


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


def argument_problem(t: Tool, arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the tool's parameters, or None. A schema that cannot be applied
    (a `$ref` to nowhere in a schema the loader never saw) is reported the same way, not raised."""
    name = tool_name(t)
    accepted = getattr(t, "parameter_names", None)  # a function's own: it takes no other keyword
    unexpected = sorted(set(arguments) - accepted) if accepted is not None else []
    if unexpected:
        return (f"bad arguments for {name}: unexpected argument {', '.join(map(repr, unexpected))} "
                f"(it takes {', '.join(sorted(accepted)) or 'none'}).")
    try:
        jsonschema.validate(arguments, with_nullable(t.schema["function"].get("parameters", {})))
    except jsonschema.ValidationError as e:
        return f"bad arguments for {name}: {e.message}."
    except Exception as e:  # noqa: BLE001 - jsonschema raises referencing, schema and type errors alike
        detail = as_text(f"{type(e).__name__}: {e}").splitlines()[0][:200]
        return f"the arguments for {name} cannot be checked, its parameters schema is broken ({detail})."
    convert = getattr(t, "convert_arguments", None)  # a function's: JSON values to its type hints
    if convert is not None:
        try:
            convert(arguments)
        except ValueError as e:
            return f"bad arguments for {name}: {e}."
    return None


class FunctionTool:
    """Adapts a plain (sync or async) function to the Tool protocol; stateless per instance.

    A synchronous function runs on this tool's own daemon threads (at most `max_workers` at once,
    started as calls come), never on the event loop or on threads the engine or the loop's shutdown
    wait for: a call that hangs costs its episode one timeout, and a run or process can still end.
    Calls past `max_workers` wait, and the wait counts toward their timeout (a tool whose threads
    all hang cannot hold its episodes forever). So without a `max_workers` of its own (a service
    that takes only so many requests at once), a rollout lets as many calls run together as its
    episodes can make at once (`allow_calls`), and never fewer than DEFAULT_WORKERS.
    """

    DEFAULT_WORKERS = 64

    def __init__(self, fn: Callable[..., Any], schema: dict[str, Any] | None = None, max_workers: int | None = None):
        self.fn, self.max_workers = fn, max_workers
        self.schema = schema or function_schema(fn)
        self.parameter_names = keyword_names(fn)
        self._adapters = argument_adapters(fn)
        # unwrap: an `async def` behind a functools.wraps decorator returns a coroutine to await
        self._threads = None if inspect.iscoroutinefunction(inspect.unwrap(fn)) else DaemonExecutor(
            self.DEFAULT_WORKERS if max_workers is None else max_workers, name=getattr(fn, "__name__", "tool"))

    def allow_calls(self, at_once: int) -> None:
        """Let `at_once` calls run together (what a rollout's episodes can make at once), unless
        the tool was given its own `max_workers`: healthy calls queued for a thread timed out."""
        if self._threads is not None and self.max_workers is None:
            self._threads.grow(at_once)

    def convert_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The JSON arguments as the function's type hints take them (an Enum member for its value,
        3 for 3.0 where it takes an int, a tuple for a list), through pydantic, as tool configs are
        (loader.typed_config); a ValueError names the argument that does not convert."""
        converted = dict(arguments)
        for name, value in arguments.items():
            adapter = self._adapters.get(name)
            if adapter is None:
                continue
            try:
                converted[name] = adapter.validate_python(value)
            except pydantic.ValidationError as e:
                raise ValueError(f"argument '{name}': {e.errors()[0]['msg']}") from None
        return converted

    async def create(self, instance_id: str, **kwargs: Any) -> str | None:
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult | str:
        arguments = self.convert_arguments(arguments)
        if self._threads is None:
            result = await self.fn(**arguments)
        else:
            call = ThreadCall(functools.partial(on_worker_thread, self.fn, **arguments))
            try:
                result = await asyncio.get_running_loop().run_in_executor(self._threads, call.run)
            except asyncio.CancelledError:  # timed out or the episode ended: the thread runs on
                call.abandon()
                raise
        return result if isinstance(result, ToolResult) else ToolResult(text=as_text(result))

    async def reward(self, instance_id: str) -> float | None:
        return None

    async def release(self, instance_id: str) -> None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def keyword_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keywords `fn` can be called with; None when it takes **kwargs (or has no signature)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters
                     if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def argument_adapters(fn: Callable[..., Any]) -> dict[str, pydantic.TypeAdapter]:
    """A pydantic TypeAdapter per keyword parameter with a type hint pydantic can build one for
    (others are passed as the JSON gave them)."""
    try:
        hints = typing.get_type_hints(inspect.unwrap(fn), include_extras=True)
        parameters = inspect.signature(fn).parameters.values()
    except Exception:  # noqa: BLE001 - an unresolvable forward reference, a callable without a signature
        return {}
    adapters = {}
    for p in parameters:
        if p.name in hints and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            try:
                adapters[p.name] = pydantic.TypeAdapter(hints[p.name])
            except Exception:  # noqa: BLE001 - a type pydantic has no schema for: not converted
                pass
    return adapters


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI schema from type hints and docstring; drops the 'return' entry models never see.

    Only keyword parameters can be called with a JSON object: `*args` and positional-only
    parameters are refused (get_json_schema lists them as properties no call could fill), and
    `**kwargs` is left out of the schema (it takes whatever other keys the model sends)."""
    schema = get_json_schema(fn)
    schema["function"].pop("return", None)
    parameters = schema["function"].get("parameters", {})
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            star = "*" if p.kind is inspect.Parameter.VAR_POSITIONAL else ""
            raise ValueError(f"parameter '{star}{p.name}' of {getattr(fn, '__name__', fn)!r} cannot be given by "
                             "name: a tool's arguments arrive as a JSON object, so every parameter must be a keyword")
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            parameters.get("properties", {}).pop(p.name, None)
            if p.name in parameters.get("required", []):
                parameters["required"].remove(p.name)
    return schema


def tool(fn: Callable[..., Any]) -> FunctionTool:
    """Decorator: `@tool def search(query: str) -> str: '''...'''` is a Tool."""
    return FunctionTool(fn)


def as_text(value: Any) -> str:
    """Any tool output as text a tokenizer accepts: bytes are decoded (bad bytes replaced), lone
    surrogates (a non-UTF-8 file name read with Python's defaults) become visible escapes, other
    objects become JSON (json_value says how what JSON lacks is written), or their repr when that fails."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False, default=json_value)
        except Exception:  # noqa: BLE001 - str() or repr() of a plug-in's object may raise anything
            try:
                value = repr(value)
            except Exception:  # noqa: BLE001
                value = f"<unprintable {type(value).__name__}>"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", errors="backslashreplace").decode("utf-8")
    return value


def json_value(value: Any) -> Any:
    """What JSON has no type for, as the model should read it: a set as a (sorted) list, a
    dataclass or pydantic model as its fields, a numpy or torch value as its number or list; else
    its str(). (A plain `default=str` put a set or a numpy integer in quotes.)"""
    if isinstance(value, (set, frozenset)):
        try:
            return sorted(value)
        except TypeError:  # mixed types
            return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}  # nested ones come back here
    for method, kwargs in (("model_dump", {"mode": "json"}), ("tolist", {})):  # pydantic; numpy and torch
        convert = getattr(value, method, None)
        if callable(convert):
            return convert(**kwargs)
    return str(value)


# The largest reward magnitude training takes: advantages and returns are float32, and whitening
# squares them (1e9² is far inside float32; 1e20² is infinity, and then every advantage is NaN).
REWARD_LIMIT = 1e9
