"""The rollout role: one engine replica with its episode runner and tools, driven by the trainer.

The local backend holds one in the driver's process; the Ray backend runs one per engine replica
(trainer/launch.py), so tools execute in the rollout processes, next to their engine, and every
turn of an episode is served by the replica its group was sent to (its KV cache lives there).
Weight updates arrive in buckets and end with one cache flush and a new weight version.
"""

from __future__ import annotations

import sys

import torch

from agentrl.config import RecipeConfig
from agentrl.rollout.collect import run_episodes
from agentrl.rollout.run import build_runner, close_runner
from agentrl.types import Task, Trajectory


class RolloutWorker:
    """An engine replica and its episode runner. Replica r samples with seed engine.seed + r."""

    def __init__(self, config: RecipeConfig, replica: int = 0):
        engine_config = config.engine.model_copy(update={"seed": config.engine.seed + replica})
        self.config = config.model_copy(update={"engine": engine_config})
        self.runner, _ = build_runner(self.config, with_tasks=False)
        self.engine = self.runner.engine
        # Each collection's episodes sample with seeds drawn from this stream (collect.py): a run
        # samples the same tokens however its episodes' turns interleave, and a checkpoint keeps
        # the stream's state, so a resumed run samples what the uninterrupted one would have.
        self.seeds = torch.Generator().manual_seed(engine_config.seed)

    def collect(self, tasks: list[Task]) -> list[Trajectory]:
        """`rollout.group_size` episodes per task, grouped by task in task order."""
        r = self.config.rollout
        seed = int(torch.randint(2**62, (1,), generator=self.seeds))
        return run_episodes(self.runner, tasks, r.group_size, r.max_concurrent_episodes, seed=seed)

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket of new weights, copied in place; generation waits until `finish_weights`."""
        self.engine.update_weights(bucket, version=self.engine.weight_version, flush_cache=False)

    def finish_weights(self, version: int) -> None:
        """The end of a weight sync: one cache flush, then completions carry `version`."""
        self.engine.update_weights([], version=version, flush_cache=True)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Tags from {"weights", "kv_cache"}; None takes back both."""
        self.engine.resume_memory(tags)

    def rng_state(self) -> dict[str, torch.Tensor | None]:
        """The episodes' seed stream and the engine's own sampling stream (None for engines that keep
        their own), which requests without a seed (an agent's other clients) draw from."""
        generator = getattr(self.engine, "generator", None)
        return {"episodes": self.seeds.get_state(), "engine": generator.get_state() if generator is not None else None}

    def set_rng_state(self, state: dict[str, torch.Tensor | None] | torch.Tensor | None) -> None:
        if isinstance(state, torch.Tensor):  # a checkpoint written before episodes had seeds
            print("agentrl: the checkpoint predates episode seeds: the resumed run's episodes sample anew "
                  "(the stream of seeds starts from engine.seed)", file=sys.stderr)
            state = {"episodes": None, "engine": state}
        if state is None:
            return
        if state["episodes"] is not None:
            self.seeds.set_state(state["episodes"])
        if state["engine"] is not None:
            # A resume may change engine.name or engine.device (a warning, not an error): another
            # engine keeps no such stream, and a CPU generator takes no CUDA one's state.
            generator = getattr(self.engine, "generator", None)
            try:
                if generator is None:
                    raise TypeError("the engine keeps no sampling stream of its own")
                generator.set_state(state["engine"])
            except (RuntimeError, TypeError) as e:
                print(f"agentrl: warning: the checkpoint's engine sampling stream does not fit this engine "
                      f"({' '.join(str(e).split())[:120]}): requests without a seed sample anew", file=sys.stderr)

    def close(self) -> None:
        """The tools' processes and connections, then the engine: a launched SGLang server stops and
        the weight files of the last sync are deleted (the trainer calls this as the run ends)."""
        close_runner(self.runner)

    def version(self) -> int:
        """The weight version the engine holds."""
        return self.engine.weight_version


class LocalSink:
    """A weight sync into engines in this process (the local backend)."""

    def __init__(self, workers: list[RolloutWorker]):
        self.workers = workers

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for worker in self.workers:
            worker.load_weights(bucket)

    def finish(self, version: int) -> None:
        for worker in self.workers:
            worker.finish_weights(version)
