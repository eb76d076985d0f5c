"""Is this an OpenAI function schema a model can be shown and a call can be checked against?

`jsonschema` checks the parameters against their metaschema; what it leaves to call time (a `$ref`
that resolves nowhere, which it would even try to fetch over the network) and what OpenAI's format
adds (the keys of the wrapper, the name's characters) is checked here, so a tool file's mistakes
stop the run before any work.
"""

from __future__ import annotations

import math
import re
from typing import Any
from urllib.parse import unquote

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

SCHEMA_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}  # OpenAI's function object
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_schema(schema: Any) -> str | None:
    """Why `schema` is not a valid OpenAI function schema, or None if it is."""
    if not isinstance(schema, dict) or schema.get("type") != "function":
        return "schema must be a mapping with type: function"
    problem, fn = _unknown_key(schema, SCHEMA_KEYS, "schema"), schema.get("function")
    if problem or not isinstance(fn, dict):
        return problem or "schema.function must be a mapping with name, description and parameters"
    problem = _unknown_key(fn, FUNCTION_KEYS, "schema.function")
    if problem:
        return problem
    if not isinstance(fn.get("name"), str):
        return "schema.function.name is missing"
    if not _NAME_RE.fullmatch(fn["name"]):  # match() would let a trailing newline through
        return f"schema.function.name {fn['name']!r} must match {_NAME_RE.pattern}"
    if fn.get("description") is not None and not isinstance(fn["description"], str):  # the model reads it as text
        return f"schema.function.description must be text, not {type(fn['description']).__name__}"
    if "strict" in fn and not isinstance(fn["strict"], bool):
        return f"schema.function.strict must be true or false, not {fn['strict']!r}"
    params = fn.get("parameters", {"type": "object", "properties": {}})
    problem = _not_json(params, "schema.function.parameters")
    if problem:
        return problem
    if not isinstance(params, dict) or params.get("type") != "object":
        return "schema.function.parameters must be a JSON Schema with type: object"
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        return f"schema.function.parameters is not valid JSON Schema ({e.message})"
    except (TypeError, AttributeError) as e:  # a `$schema` that is a list, a mapping or a number
        return f"schema.function.parameters is not valid JSON Schema ({type(e).__name__}: {e})"
    dangling = _dangling_ref(params)
    if dangling:
        return f"schema.function.parameters: $ref '{dangling}' does not point to a place inside the schema"
    dangling = _dangling_ref(with_nullable(params))  # the schema calls are checked against
    if dangling:
        return (f"schema.function.parameters: $ref '{dangling}' does not point to a place inside the schema once "
                "'nullable: true' is spelt as JSON Schema (write a $ref into a nullable node as '#/...', a "
                "pointer from the top of the parameters)")
    return None


