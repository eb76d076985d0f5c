"""Tools the tool-server tests serve: one that always fails, one that takes its time, and one whose
instances take their time to create."""

from __future__ import annotations

import asyncio

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
