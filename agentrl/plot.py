"""`agentrl plot RUN_DIR [RUN_DIR ...]`: PNG plots of metrics.jsonl per step, several runs overlaid.

One PNG per panel (reward, accuracy, tool-call rate, KL, lengths, the time split), drawn with
matplotlib's Agg backend so no display is needed. Each run is one colour, labelled with its directory
name; a metric a run did not log is left out, and a panel no run has data for is not written.
This is a quick look at finished runs, not a dashboard: TensorBoard (tracking.py) is the live view.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError
from agentrl.finite import finite_number
from agentrl.jsonl import jsonl_objects

# panel file name → (title, one subplot per key)
LINE_PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("Reward (mean ± std over episodes)", ("reward_mean",)),
    "accuracy": ("Accuracy (mean outcome reward)", ("accuracy",)),
    "tool_call_rate": ("Episodes with a tool call", ("tool_call_rate",)),
    "kl": ("KL divergence", ("kl_ref", "approx_kl")),
    "lengths": ("Episode lengths", ("response_tokens", "mean_turns")),
}
TIME_KEYS = ("time_rollout_s", "time_logprobs_s", "time_update_s", "time_sync_s")


@dataclass
class Run:
    label: str
    rows: list[dict[str, float]]

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) where this run logged a finite number for `key`."""
        points = [(row["step"], number) for row in self.rows if (number := finite_number(row.get(key))) is not None]
        return [p[0] for p in points], [p[1] for p in points]


def read_run(run_dir: str | Path) -> list[dict[str, float]]:
    """The lines of a run's metrics.jsonl, each with a 'step' (its line number when it has none); a
    last line cut short by a run that stopped while writing it is skipped with a warning."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl (written by agentrl train)")
    rows = []
    for number, row in jsonl_objects(path, cut_short_end=True, non_finite=True):
        step = row.get("step", len(rows) + 1)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"{path}:{number}: 'step' is {json.dumps(step)[:40]}, not an integer")
        if abs(step) > 2**53:  # beyond a float's integers: matplotlib failed on it with an OverflowError
            raise ConfigError(f"{path}:{number}: 'step' is {str(step)[:40]}{'…' * (len(str(step)) > 40)}, "
                              "too large for a step")
        rows.append({**row, "step": step})
    if not rows:
        raise ConfigError(f"{path}: no steps logged")
    return rows


def labels_for(run_dirs: list[str | Path]) -> list[str]:
    """Directory names, with the parent added where two runs share a name."""
    paths = [Path(r).resolve() for r in run_dirs]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _line_panel(plt: Any, title: str, keys: tuple[str, ...], runs: list[Run], path: Path) -> list[tuple[str, str]]:
    drawn = [(run.label, key) for key in keys for run in runs if run.series(key)[0]]
    keys = tuple(k for k in keys if any(d[1] == k for d in drawn))
    if not keys:
        return []
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for color, run in enumerate(runs):
            steps, values = run.series(key)
            if not steps:
                continue
            ax.plot(steps, values, marker="o", markersize=3, color=f"C{color}", label=run.label)
            std_steps, std = run.series("reward_std") if key == "reward_mean" else ([], [])
            if std_steps == steps:
                ax.fill_between(steps, [v - s for v, s in zip(values, std)], [v + s for v, s in zip(values, std)],
                                color=f"C{color}", alpha=0.15, linewidth=0)
        ax.set(xlabel="step", ylabel=key)
        _integer_steps(ax)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _time_panel(plt: Any, runs: list[Run], path: Path) -> list[tuple[str, str]]:
    """Stacked time split per step; one subplot per run, since stacks do not overlay."""
    with_time = [run for run in runs if any(run.series(k)[0] for k in TIME_KEYS)]
    if not with_time:
        return []
    fig, axes = plt.subplots(1, len(with_time), figsize=(6 * len(with_time), 4), squeeze=False, sharey=True)
    drawn = []
    for ax, run in zip(axes[0], with_time):
        keys = [k for k in TIME_KEYS if run.series(k)[0]]
        steps = sorted(set.intersection(*(set(run.series(k)[0]) for k in keys)))
        by_key = {k: dict(zip(*run.series(k))) for k in keys}
        ax.stackplot(steps, [[by_key[k][s] for s in steps] for k in keys], labels=keys, alpha=0.85)
        ax.set(title=run.label, xlabel="step", ylabel="seconds")
        _integer_steps(ax)
        ax.legend(loc="upper left", fontsize="small")
        ax.grid(alpha=0.3)
        drawn += [(run.label, k) for k in keys]
    fig.suptitle("Time per step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def run_plot(run_dirs: list[str | Path], out: str | Path | None = None) -> dict[Path, list[tuple[str, str]]]:
    """`agentrl plot`: writes the PNGs; returns each file with the (run, metric) series drawn in it."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    runs = [Run(label, read_run(d)) for label, d in zip(labels_for(run_dirs), run_dirs)]
    out_dir = Path(out) if out else Path(run_dirs[0]) / "plots"
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out: '{out_dir}' is a file, not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a file where a parent directory would be
        raise ConfigError(f"--out: cannot make directory '{out_dir}' ({e.strerror}: '{e.filename}')") from None
    try:  # before drawing: savefig failed on a directory it cannot write to, with a traceback
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise ConfigError(f"--out: '{out_dir}' is not writable ({e.strerror or e})") from None
    written: dict[Path, list[tuple[str, str]]] = {}
    for name, (title, keys) in LINE_PANELS.items():
        if drawn := _line_panel(plt, title, keys, runs, out_dir / f"{name}.png"):
            written[out_dir / f"{name}.png"] = drawn
    if drawn := _time_panel(plt, runs, out_dir / "time.png"):
        written[out_dir / "time.png"] = drawn
    if not written:
        known = [k for _, keys in LINE_PANELS.values() for k in keys] + list(TIME_KEYS)
        raise ConfigError(f"{', '.join(map(str, run_dirs))}: metrics.jsonl has none of the plotted metrics "
                          f"({', '.join(known)})")
    print(f"wrote {len(written)} plots to {out_dir}: {', '.join(p.name for p in written)}")
    return written
