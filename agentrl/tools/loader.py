"""Tool files (`tool_configs/*.yaml`) → live Tool objects, validated before any work starts.

A `class:` reference is `module:attr` (a Tool class, a `@tool` function or a plain function) or
the name of an entry point in the `agentrl.tools` group, which is how installed packages register
tools and how the builtin ones are found. A class whose instance is a ToolSet (it has `tools()` and
no `execute`, like a remote tool server or an MCP server) expands into the tools it lists.

Checked before anything is built: the entry's keys, the schema's keys (a misspelt `paramters` is an
error, not a tool without parameters), that the parameters are JSON Schema whose every `$ref`
points inside it, and each `config` value against the constructor's type hint (converted as
pydantic converts it). Every problem is a ConfigError naming the file, the tool and the key.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pydantic

from agentrl.errors import ConfigError
from agentrl.yaml_files import load_yaml
from agentrl.tools.base import FunctionTool, Tool, ToolSet
from agentrl.tools.schema import check_schema
from agentrl.tools.threads import failure_text

ENTRY_POINT_GROUP = "agentrl.tools"
ENTRY_KEYS = {"class", "config", "schema"}
# Names of values an error message must not show; the values of `env` and `headers` (a server's
# environment and request headers, where credentials travel under any name) are hidden whole.
_SECRET_RE = re.compile(r"token|secret|passw|api_?key|authoriz|credential|cookie", re.IGNORECASE)
_HIDDEN_MAPS = {"env", "headers"}


def registered_tools() -> dict[str, str]:
    """Entry-point name → 'module:attr' for every tool installed packages register."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def resolve_reference(ref: str, group: str = ENTRY_POINT_GROUP) -> Any:
    """Import `module:attr`, or look `ref` up as an entry point name. Raises ValueError."""
    if ":" not in ref:
        matches = [ep for ep in entry_points(group=group) if ep.name == ref]
        if not matches:
            raise ValueError(f"'{ref}' is neither 'module:attr' nor a registered {group} entry point")
        try:
            return matches[0].load()
        except (Exception, SystemExit) as e:  # as an import below: named, not the process ended
            raise ValueError(f"cannot load entry point '{ref}' = '{matches[0].value}' "
                             f"({type(e).__name__}: {e})") from None
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # an import error inside the plug-in is as fatal as a missing
        # module; SystemExit too (a module that parses the command line when imported), named here
        # instead of ending the process with its own usage message
        raise ValueError(f"cannot import module '{module_name}' ({type(e).__name__}: {e})") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"module '{module_name}' has no attribute '{attr}'") from None
    return obj


