"""When a value that user code returns (a reward, a tool's metric, an interaction's score) counts as
a number. Imports nothing heavy: `agentrl view` and `agentrl plot` check what they read with it.
"""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any


def _single_element(value: Any) -> Any:
    """The element of a one-element tensor or array (`.item()`), else `value` itself."""
    numel = getattr(value, "numel", None)  # torch (whose `size` is a method)
    size = numel() if callable(numel) else getattr(value, "size", None)  # numpy
    if size == 1 and not isinstance(value, (str, bytes)) and callable(getattr(value, "item", None)):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            return value
    return value


def finite_number(value: Any, limit: float = math.inf) -> float | None:
    """`value` as a finite float of magnitude at most `limit`, or None (None, text, bools, NaN,
    infinity, an int too large for a float, objects): what a tool's metric must be to count (a
    reward: within REWARD_LIMIT). numpy's scalars and Decimals are numbers, and so is the one
    element of a torch tensor or numpy array (a reward model's judge returns `torch.sigmoid(logit)`,
    which the reward function's check took and an interaction score's dropped)."""
    value = _single_element(value)
    # Decimal is no numbers.Real, but float() takes it exactly as the reward function's check does.
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, decimal.Decimal)):
        return None
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return number if math.isfinite(number) and abs(number) <= limit else None
