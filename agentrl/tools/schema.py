"""Is this an OpenAI function schema a model can be shown and a call can be checked against?

`jsonschema` checks the parameters against their metaschema; what it leaves to call time (a `$ref`
that resolves nowhere, which it would even try to fetch over the network) and what OpenAI's format
adds (the keys of the wrapper, the name's characters) is checked here, so a tool file's mistakes
stop the run before any work.
"""

from __future__ import annotations

import re
from typing import Any

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
    params = fn.get("parameters", {"type": "object", "properties": {}})
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
