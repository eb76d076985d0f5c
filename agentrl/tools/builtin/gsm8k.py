"""`check_answer`: the model submits a number, the tool compares it with the task's ground truth.

Stateful per episode (verl's Gsm8kTool lifecycle): `create` receives the ground truth, `execute`
checks a submission and returns a step reward and a sentence the model can react to, `reward`
reports whether the episode's first submission was right.

Only the first `max_attempts` submissions (default 1) are checked; a later one is answered "not
checked" without saying whether it is right. A checker that answers every guess lets a policy try
numbers until one is marked correct and then state that one: the outcome reward (and held-out
accuracy, since eval keeps the tools) would count answers found by guessing, and GRPO would learn
to guess. For the same reason the step reward, the final reward and the `answer_correct` metric
count the first submission only, whatever `max_attempts` allows.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from agentrl.tools.base import ToolResult

# A run of digits with the punctuation that can join them, exponents included: one chunk, so
# "10-12", "3,4,5" or "1e3-1e4" is never read as "-12", "345" or "-1e4". A minus counts as a sign
# only where it cannot be a hyphen or a subtraction (not after a letter, digit, dot or comma);
# U+2212 is the typographic minus.
# An exponent's minus is the class's own (only its plus is the exponent's): were both to match it,
# each "e-" could be read two ways, and a reply of 24 of them took seconds on the event loop.
# A chunk starts where no number's punctuation runs into it: not after a digit, nor after a dot or
# comma that follows a digit ('1.2.3' is one chunk). A dot or comma after anything else is prose
# ('Wait...18', 'So,-18'), though it does not open a leading-dot decimal there ('...18' is not .18).
_CANDIDATE_RE = re.compile(r"(?:(?:(?<![\w.,])|(?<=[.,])(?<!\d[.,]))(?P<sign>[-\u2212]))?"
                           r"(?P<body>(?:(?<![\d.,])\.?|(?<=[.,])(?<!\d[.,]))"
                           r"\d(?:(?:[\d.,\-\u2212]|[eE]\+?)*\d)?)")
# What a chunk must be to count: thousands separators only in groups of three, one decimal point,
# at most one exponent ('1e6' is a million, not 6).
_WELL_FORMED_RE = re.compile(r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+\u2212]?\d+)?")


def parse_number(text: str | float | int | None) -> Fraction | None:
    """The last number in `text`, exactly (a float holds whole numbers only up to 2**53: past it, a
    truth and a neighbouring wrong answer were one float, and the wrong answer scored), or None.

    Tolerated: '$', thousands separators ('1,234,567', LaTeX's '1{,}234' and '1\\,234'), a
    leading-dot decimal ('.5'), a sign at the start of a word ('-3', '$-7', '−3'), trailing
    punctuation ('18.', '18,'), an exponent ('1e6', '2.5E-3'). Digits joined by hyphens,
    ill-grouped commas or several dots are not a number: a range ('3-4', '10-12', '1e3-1e4'), a
    date ('2023-10-05'), a subtraction ('5-1'), a list ('3,4,5') or a version ('1.2.3') is skipped,
    so the number before it counts ('Answer: 12 (ages 10-12)' is 12; 'Answer: 3-4' has none).
    Prose punctuation right before a number does not hide it ('So,18', 'Wait...18').
    """
    if text is None:
        return None
    if isinstance(text, (int, float)):
        try:
            number = float(text)
        except OverflowError:  # an integer of 400 digits (JSON allows it): not an answer, as '1e400' is not
            return None
        return Fraction(text) if math.isfinite(number) else None
    numbers = [((m["sign"] or "") + m["body"]).replace(",", "").replace("\u2212", "-")
               for m in _CANDIDATE_RE.finditer(_plain(str(text))) if _WELL_FORMED_RE.fullmatch(m["body"])]
    numbers = [n for n in numbers if math.isfinite(float(n))]  # '1e400' overflows: not an answer
    return _exact(numbers[-1]) if numbers else None


def _exact(number: str) -> Fraction:
    """A well-formed number's exact value. One of hundreds of characters, or with an exponent past
    a float's, takes its float's value: exactly, it would be an integer of as many digits (and
    Python refuses to read one past 4300)."""
    exponent = number.lower().partition("e")[2]
    if len(number) > 400 or (exponent and abs(int(exponent)) > 400):
        return Fraction(float(number))
    return Fraction(number)


def _plain(text: str) -> str:
    """Text without '$', its LaTeX thousands separators ('1{,}200', '1\\,200') made commas."""
    return text.replace("$", "").replace("{,}", ",").replace("\\,", ",")


def ground_truth_number(answer: str) -> Fraction | None:
    """GSM8K answers end with '#### <number>'; plain numbers are accepted too."""
    return parse_number(answer.split("####")[-1])


def answer_matches(submitted: Fraction, truth: Fraction, tolerance: float) -> bool:
    """Whether `submitted` is `truth` within the relative `tolerance` (of max(1, |truth|)), which
    is for rounding, and within less than half a unit of the truth's last decimal place: no other
    number written to the truth's precision matches it (at 1e-6, a truth of 1,450,000 took
    1,450,001 for right, and one of 1,450,000.5 took 1,450,001.5)."""
    places = 0
    while (truth * 10**places).denominator != 1 and places < 400:  # a decimal truth has a last place
        places += 1
    difference = abs(Fraction(submitted) - truth)
    return difference <= tolerance * max(1, abs(truth)) and difference < Fraction(1, 2 * 10**places)


def checked_tolerance(tolerance: float) -> float:
    """A relative answer tolerance, or a ValueError: NaN or one below 0 would mark every answer wrong."""
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number of at least 0, got {tolerance}")
    return tolerance


class CheckAnswer:
    """Tells the model whether its final numeric answer is right, for its first `max_attempts` submissions."""

    def __init__(self, tolerance: float = 1e-6, max_attempts: int = 1):
        self.tolerance = checked_tolerance(tolerance)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be a whole number of at least 1, got {max_attempts!r}")
        self.max_attempts = max_attempts
        # Per instance: the description tells the model how many submissions are checked, so that
        # it does not spend its turns on answers nobody will check.
        only = ("only your first submission is checked" if max_attempts == 1
                else f"only your first {max_attempts} submissions are checked")
        self.schema: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": "check_answer",
                "description": f"Submit your final numeric answer; the reply says whether it is correct ({only}).",
                "parameters": {
                    "type": "object",
                    "properties": {"answer": {"type": ["string", "number"], "description": "The final answer, a number."}},
                    "required": ["answer"],
                },
            },
        }
        self._truth: dict[str, Fraction | None] = {}
        self._attempts: dict[str, int] = {}
        self._first_correct: dict[str, bool] = {}

    async def create(self, instance_id: str, ground_truth: str | None = None, **kwargs: Any) -> str:
        self._truth[instance_id] = ground_truth_number(ground_truth) if ground_truth else None
        self._attempts[instance_id] = 0
        self._first_correct[instance_id] = False
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        truth = self._truth.get(instance_id)
        if truth is None:
            return ToolResult("Error: this task has no ground truth to check against.")
        attempts = self._attempts.get(instance_id, 0)
        if attempts >= self.max_attempts:  # said without checking: the reply must not reveal the answer
            checked = "1 submission" if self.max_attempts == 1 else f"{self.max_attempts} submissions"
            return ToolResult(f"Not checked: an answer was already submitted, and only {checked} per task can be checked.",
                              metrics={"answers_refused": 1.0})
        submitted = parse_number(arguments.get("answer"))
        if submitted is None:  # reveals nothing, so it uses up no submission
            return ToolResult("Error: the answer must contain a number.")
        self._attempts[instance_id] = attempts + 1
        correct = answer_matches(submitted, truth, self.tolerance)
        left = self.max_attempts - attempts - 1
        if correct:
            text = "Correct."
        elif left:
            text = f"Incorrect. You may submit {left} more answer{'s' if left != 1 else ''}."
        else:  # no invitation to try again: nothing more would be checked
            text = "Incorrect. No more answers will be checked."
        if attempts:  # a later submission: its feedback only; the reward counts the first
            return ToolResult(text)
        self._first_correct[instance_id] = correct
        return ToolResult(text, reward=1.0 if correct else 0.0, metrics={"answer_correct": float(correct)})

    async def reward(self, instance_id: str) -> float | None:
        return 1.0 if self._first_correct.get(instance_id) else 0.0

    async def release(self, instance_id: str) -> None:
        self._truth.pop(instance_id, None)
        self._attempts.pop(instance_id, None)
        self._first_correct.pop(instance_id, None)
