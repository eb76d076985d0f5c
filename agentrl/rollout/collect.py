"""Many episodes at once: tasks × group size, bounded concurrency, JSONL output, a summary.

Concurrency is plain asyncio: every episode is a task, a semaphore bounds how many are in flight,
and the engine batches whatever generate calls they make meanwhile. `run_episodes` runs them on a
fresh event loop whose default executor never waits for a plug-in's stuck thread (tools/threads.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

from agentrl.env.tool_env import ToolLimits
from agentrl.errors import RunFailed
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.base import FunctionTool
from agentrl.tools.threads import run_with_daemon_threads
from agentrl.types import Task, Trajectory, derive_seed


async def collect(runner: EpisodeRunner, tasks: list[Task], group_size: int, max_concurrent: int,
                  on_done: Callable[[Trajectory], None] | None = None, seed: int | None = None) -> list[Trajectory]:
    """Trajectories for every task, `group_size` each, grouped by task in task order. With a `seed`,
    episode i of that order samples with seed derive_seed(seed, i): the same tokens however the
    episodes' turns interleave (on an engine that takes seeds; the transformers engine does)."""
    gate = asyncio.Semaphore(max_concurrent)
    for tool in runner.tools:
        if isinstance(tool, FunctionTool):
            tool.allow_calls(max_concurrent * calls_at_once(runner.settings))

    async def one(task: Task, i: int) -> Trajectory:
        async with gate:
            traj = await runner.run(task, group_id=task.id, seed=None if seed is None else derive_seed(seed, i))
        if on_done:
            on_done(traj)
        return traj

    return list(await asyncio.gather(*(one(t, i * group_size + k) for i, t in enumerate(tasks)
                                       for k in range(group_size))))


def run_episodes(runner: EpisodeRunner, tasks: list[Task], group_size: int, max_concurrent: int,
                 on_done: Callable[[Trajectory], None] | None = None, seed: int | None = None) -> list[Trajectory]:
    """`collect` from synchronous code (the CLI commands and the training driver). Returns once the
    engine's decode thread, if it has one, has stopped too."""
    try:
        # Threads for every grader and every `asyncio.to_thread` of the tools the episodes can run
        # at once: calls queued for one timed out (the wait counts, as a hung call's must).
        threads = max(32, max_concurrent * (calls_at_once(runner.settings) + 1))
        return run_with_daemon_threads(collect(runner, tasks, group_size, max_concurrent, on_done, seed), threads)
    finally:  # also after a Ctrl-C: the thread then stops within a step, its callers gone
        wait_idle = getattr(runner.engine, "wait_idle", None)
        if wait_idle is not None:
            wait_idle()


def calls_at_once(settings: EpisodeSettings) -> int:
    """Tool calls one episode can have running at the same time."""
    limits = settings.tool_limits or ToolLimits()
    return limits.max_calls_per_turn if limits.parallel_calls else 1


def check_failures(what: str, trajectories: list[Trajectory], max_fraction: float) -> None:
    """RunFailed naming the most common causes when more than `max_fraction` of the episodes
    failed (trainer.max_failed_fraction): a training step stops the run, and `rollout` and `eval`
    exit with status 1 once their results are written."""
    failed = [tr for tr in trajectories if tr.finish == "error"]
    # Divided, not multiplied: 0.29 * 100 is 28.999999999999996, and 29 of 100 would be "more".
    if failed and len(failed) / len(trajectories) > max_fraction:
        causes = "; ".join(f"{error} ({count}x)" for error, count in Counter(tr.error for tr in failed).most_common(3))
        raise RunFailed(f"{what}: {len(failed)} of {len(trajectories)} episodes failed (more than "
                        f"trainer.max_failed_fraction {max_fraction:g}): {causes}")


