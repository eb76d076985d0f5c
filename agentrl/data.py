"""Tasks for rollouts: rows from `datasets` (jsonl, parquet, a hub id) or generated arithmetic.

The generator needs no files: word problems whose numbers are too large to multiply in the head,
with GSM8K-style answers ('#### <number>'), so the same rewards and tools apply to both sources.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

from agentrl.errors import ConfigError
from agentrl.tools.builtin.calculator import evaluate
from agentrl.types import Task

_TEMPLATES = [  # (problem, expression that solves it)
    ("A warehouse has {a} shelves and each shelf holds {b} boxes. How many boxes are there in total?",
     "{a} * {b}"),
    ("A factory makes {a} bolts per hour for {b} hours, then ships {c} of them. How many bolts are left?",
     "{a} * {b} - {c}"),
    ("Tickets cost {a} dollars each. A school buys {b} tickets and gets a discount of {c} dollars. "
     "How many dollars does the school pay?", "{a} * {b} - {c}"),
    ("A farm has {a} rows of {b} apple trees and plants {c} more trees. How many trees are there now?",
     "{a} * {b} + {c}"),
]


def arithmetic_tasks(n: int, seed: int = 0, min_digits: int = 3, max_digits: int = 4) -> list[Task]:
    """`n` multiplication word problems with operands of `min_digits`..`max_digits` digits."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        template, expression = _TEMPLATES[rng.randrange(len(_TEMPLATES))]
        a, b = (_number(rng, rng.randint(min_digits, max_digits)) for _ in range(2))
        c = rng.randint(1, a * b // 2)
        expression = expression.format(a=a, b=b, c=c)
        tasks.append(Task(id=f"arith-{seed}-{i}", prompt=template.format(a=a, b=b, c=c),
                          answer=f"#### {evaluate(expression)}", metadata={"expression": expression}))
    return tasks


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def dataset_tasks(source: str, files: list[str], split: str, prompt_key: str, answer_key: str | None,
                  id_key: str | None = None, limit: int | None = None, files_key: str = "data.files") -> list[Task]:
    """Rows of a jsonl/json/parquet/csv file set, or of a hub dataset id, as Tasks; problems with the
    files are ConfigErrors naming `files_key`, the recipe key that lists them."""
    import datasets

    if source == "files":
        if not files:
            raise ConfigError(f"{files_key}: source 'files' needs at least one file")
        for f in files:
            if not Path(f).is_file():
                raise ConfigError(f"{files_key}: '{f}' not found")
        suffix = Path(files[0]).suffix.lstrip(".")
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(suffix)
        if builder is None:
            raise ConfigError(f"{files_key}: '{files[0]}' is not .jsonl, .json, .parquet or .csv")
        if all(Path(f).stat().st_size == 0 for f in files):
            return []  # datasets cannot even infer a schema from empty files
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train")
        except Exception as e:  # a malformed file: name it, without datasets' traceback
            raise ConfigError(f"{files_key}: cannot read {files} ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0]})") from None
    else:
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:
            raise ConfigError(f"data.source: cannot load dataset '{source}' ({str(e).splitlines()[0]})") from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    for key in (prompt_key, answer_key, id_key):
        if key is not None and key not in ds.column_names:
            raise ConfigError(f"data: column '{key}' not in {ds.column_names}")
    return [_row_task(row, i, prompt_key, answer_key, id_key) for i, row in enumerate(ds)]


def _row_task(row: dict[str, Any], index: int, prompt_key: str, answer_key: str | None, id_key: str | None) -> Task:
    answer = row[answer_key] if answer_key else None
    return Task(id=str(row[id_key]) if id_key else f"row-{index}", prompt=row[prompt_key],
                answer=None if answer is None else str(answer),
                tool_kwargs=row.get("tool_kwargs") or {}, metadata={"row": index})


def arithmetic_demonstrations(n: int, seed: int, min_digits: int, max_digits: int,
                              system_prompt: str | None) -> list[list[dict[str, Any]]]:
    """Conversations solving generated problems with one calculator call, for a supervised warm-up."""
    from agentrl.tools.builtin.calculator import format_number

    conversations = []
    for task in arithmetic_tasks(n, seed, min_digits, max_digits):
        expression = task.metadata["expression"]
        value = format_number(evaluate(expression))
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        conversations.append(task.messages(system_prompt) + [
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "name": "calculator", "content": value},
            {"role": "assistant", "content": f"The answer is {value}."}])
    return conversations


def jsonl_objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line of a JSONL file; a line that is not a JSON
    object is a ConfigError naming the file and the line."""
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{number}: expected a JSON object")
        yield number, row


def conversation_file(path: str) -> list[list[dict[str, Any]]]:
    """A jsonl file with one {"messages": [...]} object per line."""
    if not Path(path).is_file():
        raise ConfigError(f"sft.data: '{path}' not found")
    conversations = []
    for number, row in jsonl_objects(path):
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ConfigError(f"{path}:{number}: expected a JSON object with a 'messages' list")
        if not any(m.get("role") == "assistant" for m in messages):
            raise ConfigError(f"{path}:{number}: the conversation has no assistant turn to learn from")
        conversations.append(messages)
    return conversations
