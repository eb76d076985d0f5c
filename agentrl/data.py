"""Tasks for rollouts: rows of jsonl files, of other files or a hub id through `datasets`, or
generated arithmetic; and conversations for SFT.

JSONL is read here, line by line, so that a bad line is a ConfigError naming its file and line, and
every row and conversation is checked when read (the prompt and answer there, chat messages as a
template takes them): a mistake stops the command before a model loads, not in an episode or a
template later. The generator needs no files: word problems whose numbers are too large to multiply in the head,
with GSM8K-style answers ('#### <number>'), so the same rewards and tools apply to both sources.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Iterator

from agentrl.errors import ConfigError
from agentrl.jsonl import jsonl_objects
from agentrl.rollout.chat import normalize_tool_calls
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
        c = rng.randint(1, max(1, a * b // 2))  # 1 × 1: a*b//2 is 0
        expression = expression.format(a=a, b=b, c=c)
        tasks.append(Task(id=f"arith-{seed}-{i}", prompt=template.format(a=a, b=b, c=c),
                          answer=f"#### {evaluate(expression)}", metadata={"expression": expression}))
    return tasks


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}  # file suffix → datasets builder


def dataset_tasks(source: str, files: list[str], split: str, prompt_key: str, answer_key: str | None,
                  id_key: str | None = None, limit: int | None = None, files_key: str = "data.files") -> list[Task]:
    """The first `limit` rows of a jsonl/json/parquet/csv file set, or of a hub dataset id, as Tasks;
    problems with the files are ConfigErrors naming `files_key`, the recipe key that lists them. A
    bad row names its file and line in jsonl files (read here, every line checked) or its row number
    among the rows read by `datasets`."""
    keys = (prompt_key, answer_key, id_key)
    if source == "files":
        suffix = _files_format(files, files_key)
        if suffix == "jsonl":
            tasks = []
            for i, (where, row) in enumerate(_jsonl_rows(files)):
                task = _row_task(row, where, i, *keys)
                if limit is None or i < limit:
                    tasks.append(task)
            return _unique_ids(tasks, id_key)
        tasks = []
        for f in files:  # one file at a time, so that a bad row names its file
            if limit is not None and len(tasks) >= limit:
                break
            ds = _load_dataset(BUILDERS[suffix], "train", [f], files_key, None if limit is None else limit - len(tasks))
            _check_columns(ds, keys, f)
            tasks += [_row_task(_columns(row), f"{f} row {i + 1}", len(tasks) + i, *keys) for i, row in enumerate(ds)]
        return _unique_ids(tasks, id_key)
    ds = _load_dataset(source, split, limit=limit)
    _check_columns(ds, keys, f"data.source '{source}'")
    return _unique_ids([_row_task(_columns(row), f"data.source '{source}' row {i + 1}", i, *keys)
                        for i, row in enumerate(ds)], id_key)


def _columns(row: dict[str, Any]) -> dict[str, Any]:
    """A row read through `datasets`, its columns as they are (a null cell stays null) and their
    nested values `_unfilled`."""
    return {column: _unfilled(value) for column, value in row.items()}


def _unfilled(value: Any) -> Any:
    """A row read through `datasets` without the nulls its schema filled in. A struct column has
    one set of keys for every row, so a key a row never had reads as null (a parquet file written
    from rows with different `tool_kwargs` tools, or messages only some of which have a `name`):
    such keys are dropped, so that a tool's create() gets its defaults and a template sees no key
    rather than a null. A null written in the file cannot be told from those and goes too. A
    message (a mapping with a `role`) keeps its `content`, which may be null beside tool calls."""
    if isinstance(value, dict):
        kept = {k: _unfilled(v) for k, v in value.items() if v is not None}
        return {"content": None, **kept} if "role" in kept and "content" in value else kept
    if isinstance(value, list):
        return [_unfilled(v) for v in value]
    return value


def _check_columns(ds: Any, keys: tuple[str | None, ...], where: str) -> None:
    for key in keys if len(ds) else ():
        if key is not None and key not in ds.column_names:
            raise ConfigError(f"{where}: column '{key}' not in {ds.column_names}")


def _unique_ids(tasks: list[Task], id_key: str | None) -> list[Task]:
    """`tasks`, or a ConfigError naming the two rows that share an id: a task's id names its group."""
    first: dict[str, Task] = {}
    for task in tasks:
        earlier = first.setdefault(task.id, task)
        if id_key and earlier is not task:
            raise ConfigError(f"{earlier.metadata['where']} and {task.metadata['where']} share the id {task.id!r} "
                              f"(column '{id_key}')")
    return tasks