def run_streamed(runner: EpisodeRunner, tasks: list[Task], group_size: int, max_concurrent: int,
                 out: Path, stale: tuple[Path, ...] = (), seed: int | None = None) -> list[Trajectory]:
    """`run_episodes`, each trajectory appended to `out` as it finishes, so that a crash or a
    Ctrl-C keeps the finished ones (said on stderr); then `out` is rewritten in task order. `stale`
    files (an earlier run's summary) are removed first: they would pass for this run's."""
    for path in stale:
        path.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w", encoding="utf-8") as f:
        def keep(traj: Trajectory) -> None:
            nonlocal written
            f.write(jsonl_line(traj))
            f.flush()
            written += 1

        try:
            trajectories = run_episodes(runner, tasks, group_size, max_concurrent, on_done=keep, seed=seed)
        except BaseException:
            print(f"agentrl: stopped early: {written} finished episode(s) of {len(tasks) * group_size} "
                  f"kept in {out}", file=sys.stderr)
            raise
    write_jsonl(trajectories, out)
    return trajectories


def write_jsonl(trajectories: list[Trajectory], path: str | Path, step: int | None = None) -> None:
    """One trajectory per line (with its training step when given), UTF-8. Written beside `path`
    and renamed over it: `run_streamed`'s rewrite in task order, cut short (a full disk, a kill),
    emptied the file that held every finished episode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    try:
        with staging.open("w", encoding="utf-8") as f:
            for traj in trajectories:
                f.write(jsonl_line(traj, step))
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def jsonl_line(traj: Trajectory, step: int | None = None) -> str:
    """One trajectory as a JSONL line (with its training step when given)."""
    row = traj.to_json() if step is None else {"step": step, **traj.to_json()}
    line = json.dumps(row, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # half a surrogate pair (text a plug-in built from a \ud83d escape): escaped
        line = json.dumps(row)  # as \ud83d, which reads back as the same string
    return line + "\n"


def summarize(trajectories: list[Trajectory], wall_s: float) -> dict[str, float]:
    """Run-level numbers: reward (over episodes that did not fail), failures, tool use and errors per
    tool, turns, the interaction's scores and the ones it returned that were not numbers (in runs
    with one), finish reasons, the share of tokens trained, throughput."""
    n = max(len(trajectories), 1)
    ok = [t for t in trajectories if t.finish != "error"]
    total = lambda key: sum(t.metrics.get(key, 0.0) for t in trajectories)  # noqa: E731
    call_attempts = total("tool_calls") + total("parse_errors")
    generated = sum(t.num_generated for t in trajectories)
    summary = {
        "episodes": float(len(trajectories)),
        "episodes_failed": float(len(trajectories) - len(ok)),
        "reward_mean": sum(t.reward for t in ok) / len(ok) if ok else 0.0,
        "tool_call_rate": sum(1 for t in trajectories if t.metrics.get("tool_calls", 0) > 0) / n,
        "tool_calls_per_episode": total("tool_calls") / n,
        "parse_error_rate": total("parse_errors") / call_attempts if call_attempts else 0.0,
        "tool_error_rate": total("tool_errors") / total("tool_calls") if total("tool_calls") else 0.0,
        "tool_truncations": total("tool_truncations"),
        "tool_timeouts": total("tool_timeouts"),
        "tool_lifecycle_errors": total("tool_lifecycle_errors"),
        "template_fallbacks": total("template_fallbacks"),
        "mean_turns": total("turns") / n,
        "mask_coverage": generated / max(sum(len(t.token_ids) for t in trajectories), 1),
        "tokens_generated": float(generated),
        "tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
    }
    if any("interaction_invalid_scores" in t.metrics for t in trajectories):  # a run with an interaction
        scored = [t for t in ok if "interaction_score" in t.metrics]
        summary["interaction_score_mean"] = sum(t.metrics["interaction_score"] for t in scored) / max(len(scored), 1)
        summary["interaction_invalid_scores"] = total("interaction_invalid_scores")
        summary["interaction_truncations"] = total("interaction_truncations")
    for finish in ("stop", "length", "max_turns", "error"):
        summary[f"finish_{finish}"] = sum(1 for t in trajectories if t.finish == finish) / n
    for name in sorted({key.split("/")[1] for t in trajectories for key in t.metrics if key.startswith("tool/")}):
        calls = total(f"tool/{name}/calls")
        summary[f"tool/{name}/calls"] = calls
        summary[f"tool/{name}/error_rate"] = total(f"tool/{name}/errors") / calls if calls else 0.0
        summary[f"tool/{name}/latency_s"] = total(f"tool/{name}/latency_s") / calls if calls else 0.0
    return summary
