"""Interactions: the simulated user or environment that answers an assistant turn without tool calls.

Loaded from YAML like tools (`interactions: [{class: module:attr, config: {...}}]`); a fresh
instance serves each episode, built from its own copy of the config, so an interaction may keep
per-episode state in `self` (and in the config's lists and mappings) without one episode seeing
another's. Per-task settings (a simulated user's persona, a judge's rubric) come from the task
file's `interaction_kwargs` column, as `task.interaction_kwargs` in `start(task)`.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from agentrl.errors import ConfigError
from agentrl.tools.loader import (async_problem, class_problem, entry_config, masked, read_yaml_list,
                                  resolve_reference, typed_config)
from agentrl.tools.threads import NOT_A_PLUGINS_OWN, failure_text
from agentrl.types import Task

ENTRY_POINT_GROUP = "agentrl.interactions"


@dataclass
class Turn:
    """The interaction's reply: text shown as a user turn, whether the episode ends (a bool), a
    score (a finite number; None when the reply is not scored)."""

    text: str
    done: bool
    score: float | None = 0.0


class InteractionError(Exception):
    """What an interaction did wrong in an episode (raised, or returned something other than a
    Turn), named as the interaction's: the episode fails with it, and the run goes on."""


@runtime_checkable
class Interaction(Protocol):
    async def start(self, task: Task) -> None: ...

    async def respond(self, messages: list[dict[str, Any]]) -> Turn: ...

    async def finish(self) -> None: ...


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


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
        return cls(**copy.deepcopy(config))

    async def on_a_loop() -> Interaction:
        return factory()

    try:  # on an event loop, as each episode's instance is: a constructor may need the running loop
        probe = factory() if _loop_running() else asyncio.run(on_a_loop())
    except NOT_A_PLUGINS_OWN:
        raise
    except BaseException as e:  # SystemExit: a constructor parsing arguments argparse-style
        detail = e if isinstance(e, Exception) else failure_text(e)  # SystemExit(2) alone reads "2"
        raise ConfigError(f"{where}: config {masked(config)} rejected ({detail})") from None
    problem = async_problem(probe, ("start", "respond", "finish"))
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return factory