def read_yaml_list(path: str | Path, key: str) -> list[Any]:
    """The list under `key` in a YAML file, or a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    data = load_yaml(path)
    if not isinstance(data, dict) or set(data) != {key} or not isinstance(data[key], list):
        raise ConfigError(f"{path}: expected a mapping with exactly one key '{key}' holding a list")
    return data[key]


def build_tools(entry: Any) -> list[Tool]:
    """One YAML entry → its Tool, or the tools a ToolSet entry expands into. Raises ValueError."""
    instance = _instantiate(entry)
    try:
        if isinstance(instance, ToolSet) and not hasattr(instance, "execute"):
            if "schema" in entry:
                raise ValueError("key 'schema' is for a single tool; this entry takes its tools' schemas from its "
                                 "source")
            try:
                members = list(instance.tools())
            except Exception as e:  # a server that refuses to list its tools: name it, no traceback
                raise ValueError(f"listing its tools failed: {type(e).__name__}: {e}") from None
        else:
            if "schema" in entry and not isinstance(instance, FunctionTool):
                try:
                    instance.schema = entry["schema"]
                except AttributeError as e:  # the class computes its schema (a property without setter)
                    raise ValueError(f"key 'schema': the class does not take a schema ({e})") from None
            members = [instance]
        for member in members:
            _check_tool(member, entry["class"])
    except BaseException:  # a server started for an entry that is refused (a member's bad schema) stops
        close = getattr(instance, "close", None)
        if callable(close):
            close()
        raise
    return members


def _instantiate(entry: Any) -> Any:
    if not isinstance(entry, dict):
        raise ValueError("each tool must be a mapping with a 'class' key")
    unknown = sorted(str(key) for key in set(entry) - ENTRY_KEYS)  # str: YAML keys may be numbers
    if unknown:
        raise ValueError(f"unknown key '{unknown[0]}' (allowed: {', '.join(sorted(ENTRY_KEYS))})")
    problem = class_problem(entry)
    if problem:
        raise ValueError(problem)
    config = entry_config(entry)
    problem = check_schema(entry["schema"]) if "schema" in entry else None
    if problem:  # before the class is built: constructors may start servers or connect to them
        raise ValueError(problem)
    obj = resolve_reference(entry["class"])
    if inspect.isclass(obj):
        config = typed_config(obj, config)
        try:
            return obj(**config)
        except (Exception, SystemExit) as e:
            # A ValueError is a constructor's own message about its config; any other type is named
            # (a bare KeyError would read "failed: 'api_key'").
            detail = str(e) if type(e) in (ValueError, ConfigError) else failure_text(e)
            raise ValueError(f"constructing {entry['class']} with config {masked(config)} failed: {detail}") from None
    if isinstance(obj, FunctionTool) or callable(obj):
        if config:
            raise ValueError("key 'config' is only for tool classes, not functions")
        if isinstance(obj, FunctionTool):  # a fresh wrapper: a schema given here never changes the
            # shared module-level tool; without one, the tool keeps its own schema and thread count
            return _function_tool(obj.fn, entry.get("schema", obj.schema), obj.max_workers)
        return _function_tool(obj, entry.get("schema"))
    raise ValueError(f"'{entry['class']}' is not a tool class or function")


def typed_config(cls: type, config: dict[str, Any]) -> dict[str, Any]:
    """`config` checked against the constructor's parameters and type hints, each value converted
    as pydantic converts it: `"0.5"` quoted, which a `float` parameter takes as 0.5."""
    try:
        parameters = inspect.signature(cls).parameters
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - a plug-in's unresolvable annotation: the constructor decides
        return config
    named = {n: p for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    any_key = next((p for p in parameters.values() if p.kind is p.VAR_KEYWORD), None)  # **options: str
    typed: dict[str, Any] = {}
    for key, value in config.items():
        parameter = named.get(key, any_key)
        if parameter is None:
            raise ValueError(f"config: unknown key '{key}' (allowed: {', '.join(sorted(named)) or 'none'})")
        typed[key] = value
        if parameter.name not in hints:
            continue
        try:
            typed[key] = pydantic.TypeAdapter(hints[parameter.name]).validate_python(value)
        except pydantic.PydanticUserError:  # a type pydantic cannot check: the constructor decides
            pass
        except pydantic.ValidationError as e:
            annotation = parameter.annotation
            expected = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
            raise ValueError(f"config.{key} = {masked({key: value})[key]!r}: expected {expected} "
                             f"({e.errors()[0]['msg']})") from None
    return typed


def entry_config(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry's `config` mapping ({} when absent or null); ValueError for anything else."""
    config = entry.get("config")
    if not isinstance(config, dict | None):
        raise ValueError(f"key 'config' must be a mapping, not {type(config).__name__}")
    return config or {}


def class_problem(entry: dict[str, Any]) -> str | None:
    """Why an entry's `class` key is unusable, or None."""
    if "class" not in entry:
        return "missing key 'class' ('module:attr' or a registered name)"
    if not isinstance(entry["class"], str):
        return f"key 'class' must be text ('module:attr' or a registered name), not {entry['class']!r}"
    return None


