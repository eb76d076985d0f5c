"""Where a run's numbers go: TensorBoard, metrics.jsonl, a console progress bar, and W&B if asked.

`RunLogger` is the one sink the training driver writes a step's metrics to. TensorBoard event files
(torch's `SummaryWriter`) are always written under `<run_dir>/tensorboard/`, with flat metric names
grouped into sections (`reward_mean` → `reward/mean`); `<run_dir>/metrics.jsonl` gets one flushed
JSON line per step, exactly as logged; tqdm draws the progress bar with its ETA. Weights & Biases is
used only when a project name is given, and is imported only then (`check_wandb` tries the import
before a run loads its models).

This module computes no metrics and decides nothing about what to log; it only records.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from tqdm import tqdm

from agentrl.errors import ConfigError

# Flat keys the driver emits → TensorBoard section; keys not listed go by prefix, then to "train/".
_TAGS = {
    "accuracy": "reward/accuracy", "kl_ref": "kl/ref", "approx_kl": "kl/approx",
    "parse_error_rate": "tools/parse_error_rate", "mean_turns": "episode/mean_turns",
    "response_tokens": "episode/response_tokens", "tokens_generated": "episode/tokens_generated",
    "episodes": "episode/count",
}
_PREFIXES = {"reward_": "reward", "time_": "time", "finish_": "finish", "tool_": "tools", "value_": "critic"}
# (metric, label, format) shown beside the bar when the step logged it
_BAR_NUMBERS = (("reward_mean", "reward", ".3f"), ("accuracy", "acc", ".2f"), ("tool_call_rate", "tools", ".2f"),
                ("loss", "loss", ".4f"), ("kl_ref", "kl_ref", ".4f"), ("rollout_logprob_diff", "engine_gap", ".1e"))


def tag_for(key: str) -> str:
    """The TensorBoard/W&B name of a metric; a key that already holds a '/' is its own tag."""
    if "/" in key:
        return key
    if key in _TAGS:
        return _TAGS[key]
    for prefix, group in _PREFIXES.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            return f"{group}/{key[len(prefix):]}"
    return f"train/{key}"


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers among the metrics (bools and strings are not plotted); 'step' is the axis."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _import_wandb(project: str) -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise ConfigError(f"wandb project '{project}' is configured but the wandb package is not installed "
                          f"(pip install wandb, or leave the wandb project unset)") from None


def check_wandb(project: str | None) -> None:
    """With a W&B project configured, the wandb package imports, or a ConfigError naming
    trainer.wandb_project. The driver calls it before any model loads, so that a missing package
    costs no model load (RunLogger itself starts after the models)."""
    if project:
        try:
            _import_wandb(project)
        except ConfigError as e:
            raise ConfigError(f"trainer.wandb_project: {e}") from None


WANDB_RUN_ID = "wandb_run_id"


class RunLogger:
    """Records each step's metrics; use as a context manager or call `close()` at the end.

    `start_step` is the last step already done when a run resumes: metrics.jsonl keeps its lines up
    to that step (rewritten from the checkpoint's `history` when given) and drops later ones, and TensorBoard purges the events of later steps, so a killed
    and resumed run shows each step once. A fresh run (0) starts both from empty. A W&B run's id is
    kept in <run_dir>/wandb_run_id, and a resumed run logs into that W&B run again (W&B keeps the
    values it already has for steps past the checkpoint).
    """

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any], total_steps: int,
                 wandb: str | None = None, *, start_step: int = 0, history: list[Mapping[str, Any]] | None = None,
                 progress: bool = True):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb, self._wandb_run = None, None
        if wandb:
            self._wandb = _import_wandb(wandb)
            id_file = self.run_dir / WANDB_RUN_ID
            again = {"id": id_file.read_text().strip(), "resume": "allow"} if start_step and id_file.is_file() else {}
            self._wandb_run = self._wandb.init(
                project=wandb, name=self.run_dir.name, dir=str(self.run_dir), config=dict(config), **again)
            id_file.write_text(f"{self._wandb_run.id}\n")
        self.metrics_path = self.run_dir / "metrics.jsonl"
        # The kept lines go to a new file that replaces the old one, so a crash here loses nothing.
        staging = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        staging.write_text("".join(self._kept_lines(start_step, history)))
        os.replace(staging, self.metrics_path)
        self._jsonl = self.metrics_path.open("a")
        # purge_step drops events at or after it that an earlier (killed or older) run left behind
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        self._tb.add_text("config", "```\n" + json.dumps(dict(config), indent=2, default=str) + "\n```", start_step)
        self._bar = (tqdm(total=total_steps, initial=start_step, desc="train", file=sys.stdout, dynamic_ncols=True)
                     if progress else None)

    def _kept_lines(self, start_step: int, history: list[Mapping[str, Any]] | None) -> list[str]:
        """The lines of steps up to `start_step`: from the checkpoint's `history` when it holds them
        all (it was synced to disk; lines of metrics.jsonl may have been lost with the machine),
        else those metrics.jsonl has."""
        if start_step > 0 and history is not None and len(history) == start_step:
            return [json.dumps(_record(step, metrics)) + "\n" for step, metrics in enumerate(history, start=1)]
        if start_step <= 0 or not self.metrics_path.is_file():
            return []
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash being resumed from
                continue
            if isinstance(record, dict) and record.get("step", 0) <= start_step:
                kept.append(line + "\n")
        return kept

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One step: a JSONL line ({'step': step, **metrics}), scalars in TensorBoard and W&B, the bar."""
        self._jsonl.write(json.dumps(_record(step, metrics)) + "\n")
        self._jsonl.flush()
        scalars = {tag_for(k): v for k, v in _numeric(metrics).items()}
        for tag, value in scalars.items():
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=step)
        if self._bar is not None:
            self._bar.set_postfix({label: format(float(metrics[key]), fmt)
                                   for key, label, fmt in _BAR_NUMBERS if key in metrics}, refresh=False)
            self._bar.update(max(step - self._bar.n, 0))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._tb.close()
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
            # wandb's service process stops now rather than at exit: an in-process SGLang engine,
            # closed as the run ends, kills every child process, and wandb's exit hook would then
            # fail on the lost connection (a traceback after every such run).
            self._wandb.teardown()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _record(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """One line of metrics.jsonl."""
    return {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
