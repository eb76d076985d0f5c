"""A GSM8K-style interaction: checks the model's final answer and lets it try again."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from agentrl.env.interaction import Turn
from agentrl.tools.builtin.gsm8k import answer_matches, checked_tolerance, ground_truth_number, parse_number
from agentrl.types import Task


class GSM8KInteraction:
    """Replies 'correct' (episode ends, score 1) or 'wrong, try again' up to `max_attempts`."""

    def __init__(self, max_attempts: int = 2, tolerance: float = 1e-6):
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.max_attempts = max_attempts
        self.tolerance = checked_tolerance(tolerance)
        self._truth: Fraction | None = None
        self._attempts = 0

    async def start(self, task: Task) -> None:
        self._truth = ground_truth_number(task.answer) if task.answer else None
        self._attempts = 0

    async def respond(self, messages: list[dict[str, Any]]) -> Turn:
        self._attempts += 1
        last = next((m for m in reversed(messages) if m["role"] == "assistant"), {"content": ""})
        submitted = parse_number(last.get("content") or "")
        if self._truth is not None and submitted is not None and answer_matches(submitted, self._truth,
                                                                                self.tolerance):
            return Turn("Your answer is correct.", done=True, score=1.0)
        if self._attempts >= self.max_attempts:
            return Turn("Your answer is incorrect.", done=True, score=0.0)
        return Turn("Your answer is incorrect. Please check your work and try again.", done=False)

    async def finish(self) -> None:
        self._truth = None