def async_problem(instance: Any, methods: tuple[str, ...]) -> str | None:
    """Which of `methods` is missing or is not `async def` (the loop awaits each call), or None."""
    missing = [m for m in methods if not callable(getattr(instance, m, None))]
    if missing:
        return f"lacks the method(s) {', '.join(missing)}"
    plain = [m for m in methods if not inspect.iscoroutinefunction(inspect.unwrap(getattr(instance, m)))]
    if plain:
        return f"method(s) {', '.join(plain)} must be 'async def'"
    return None


def masked(config: dict[str, Any], hide_all: bool = False) -> dict[str, Any]:
    """The config as an error message may show it: secrets (a server's token, the values of its
    `env` and `headers`) replaced by '***', in nested mappings too, and a `url` without its
    password and query string."""
    def shown(key: Any, value: Any) -> Any:
        if isinstance(value, dict):
            return masked(value, hide_all or key in _HIDDEN_MAPS)
        secret = hide_all or (_SECRET_RE.search(str(key)) and key != "token_env")
        return "***" if secret else url_shown(value) if key == "url" and isinstance(value, str) else value

    return {key: shown(key, value) for key, value in config.items()}


def url_shown(url: str) -> str:
    """A URL as messages show it: without a password or query string, where tokens travel."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))


def _check_tool(instance: Any, ref: str) -> None:
    if getattr(instance, "schema", None) is None:
        raise ValueError("no schema: the class defines none, so the entry needs a 'schema' key")
    problem = check_schema(instance.schema)
    if problem:
        raise ValueError(problem)
    problem = async_problem(instance, ("create", "execute", "reward", "release"))
    if problem:  # blocking code belongs in a plain function, which runs on a thread
        raise ValueError(f"'{ref}' {problem}{' (or write the tool as a plain function)' if 'async' in problem else ''}")
    problem = calls_problem(instance)
    if problem:
        raise ValueError(f"'{ref}' {problem}")


# How the episode calls a tool instance's methods (env/tool_env.py): create also gets the task's
# answer as ground_truth, and the task's tool_kwargs for that tool.
TOOL_CALLS = (("create", ("id",), {"ground_truth": None}), ("execute", ("id", {}), {}),
              ("reward", ("id",), {}), ("release", ("id",), {}))


def calls_problem(instance: Any) -> str | None:
    """Which method cannot take the arguments the episode calls it with, or None: every call to it
    would otherwise fail with a TypeError, each run, in every episode."""
    for method, args, kwargs in TOOL_CALLS:
        try:
            signature = inspect.signature(getattr(instance, method))
        except (TypeError, ValueError):  # no signature to read: the call decides
            continue
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            called = ", ".join(["instance_id", "arguments"][:len(args)] + [f"{k}=..." for k in kwargs])
            return f"method {method}{signature} cannot be called as {method}({called}) ({e})"
    return None


def _function_tool(fn: Any, schema: Any, max_workers: int | None = None) -> FunctionTool:
    if schema is not None:
        problem = _signature_mismatch(fn, schema)
        if problem:
            raise ValueError(problem)
        return FunctionTool(fn, schema=schema, max_workers=max_workers)
    try:
        return FunctionTool(fn, max_workers=max_workers)
    except Exception as e:
        raise ValueError(f"no schema: cannot derive one from the function ({e})") from None


def _signature_mismatch(fn: Any, schema: dict[str, Any]) -> str | None:
    """Why calls made by `schema` could fail to bind to `fn` (a property it has no parameter for, a
    parameter without a default that the schema does not offer or does not require, a required name
    the schema has no property for), or None. Checked at load: the run would otherwise start and
    calls fail with a TypeError, or be refused whatever the model sends."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    spec = schema["function"].get("parameters") or {}
    properties = set(spec.get("properties") or {})
    required = set(spec.get("required") or [])
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    name, function = schema["function"]["name"], getattr(fn, "__qualname__", fn)
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:  # a call passes its arguments by name
        return f"{function}() takes {positional} by position only, and a tool's arguments are passed by name"
    if not any(p.kind is p.VAR_KEYWORD for p in parameters) and properties - named:
        return (f"the schema of '{name}' has properties {sorted(properties - named)} that "
                f"{function}() takes no parameter for (it takes {sorted(named)})")
    without_default = {p.name for p in parameters if p.default is p.empty and p.name in named}
    if without_default - properties:
        return f"{function}() needs {sorted(without_default - properties)}, which the schema of '{name}' does not offer"
    if without_default - required:  # the model may leave it out, and the call fails with a TypeError
        return (f"{function}() has no default for {sorted(without_default - required)}, which the schema of "
                f"'{name}' does not list in 'required'")
    if required - properties:  # no call can give it: the function takes no such keyword
        return (f"the schema of '{name}' requires {sorted(required - properties)}, which it has no property for "
                f"(its properties: {sorted(properties)})")
    return None


