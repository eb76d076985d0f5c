"""`check_answer`: the model submits a number, the tool compares it with the task's ground truth.

Stateful per episode (verl's Gsm8kTool lifecycle): `create` receives the ground truth, each
`execute` returns a step reward (1.0 the first time the answer is right, 0.0 otherwise) and a
sentence the model can react to, `reward` reports whether the episode ever got it right.
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.tools.base import ToolResult

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_number(text: str | float | int | None) -> float | None:
    """The last number in `text` (commas, $ and trailing dots tolerated), or None."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    matches = _NUMBER_RE.findall(str(text).replace("$", ""))
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def ground_truth_number(answer: str) -> float | None:
    """GSM8K answers end with '#### <number>'; plain numbers are accepted too."""
    return parse_number(answer.split("####")[-1])


class CheckAnswer:
    """Tells the model whether its final numeric answer is right."""

    schema: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": "check_answer",
            "description": "Submit your final numeric answer; the reply says whether it is correct.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "The final answer, a number."}},
                "required": ["answer"],
            },
        },
    }

    def __init__(self, tolerance: float = 1e-6):
        self.tolerance = tolerance
        self._truth: dict[str, float | None] = {}
        self._solved: dict[str, bool] = {}

    async def create(self, instance_id: str, ground_truth: str | None = None, **kwargs: Any) -> str:
        self._truth[instance_id] = ground_truth_number(ground_truth) if ground_truth else None
        self._solved[instance_id] = False
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        truth = self._truth.get(instance_id)
        submitted = parse_number(arguments.get("answer"))
        if truth is None:
            return ToolResult("Error: this task has no ground truth to check against.")
        if submitted is None:
            return ToolResult("Error: the answer must contain a number.", reward=0.0)
        correct = abs(submitted - truth) <= self.tolerance * max(1.0, abs(truth))
        first = correct and not self._solved[instance_id]
        self._solved[instance_id] = self._solved[instance_id] or correct
        return ToolResult("Correct." if correct else "Incorrect. Check your work and try again.",
                          reward=1.0 if first else 0.0, metrics={"answer_correct": float(correct)})

    async def reward(self, instance_id: str) -> float | None:
        return 1.0 if self._solved.get(instance_id) else 0.0

    async def release(self, instance_id: str) -> None:
        self._truth.pop(instance_id, None)
        self._solved.pop(instance_id, None)