def _files_format(files: list[str], files_key: str) -> str:
    """The one suffix of `files` (jsonl, json, parquet or csv), or a ConfigError naming `files_key`."""
    if not files:
        raise ConfigError(f"{files_key}: source 'files' needs at least one file")
    suffixes = [Path(f).suffix.lstrip(".") for f in files]
    for f, suffix in zip(files, suffixes):
        if not Path(f).is_file():
            raise ConfigError(f"{files_key}: '{f}' not found")
        if suffix not in BUILDERS:
            raise ConfigError(f"{files_key}: '{f}' is not .jsonl, .json, .parquet or .csv")
        if suffix != suffixes[0]:
            raise ConfigError(f"{files_key}: '{f}' is .{suffix} but '{files[0]}' is .{suffixes[0]}; "
                              "the files are read as one table of one format")
    return suffixes[0]


def _jsonl_rows(files: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """('file:line', row) for every row of jsonl files, so that a bad row names its file and line."""
    for f in files:
        for number, row in jsonl_objects(f):
            yield f"{f}:{number}", row


def _load_dataset(name: str, split: str, files: list[str] | None = None, files_key: str = "",
                  limit: int | None = None) -> Any:
    """The first `limit` rows of a `datasets` split: `name` a builder ('parquet', ...) reading
    `files`, or a hub dataset id."""
    import datasets

    # datasets counts each load of its file builders (csv, json, parquet) with an HTTP request to
    # S3: reading a local task file sent traffic off the machine, and waited out the request's
    # timeout where there is no network. Only the count is lost.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    if files is None and Path(name).is_file():  # not a dataset name: datasets would say it is not found
        raise ConfigError(f"data.source: '{name}' is a file; give it as data.source: files, data.files: [{name}]")
    if files is not None and all([_no_rows(name, f) for f in files]):  # every file checked, not up to one with rows
        return []  # datasets cannot even infer a schema from empty files, or read a table of no rows
    # CSV cells as written: pandas would read the answer 0012 as 12.0 and the ids 001 and 01 as one;
    # and without index_col=False, rows one cell longer than the header (a trailing comma) would
    # have their first cell taken for an index and every other moved one column to the left.
    try:
        options = {"features": _text_columns(files[0]), "index_col": False} if name == "csv" and files else {}
        ds = (datasets.load_dataset(name, split=split) if files is None
              else datasets.load_dataset(name, data_files=files, split=split, **options))
    except Exception as e:  # a malformed file or a missing dataset: name it, without datasets' traceback
        first = (str(e).splitlines() or [""])[0]
        if e.__cause__ is not None:  # datasets' generic "an error occurred" wraps the reason
            first += f": {type(e.__cause__).__name__}: {(str(e.__cause__).splitlines() or [''])[0]}"
        if files is None:
            raise ConfigError(f"data.source: cannot load dataset '{name}' ({first})") from None
        raise ConfigError(f"{files_key}: cannot read {files} ({type(e).__name__}: {first})") from None
    return ds.select(range(min(limit, len(ds)))) if limit is not None else ds


def _no_rows(builder: str, path: str) -> bool:
    """Whether a task file holds no rows: empty, a CSV header alone, a parquet table of none. A
    CSV row with more cells than the header, past an empty trailing one, is a ConfigError."""
    if Path(path).stat().st_size == 0:
        return True
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows == 0
        except Exception:  # not parquet after all: datasets names the problem
            return False
    if builder != "csv":
        return False
    import csv

    rows = 0
    csv.field_size_limit(2**31 - 1)  # a task's prompt may be longer than the module's 128 KiB default
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        try:
            for number, row in enumerate(reader, start=1):
                if len(row) > len(header) and any(cell.strip() for cell in row[len(header):]):
                    raise ConfigError(f"{path} row {number}: {len(row)} cells under a header of "
                                      f"{len(header)} columns ({', '.join(header)})")
                rows += bool(row)
        except csv.Error:  # malformed: datasets names the problem
            return False
    return rows == 0


def _text_columns(path: str) -> Any:
    """Every column of a CSV file's header as text, for `datasets` to read the cells as written."""
    import csv

    import datasets

    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    names: list[str] = []
    for i, column in enumerate(header):  # as pandas names them: "Unnamed: 0" (a written index), "a.1"
        column = column or f"Unnamed: {i}"
        base, n = column, 0
        while column in names:
            n += 1
            column = f"{base}.{n}"
        names.append(column)
    return datasets.Features({column: datasets.Value("string") for column in names})


def _row_task(row: dict[str, Any], where: str, index: int, prompt_key: str, answer_key: str | None,
              id_key: str | None) -> Task:
    """One row as a Task, or a ConfigError naming the row (`where`) and the key at fault."""
    prompt = _required(row, prompt_key, where)
    if isinstance(prompt, list):
        check_messages(prompt, f"{where}: '{prompt_key}'")
        # OpenAI's JSON-string arguments as mappings, as SFT and the sampled turns render them
        prompt = [normalize_tool_calls(m) for m in prompt]
    elif not isinstance(prompt, str):
        raise ConfigError(f"{where}: '{prompt_key}' must be text or a list of chat messages, not {_kind(prompt)}")
    elif not prompt.strip():  # its episodes would train on answers to nothing
        raise ConfigError(f"{where}: '{prompt_key}' is empty")
    answer = None
    if answer_key:
        answer = _required(row, answer_key, where, "data.answer_key: null runs tasks without answers")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ConfigError(f"{where}: '{answer_key}' must be text or a number, not {_kind(answer)}")
        if isinstance(answer, float) and not math.isfinite(answer):  # 1e400 reads as inf
            raise ConfigError(f"{where}: '{answer_key}' is {answer}, not a finite number")
        if isinstance(answer, str) and not answer.strip():  # as a null one: no episode of it could score
            raise ConfigError(f"{where}: '{answer_key}' is empty (data.answer_key: null runs tasks without answers)")
    if id_key:
        _required(row, id_key, where)
    # Absent or null is none; any other value is checked ([] and "" were read as none as well).
    tool_kwargs = {} if row.get("tool_kwargs") is None else row["tool_kwargs"]
    if not isinstance(tool_kwargs, dict) or not all(isinstance(v, dict) for v in tool_kwargs.values()):
        raise ConfigError(f"{where}: 'tool_kwargs' must map tool names to mappings of create() arguments")
    interaction_kwargs = {} if row.get("interaction_kwargs") is None else row["interaction_kwargs"]
    if not isinstance(interaction_kwargs, dict):
        raise ConfigError(f"{where}: 'interaction_kwargs' must be a mapping (the interaction reads it as "
                          f"task.interaction_kwargs), not {_kind(interaction_kwargs)}")
    return Task(id=str(row[id_key]) if id_key else f"row-{index}", prompt=prompt,
                answer=None if answer is None else str(answer), tool_kwargs=tool_kwargs,
                interaction_kwargs=interaction_kwargs, metadata={"row": index, "where": where})


def _required(row: dict[str, Any], key: str, where: str, hint: str = "") -> Any:
    """row[key], or a ConfigError naming the row: the key is missing (the row's keys are listed, for
    a recipe that names another column) or null."""
    if key not in row:
        has = ", ".join(map(repr, row)) or "no keys"
        raise ConfigError(f"{where}: missing '{key}' (the row has {has}{'; ' + hint if hint else ''})")
    if row[key] is None:
        raise ConfigError(f"{where}: '{key}' is null{f' ({hint})' if hint else ''}")
    return row[key]


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", dict: "a mapping", list: "a list"}.get(
        type(value), type(value).__name__)


ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any, where: str) -> None:
    """Chat messages as a chat template takes them, or a ConfigError naming `where` and the message:
    a non-empty list of objects, each with a role among ROLES and text content (an assistant message
    with tool calls may have none), tool calls each with a function name and an object of arguments."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: expected a non-empty list of chat messages")
    for i, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: message {i} is not a JSON object")
        if "role" not in m:
            raise ConfigError(f"{where}: message {i} has no 'role'")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {i}: role {m['role']!r} is not one of {', '.join(ROLES)}")
        label, content = f"{where}: message {i} ({m['role']})", m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ConfigError(f"{label} has no 'content'")
        if content is not None and not isinstance(content, str):
            raise ConfigError(f"{label}: 'content' must be text, not {_kind(content)}")
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], label)


def _check_tool_calls(calls: Any, label: str) -> None:
    if not isinstance(calls, list):
        raise ConfigError(f"{label}: 'tool_calls' must be a list")
    for j, call in enumerate(calls, start=1):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConfigError(f"{label}: tool call {j} has no function name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            raise ConfigError(f"{label}: tool call {j} ('{fn['name']}'): the arguments are not a JSON object")


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


def conversation_file(path: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """A jsonl file with one {"messages": [...]} object per line, each conversation checked
    (check_messages) and opening with a system or user message before an assistant turn to learn;
    each with its place ('file:line'), for the errors found when it renders."""
    if not Path(path).is_file():
        raise ConfigError(f"sft.data: '{path}' not found")
    conversations = []
    for number, row in jsonl_objects(path):
        messages = row.get("messages")
        if not isinstance(messages, list):
            raise ConfigError(f"{path}:{number}: expected a JSON object with a 'messages' list")
        check_messages(messages, f"{path}:{number}")
        if messages[0]["role"] not in ("system", "user"):
            raise ConfigError(f"{path}:{number}: the conversation opens with role '{messages[0]['role']}'; "
                              "it must open with a system or user message")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{path}:{number}: the conversation has no assistant turn to learn from")
        conversations.append((f"{path}:{number}", messages))
    if not conversations:
        raise ConfigError(f"sft.data: no conversations: '{path}' has no rows")
    return conversations
