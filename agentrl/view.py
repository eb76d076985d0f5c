"""`agentrl view RUN_DIR`: a run's trajectories as one self-contained HTML page.

Reads `<run_dir>/trajectories/step_<N>.jsonl` (written by training), `rollout.jsonl` and
`eval_*.jsonl`, and writes a page with inline CSS and JS only (it opens without a network): each
conversation turn by turn, reward and finish reason, the token stream with trained tokens (loss
mask 1) set apart from masked ones and the sampling logprob on hover, filters by step, reward and
finish reason, and the members of a group side by side. The page is rendered by Jinja2 with
autoescaping, so tool output and model text always show as text; the token spans are built here
with markupsafe's `escape` because a template loop over every token would be slower.

This module computes no statistics and changes no files besides the page it writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from markupsafe import Markup, escape

from agentrl.errors import ConfigError
from agentrl.finite import finite_number
from agentrl.jsonl import jsonl_objects

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")
_REQUIRED = ("task_id", "group_id", "token_ids", "loss_mask", "messages")
MAX_UTF8_TOKENS = 4  # a character split over more tokens than this is shown as replacement chars


@dataclass
class Group:
    """Trajectories of one task sampled together (same source, step and group_id)."""

    source: str
    step: int
    group_id: str
    task_id: str
    members: list[dict[str, Any]] = field(default_factory=list)


def trajectory_files(run_dir: Path) -> list[tuple[Path, str, int | None]]:
    """(file, source label, step from the file name) for every trajectory file of a run."""
    found: list[tuple[Path, str, int | None]] = []
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl"),
                       key=lambda p: int(m.group(1)) if (m := _STEP_FILE.fullmatch(p.name)) else -1):
        if (match := _STEP_FILE.fullmatch(path.name)) and path.is_file():
            found.append((path, "train", int(match.group(1))))
    if (run_dir / "rollout.jsonl").is_file():
        found.append((run_dir / "rollout.jsonl", "rollout", None))
    found += [(path, path.stem, None) for path in sorted(run_dir.glob("eval_*.jsonl")) if path.is_file()]
    return found


def load_trajectories(run_dir: Path, steps: set[int] | None = None) -> list[dict[str, Any]]:
    """Every trajectory of the run (of `steps` only, if given), each with 'step' and 'source' set.
    A training step's file is read only when its step is wanted; a last line cut short by a run
    that stopped while writing it is skipped with a warning (jsonl_objects)."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    sources = trajectory_files(run_dir)
    if not sources:
        raise ConfigError(f"{run_dir}: no trajectory files (trajectories/step_N.jsonl, rollout.jsonl, eval_*.jsonl)")
    records: list[dict[str, Any]] = []
    present = {file_step for _, _, file_step in sources if file_step is not None}
    for path, source, file_step in sources:
        if steps is not None and file_step is not None and file_step not in steps:
            continue
        for number, record in jsonl_objects(path, cut_short_end=True, non_finite=True):
            problem = _malformed(record)
            if problem:
                raise ConfigError(f"{path}:{number}: not a trajectory ({problem})")
            record["step"] = int(record.get("step", file_step or 0))
            record["source"] = source
            present.add(record["step"])
            if steps is None or record["step"] in steps:
                records.append(record)
    if steps is not None and not records:
        raise ConfigError(f"--steps {','.join(map(str, sorted(steps)))}: no trajectories for these steps in "
                          f"{run_dir} (steps present: {', '.join(map(str, sorted(present)))})")
    if not records:  # files holding nothing but a line cut short
        raise ConfigError(f"{run_dir}: no complete trajectory to show")
    return records