def _not_json(node: Any, where: str) -> str | None:
    """Where `node` holds a key that is not text or a value that is not JSON, or None. YAML 1.1
    reads an unquoted `on`, `no` or `yes` as a boolean and `1` as a number: such a property would be
    shown to the model as true and never be checked against a call. It reads an unquoted date as a
    date (and `!!set`, `!!binary` as Python objects), which the metaschema lets through as a
    `default` or an `enum` value: the template failed on it later, naming nothing, and every call
    was refused against it."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                return (f"{where}: key {key!r} is not text (YAML reads unquoted on, off, yes and no as booleans, "
                        "digits as numbers: quote it)")
            problem = _not_json(value, f"{where}.{key}")
            if problem:
                return problem
    elif isinstance(node, list):
        for i, item in enumerate(node):
            problem = _not_json(item, f"{where}[{i}]")
            if problem:
                return problem
    elif isinstance(node, float) and not math.isfinite(node):
        return f"{where}: {node} is not a JSON number"
    elif not isinstance(node, str | int | float | None):  # bool is an int
        return (f"{where}: {str(node)[:80]!r} is a {type(node).__name__}, not a JSON value (YAML reads an unquoted "
                "date or time as one: quote it)")
    return None


def _unknown_key(mapping: dict[str, Any], allowed: set[str], where: str) -> str | None:
    unknown = sorted(str(k) for k in set(mapping) - allowed)
    return f"{where}: unknown key '{unknown[0]}' (allowed: {', '.join(sorted(allowed))})" if unknown else None


def _dangling_ref(params: dict[str, Any]) -> str | None:
    """The first `$ref` that does not resolve within `params` (jsonschema would raise it only when a
    call reaches it, and would fetch a URL over the network)."""
    root = referencing.Resource.from_contents(params, default_specification=referencing.jsonschema.DRAFT202012)
    pending = [(root, referencing.Registry().with_resource("", root).resolver(base_uri=""))]
    while pending:
        resource, resolver = pending.pop()
        ref = resource.contents.get("$ref") if isinstance(resource.contents, dict) else None
        if isinstance(ref, str):
            try:
                resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                return ref
        pending.extend((sub, resolver.in_subresource(sub)) for sub in reversed(list(resource.subresources())))
    return None


_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_DATA = {"enum", "const", "default", "examples"}  # values, not schemas
# Keywords whose subschemas judge a null too; the type-specific ones (items, minimum, ...) pass it.
_NULL_JUDGES = ("$ref", "$dynamicRef", "allOf", "anyOf", "oneOf", "not", "if")


def with_nullable(schema: Any) -> Any:
    """The schema with OpenAPI's `nullable: true` (what transformers' get_json_schema writes for an
    `X | None` parameter, and what the model reads) spelt as JSON Schema: also null. jsonschema
    ignores the keyword, so a null the schema offers would otherwise be refused.

    Spelt in place, so that every node stays where a `$ref` finds it: `type: T` becomes
    `type: [T, "null"]`, an `enum` gains null, a `const` becomes an `enum` of it and null. A node
    with `$ref`, `allOf`, `anyOf`, `oneOf`, `not` or `if` (which would refuse the null) is wrapped
    in `anyOf: [node, {type: null}]`, unless a `$ref` points inside it: there it stays as it is and
    refuses the null. `nullable` at the top is ignored: the arguments are always an object."""
    return _spelt(schema, (), _pointer_targets(schema, ()))


def _spelt(node: Any, path: tuple[str, ...], targets: list[tuple[str, ...]]) -> Any:
    out = _map_schemas(node, path, lambda sub, at: _spelt(sub, at, targets))
    if not isinstance(out, dict) or not path or out.get("nullable") is not True:
        return out
    if isinstance(out.get("type"), (str, list)):
        types = [out["type"]] if isinstance(out["type"], str) else out["type"]
        out["type"] = types if "null" in types else [*types, "null"]
    if "const" in out and "enum" not in out:
        out["enum"] = [out.pop("const")]
    if isinstance(out.get("enum"), list) and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    pointed_into = any(len(t) > len(path) and t[:len(path)] == path for t in targets)
    if any(key in out for key in _NULL_JUDGES) and not pointed_into:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _pointer_targets(node: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Where the `$ref`s under `node` that are JSON pointers (`#/a/b`) point, as path segments."""
    found: list[tuple[str, ...]] = []
    if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
        found.append(tuple(unquote(part).replace("~1", "/").replace("~0", "~") for part in node["$ref"][2:].split("/")))
    _map_schemas(node, path, lambda sub, at: found.extend(_pointer_targets(sub, at)))
    return found


def _map_schemas(node: Any, path: tuple[str, ...], fn: Any) -> Any:
    """`node` with `fn(subschema, its path)` in place of each subschema (a list's items, a keyword's
    value, each schema of a map keyed by name); values of `enum`, `const`, ... are kept as they are."""
    if isinstance(node, list):
        return [fn(item, (*path, str(i))) for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names → schemas: a name is not a keyword
            out[key] = {name: fn(sub, (*path, key, name)) for name, sub in value.items()}
        else:
            out[key] = fn(value, (*path, key))
    return out
