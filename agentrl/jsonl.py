"""JSON Lines, read line by line: task files, and the files a run writes (metrics, trajectories).

A module of its own, importing nothing heavy, so that `agentrl view` and `agentrl plot` read a run
without loading torch or transformers.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

from agentrl.errors import ConfigError


class RepeatedJSONKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    row = dict(pairs)
    if len(row) < len(pairs):
        seen: set[str] = set()
        raise RepeatedJSONKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return row


def jsonl_objects(path: str | Path, cut_short_end: bool = False,
                  non_finite: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line of a JSONL file; a line that is not UTF-8 or not
    a JSON object is a ConfigError naming the file and the line. Lines end at newline characters only:
    JSON text may hold U+2028 and the other characters str.splitlines() also splits at.

    With `cut_short_end` (files a run appends to), a last line that has no newline and does not
    parse, as a process killed while writing it leaves it, is skipped with a warning. With
    `non_finite` (agentrl's own output, which Python's json writes), NaN and Infinity read as floats:
    a diverged step's loss must not make its run unreadable; in task files they are refused, as are
    numbers past a float's range (which would read as infinity) and a key repeated in one object
    (JSON would keep its last value without a word)."""
    with open(path, "rb") as file:  # line by line: a task file may not fit in memory twice
        for number, raw in enumerate(file, start=1):
            raw = raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw  # a UTF-8 BOM is no text
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                row = json.loads(line, parse_constant=None if non_finite else _not_json,
                                 parse_float=None if non_finite else _finite_float,
                                 object_pairs_hook=None if non_finite else _unique_keys)
            except RepeatedJSONKey as e:  # json keeps the last silently; a YAML recipe refuses the same
                raise ConfigError(f"{path}:{number}: key '{e.key}' appears twice in one object") from None
            except RecursionError:  # nesting deeper than Python's json parser goes
                raise ConfigError(f"{path}:{number}: not valid JSON (nested too deeply to read)") from None
            except (UnicodeDecodeError, ValueError) as e:  # ValueError: an integer past Python's 4300 digits
                if cut_short_end and not raw.endswith(b"\n"):
                    print(f"agentrl: {path}:{number}: the last line is cut short (the run stopped while writing "
                          "it); skipped", file=sys.stderr)
                    return
                problem = (f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
                           if isinstance(e, UnicodeDecodeError) else
                           f"not valid JSON ({e.msg if isinstance(e, json.JSONDecodeError) else e})")
                raise ConfigError(f"{path}:{number}: {problem}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object")
            yield number, row


def _finite_float(text: str) -> float:
    """A JSON number as a float, unless it is past a float's range: Python reads `1e400` as inf."""
    value = float(text)
    if not math.isfinite(value):
        raise json.JSONDecodeError(f"{text} is too large for a number", text, 0)
    return value


def _not_json(name: str) -> Any:
    """Python's json reads NaN and Infinity, which are not JSON: an answer NaN would become 'nan'."""
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)