def _malformed(record: dict[str, Any]) -> str | None:
    """What keeps `record` from being shown as a trajectory (the page would fail on it), or None."""
    missing = [key for key in _REQUIRED if key not in record]
    if missing:
        return f"missing {', '.join(missing)}"

    def numbers(key: str, kind: type | tuple[type, ...]) -> bool:
        value = record.get(key, [])
        return isinstance(value, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in value)

    def aligned(key: str) -> bool:  # one entry per token, or the page would drop tokens silently
        tokens = record.get("token_ids")
        return isinstance(record.get(key), list) and isinstance(tokens, list) and len(record[key]) == len(tokens)

    messages = record["messages"]
    checks = [("step", isinstance(record.get("step", 0), int) and not isinstance(record.get("step"), bool),
               "an integer"),
              ("token_ids", numbers("token_ids", int) and all(0 <= x < 2**31 for x in record["token_ids"]),
               "a list of token ids (integers from 0)"),
              ("loss_mask", numbers("loss_mask", int) and aligned("loss_mask"), "a list of integers, one per token"),
              ("logprobs", record.get("logprobs") is None or numbers("logprobs", (int, float)), "a list of numbers"),
              ("messages", isinstance(messages, list) and all(isinstance(m, dict) and _calls_ok(m) for m in messages),
               "a list of objects (tool_calls a list of objects)"),
              ("reward", record.get("reward") is None or finite_number(record["reward"]) is not None,
               "a finite number"),
              ("metrics", record.get("metrics") is None or isinstance(record["metrics"], dict), "an object")]
    bad = next(((key, what) for key, ok, what in checks if not ok), None)
    return f"{bad[0]} is {json.dumps(record.get(bad[0]))[:40]}, not {bad[1]}" if bad else None


