"""Interactions: the simulated user or environment that answers an assistant turn without tool calls.

Loaded from YAML like tools (`interactions: [{class: module:attr, config: {...}}]`); a fresh
instance serves each episode, so an interaction may keep per-episode state in `self`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from agentrl.errors import ConfigError
from agentrl.tools.loader import (async_problem, class_problem, entry_config, masked, read_yaml_list,
                                  resolve_reference, typed_config)
from agentrl.types import Task

ENTRY_POINT_GROUP = "agentrl.interactions"


@dataclass
class Turn:
    """The interaction's reply: text shown as a user turn, whether the episode ends, a score."""

    text: str
    done: bool
    score: float = 0.0


@runtime_checkable
class Interaction(Protocol):
    async def start(self, task: Task) -> None: ...

    async def respond(self, messages: list[dict[str, Any]]) -> Turn: ...

    async def finish(self) -> None: ...


def load_interaction(path: str | Path) -> Callable[[], Interaction]:
    """A factory building one Interaction per episode, checked by building one now."""
    entries = read_yaml_list(path, "interactions")
    if len(entries) != 1:
        raise ConfigError(f"{path}: expected exactly one interaction, found {len(entries)}")
    entry = entries[0]
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: interaction #1: must be a mapping with a 'class' key")
    problem = class_problem(entry)
    if problem:
        raise ConfigError(f"{path}: interaction #1: {problem}")
    where = f"{path}: interaction '{entry['class']}'"
    unknown = sorted(set(entry) - {"class", "config"})
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}'")
    try:
        config = entry_config(entry)
        cls = resolve_reference(entry["class"], group=ENTRY_POINT_GROUP)
        if not inspect.isclass(cls):
            raise ValueError("not a class")
        config = typed_config(cls, config)  # converted as tool configs are: `1e-6` → 1e-06
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None

    def factory() -> Interaction:
        return cls(**config)

    try:
        probe = factory()
    except Exception as e:
        raise ConfigError(f"{where}: config {masked(config)} rejected ({e})") from None
    problem = async_problem(probe, ("start", "respond", "finish"))
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return factory