def load_tools(path: str | Path) -> list[Tool]:
    """Every tool in one YAML file, with names checked for uniqueness."""
    tools: list[Tool] = []
    built: list[Tool] = []  # the entry's being checked, not in `tools` yet
    seen: dict[str, int] = {}
    try:
        for i, entry in enumerate(read_yaml_list(path, "tools"), start=1):
            label = _entry_label(entry, i)
            try:
                built = build_tools(entry)
            except ValueError as e:
                raise ConfigError(f"{path}: {label}: {e}") from None
            except Exception as e:  # noqa: BLE001 - a plug-in failing in a way no check foresaw
                raise ConfigError(f"{path}: {label}: {type(e).__name__}: {e}") from None
            for t in built:
                name = t.schema["function"]["name"]
                if name in seen:
                    raise ConfigError(f"{path}: tool '{name}' (#{i}): duplicate name, tool #{seen[name]} has it too")
                seen[name] = i
                tools.append(t)
            built = []
    except BaseException:  # the servers the earlier entries started would run until the process exits
        close_tools(tools + built)
        raise
    return tools


def load_tool_files(paths: list[str | Path]) -> list[Tool]:
    """The tools of every file a recipe lists at rollout.tool_configs; a file that is not there
    names that key."""
    tools: list[Tool] = []
    loaded: list[Tool] = []  # the file's being checked, not all in `tools` yet
    try:
        for path in paths:
            if not Path(path).is_file():
                raise ConfigError(f"rollout.tool_configs: {path}: file not found")
            loaded = load_tools(path)  # a file that fails closes its own
            for t in loaded:
                name = t.schema["function"]["name"]
                if any(o.schema["function"]["name"] == name for o in tools):
                    raise ConfigError(f"{path}: tool '{name}': duplicate name, an earlier tool file has it")
                tools.append(t)
            loaded = []
    except BaseException:  # the earlier files' servers would run until the process exits
        close_tools(tools + loaded)
        raise
    return tools


def _entry_label(entry: Any, index: int) -> str:
    """How errors name an entry: by its schema's name, else its class, else its position."""
    schema = entry.get("schema") if isinstance(entry, dict) else None
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(name, str) and name:
        return f"tool {name!r} (#{index})"
    if isinstance(entry, dict) and isinstance(entry.get("class"), str):
        return f"tool #{index} (class '{entry['class']}')"
    return f"tool #{index}"


def close_tools(tools: list[Tool]) -> None:
    """Close the connections behind tools that came from one server entry (MCPTools, RemoteTools:
    their members share a `source`): a process that loaded a tool file only to check it keeps no
    MCP server process or HTTP client alive for the rest of the run."""
    closed: set[int] = set()
    for t in tools:
        source = getattr(t, "source", None)
        if source is not None and id(source) not in closed and callable(getattr(source, "close", None)):
            closed.add(id(source))
            source.close()
