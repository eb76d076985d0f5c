"""Tools the tool-server tests serve: one that always fails, one that takes its time, one whose
instances take their time to create, one that counts its runs, one that talks at length, and one
whose results carry values that are no numbers."""

from __future__ import annotations

import asyncio
import time

from agentrl.tools.base import ToolResult, tool


@tool
def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Put into the error message.
    """
    raise RuntimeError(f"boom: {reason}")


@tool
async def nap(seconds: float) -> str:
    """Sleeps, then says so.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


_tallied: list[int] = []  # per server process


@tool
def tally() -> str:
    """Counts how many times it has run in this server process."""
    _tallied.append(1)
    return str(len(_tallied))


@tool
def ramble(characters: int) -> str:
    """Writes a long text.

    Args:
        characters: How long.
    """
    return "x" * characters


class SlowStart:
    """A tool whose `create` takes `seconds` (a sandbox or a browser starting up)."""

    schema = {"type": "function", "function": {"name": "slow_start", "description": "Says hello.",
                                               "parameters": {"type": "object", "properties": {}}}}

    async def create(self, instance_id: str, seconds: float = 0.0, **kwargs) -> str:
        await asyncio.sleep(seconds)
        return instance_id

    async def execute(self, instance_id: str, arguments: dict) -> ToolResult:
        return ToolResult("hello")

    async def reward(self, instance_id: str) -> None:
        return None

    async def release(self, instance_id: str) -> None:
        return None


@tool
def quit_early(code: int) -> str:
    """Calls sys.exit, as a wrapped command-line program does on bad input.

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


class OwnIds:
    """A tool that names its instances itself (`create` returns a session id of its own) and
    reports a metric in a shape the protocol does not allow (a list)."""

    schema = {"type": "function", "function": {"name": "own_ids", "description": "Says which session it is.",
                                               "parameters": {"type": "object", "properties": {}}}}

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}
        self.released: list[str] = []

    async def create(self, instance_id: str, **kwargs) -> str:
        self.sessions[f"session-{instance_id}"] = instance_id
        return f"session-{instance_id}"

    async def execute(self, instance_id: str, arguments: dict) -> ToolResult:
        return ToolResult(f"in {instance_id} of {self.sessions[instance_id]}", metrics=["not", "a", "mapping"])

    async def reward(self, instance_id: str) -> float:
        return 1.0 if instance_id in self.sessions else 0.0

    async def release(self, instance_id: str) -> None:
        del self.sessions[instance_id]
        self.released.append(instance_id)


@tool
async def retry_forever(url: str) -> str:
    """Polls a service that never answers, retrying under a bare `except:` (it swallows its
    cancellation, and the GeneratorExit of its closing, too).

    Args:
        url: The service.
    """
    while True:
        try:
            await asyncio.sleep(0.05)
        except BaseException:  # noqa: BLE001 - the point of this tool
            pass


@tool
async def fetch_in_a_thread(url: str) -> str:
    """Fetches a page with a blocking client handed to a thread, as advised; the page never comes.

    Args:
        url: The page.
    """
    await asyncio.to_thread(time.sleep, 3600)
    return "page"


class Scored:
    """A tool whose results carry values training cannot take: a NaN step reward, a metric in
    words and one under a name that is no text (one metric is a number), and an infinite final
    reward."""

    schema = {"type": "function", "function": {"name": "scored", "description": "Scores itself.",
                                               "parameters": {"type": "object", "properties": {}}}}

    async def create(self, instance_id: str, **kwargs) -> str:
        return instance_id

    async def execute(self, instance_id: str, arguments: dict) -> ToolResult:
        return ToolResult("scored", reward=float("nan"), metrics={"hits": "three", "score": 0.5, 7: 1.0})

    async def reward(self, instance_id: str) -> float:
        return float("inf")

    async def release(self, instance_id: str) -> None:
        return None
