"""Many episodes at once: tasks × group size, bounded concurrency, JSONL output, a summary.

Concurrency is plain asyncio: every episode is a task, a semaphore bounds how many are in flight,
and the engine batches whatever generate calls they make meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Callable

from agentrl.rollout.episode import EpisodeRunner
from agentrl.types import Task, Trajectory


async def collect(runner: EpisodeRunner, tasks: list[Task], group_size: int, max_concurrent: int,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """Trajectories for every task, `group_size` each, grouped by task in task order."""
    gate = asyncio.Semaphore(max_concurrent)

    async def one(task: Task) -> Trajectory:
        async with gate:
            traj = await runner.run(task, group_id=task.id)
        if on_done:
            on_done(traj)
        return traj

    return list(await asyncio.gather(*(one(t) for t in tasks for _ in range(group_size))))


def write_jsonl(trajectories: list[Trajectory], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for traj in trajectories:
            f.write(json.dumps(traj.to_json(), ensure_ascii=False) + "\n")


def summarize(trajectories: list[Trajectory], wall_s: float) -> dict[str, float]:
    """Run-level numbers: reward, tool use, errors, turns, tokens and throughput."""
    n = max(len(trajectories), 1)
    total = lambda key: sum(t.metrics.get(key, 0.0) for t in trajectories)  # noqa: E731
    call_attempts = total("tool_calls") + total("parse_errors")
    generated = sum(t.num_generated for t in trajectories)
    summary = {
        "episodes": float(len(trajectories)),
        "reward_mean": sum(t.reward or 0.0 for t in trajectories) / n,
        "tool_call_rate": sum(1 for t in trajectories if t.metrics.get("tool_calls", 0) > 0) / n,
        "tool_calls_per_episode": total("tool_calls") / n,
        "parse_error_rate": total("parse_errors") / call_attempts if call_attempts else 0.0,
        "tool_error_rate": total("tool_errors") / total("tool_calls") if total("tool_calls") else 0.0,
        "mean_turns": total("turns") / n,
        "tokens_generated": float(generated),
        "tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
    }
    for finish, count in Counter(t.finish for t in trajectories).items():
        summary[f"finish_{finish}"] = count / n
    return summary
