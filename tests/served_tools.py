"""Tools the tool-server tests serve: one that always fails and one that takes its time."""

from __future__ import annotations

import asyncio

from agentrl.tools.base import tool


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