def _calls_ok(message: dict[str, Any]) -> bool:
    calls = message.get("tool_calls")
    return calls is None or (isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function", c), dict) for c in calls))


def run_model(run_dir: Path, model: str | None) -> str:
    """The tokenizer to decode with: --model, else model.path of the run's config.yaml. A relative
    path there meant the directory the run started in: where it is no directory from here, it is
    taken relative to that one, found by matching the config's relative output_dir with run_dir."""
    if model:
        return model
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml to take model.path from; pass --model")
    try:
        config = yaml.safe_load(config_path.read_text()) or {}
        path, output_dir = config.get("model", {}).get("path"), config.get("output_dir")
    except (yaml.YAMLError, AttributeError, UnicodeDecodeError):
        raise ConfigError(f"{config_path}: not a recipe mapping with model.path; pass --model") from None
    if not path:
        raise ConfigError(f"{config_path}: no model.path; pass --model")
    path = str(path)
    if Path(path).is_absolute() or Path(path).is_dir() or not isinstance(output_dir, str):
        return path
    parts, here = Path(output_dir).parts, run_dir.resolve().parts
    if Path(output_dir).is_absolute() or ".." in parts or here[len(here) - len(parts):] != parts:
        return path
    started_in = Path(*here[:len(here) - len(parts)])
    return str(started_in / path) if (started_in / path).is_dir() else path


def token_pieces(tokenizer: Any, ids: list[int], cache: dict[int, str]) -> list[str]:
    """The text of each token; their concatenation is the decoded sequence.

    A byte-level token can hold part of a UTF-8 character; its text then goes to the token that
    completes the character (the earlier ones show as empty), instead of a replacement mark each.
    """
    pieces: list[str] = []
    start = 0
    for i, token_id in enumerate(ids):
        if start == i and token_id in cache:
            text = cache[token_id]
        else:
            text = tokenizer.decode(ids[start:i + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if start == i:
                cache[token_id] = text
        if text.endswith("\ufffd") and i + 1 - start < MAX_UTF8_TOKENS and i + 1 < len(ids):
            pieces.append("")
            continue
        pieces.append(text)
        start = i + 1
    return pieces


def token_html(pieces: list[str], mask: list[int], logprobs: list[float]) -> Markup:
    """One span per token: class 't' (trained, position and logprob as the hover title) or 'm' (masked)."""
    spans = []
    for position, (text, trained) in enumerate(zip(pieces, mask)):
        shown = escape(text.replace("\n", "\u21b5\n"))
        if trained:
            lp = logprobs[position] if position < len(logprobs) else float("nan")
            spans.append(f'<span class="t" title="#{position} logprob {lp:.4f}">{shown}</span>')
        else:
            spans.append(f'<span class="m">{shown}</span>')  # no title: most tokens are masked, keep pages small
    return Markup("".join(spans))


def _message_view(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if content is not None and not isinstance(content, str):  # e.g. a list of content parts
        content = json.dumps(content, ensure_ascii=False)
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append({"name": str(fn.get("name", "?")), "arguments": json.dumps(fn.get("arguments"), ensure_ascii=False)})
    return {"role": str(message.get("role", "?")), "name": message.get("name"), "calls": calls,
            "content": content}


def _card(record: dict[str, Any], tokenizer: Any, cache: dict[int, str]) -> dict[str, Any]:
    reward = record.get("reward")
    pieces = token_pieces(tokenizer, record["token_ids"], cache)
    return {"reward": reward, "reward_attr": "nan" if reward is None else repr(float(reward)),
            "finish": str(record.get("finish", "?")), "weight_version": record.get("weight_version"),
            "error": record.get("error"), "metrics": sorted((record.get("metrics") or {}).items()),
            "messages": [_message_view(m) for m in record["messages"]], "step": record["step"],
            "num_tokens": len(record["token_ids"]), "num_trained": sum(record["loss_mask"]),
            "tokens": token_html(pieces, record["loss_mask"], record.get("logprobs") or [])}


def build_page(title: str, records: list[dict[str, Any]], tokenizer: Any) -> str:
    """The HTML page for these trajectories, group members side by side."""
    import jinja2

    groups: dict[tuple[str, int, str], Group] = {}
    cache: dict[int, str] = {}
    for record in records:
        key = (record["source"], record["step"], str(record["group_id"]))
        group = groups.setdefault(key, Group(*key, task_id=str(record["task_id"])))
        group.members.append(_card(record, tokenizer, cache))
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(files("agentrl.templates").joinpath("view_page.html.jinja").read_text())
    finishes = Counter(str(r.get("finish", "?")) for r in records)
    return template.render(title=title, groups=sorted(groups.values(), key=lambda g: (g.step, g.source, g.group_id)),
                           steps=sorted({r["step"] for r in records}), finishes=sorted(finishes.items()),
                           total=len(records))


def parse_steps(text: str | None) -> set[int] | None:
    if text is None or text.strip() in ("", "all"):
        return None
    try:
        return {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ConfigError(f"--steps: '{text}' is not a comma-separated list of step numbers") from None


def run_view(run_dir: str | Path, steps: str | None = None, out: str | Path | None = None,
             model: str | None = None) -> Path:
    """`agentrl view`: writes the page (default <run_dir>/view.html) and returns its path."""
    from agentrl.models import load_tokenizer

    run_dir = Path(run_dir)
    out_path = Path(out) if out else run_dir / "view.html"
    if out_path.is_dir():
        raise ConfigError(f"--out: '{out_path}' is a directory; give a file name, e.g. {out_path / 'view.html'}")
    records = load_trajectories(run_dir, parse_steps(steps))
    name = run_model(run_dir, model)
    try:
        tokenizer = load_tokenizer(name, needs_template=False)  # it only decodes
    except ConfigError as e:
        raise ConfigError(e if model else f"{e}; it is model.path of {run_dir / 'config.yaml'}: pass --model") from None
    # Half a surrogate pair (a tool's output, kept by jsonl_line as its escape) is shown as that
    # escape; it cannot be encoded as UTF-8.
    page = build_page(run_dir.resolve().name, records, tokenizer).encode("utf-8", errors="backslashreplace")
    staging = out_path.with_name(f".{out_path.name}.tmp")
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_bytes(page)
        os.replace(staging, out_path)  # an earlier page stays whole until this one is
    except OSError as e:
        with contextlib.suppress(OSError):  # (its parent may be no directory)
            staging.unlink(missing_ok=True)
        raise ConfigError(f"--out: cannot write '{out_path}' ({e.strerror}: '{e.filename}')") from None
    shown = sorted({r["step"] for r in records})
    print(f"wrote {out_path} ({len(records)} trajectories, steps {', '.join(map(str, shown))})")
    return out_path
