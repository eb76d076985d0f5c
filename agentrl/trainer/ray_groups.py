"""Calls into one role's Ray actors, for the Ray backend (launch.py places the actors).

`Supervisor` waits for remote calls while watching every actor's sentinel, so a dead worker or a
call that raises or outlasts `trainer.call_timeout_s` stops the run with the role, rank and cause
(RunFailed), after printing the worker's traceback when its call raised (as a run on the local
backend shows it); `WorkerGroup` puts a role's ranks behind the worker's own methods and merges
their per-rank results; `RaySink` sends a weight sync to every engine replica.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import ray

from agentrl.errors import ConfigError, RunFailed

# How long a failed call waits for a worker's death to be noticed before the failure is reported as
# its own: Ray learns of a dead process within about a second.
DEATH_NOTICE_S = 3.0
STILL_RUNNING_S = 3.0  # how long the other calls of a wait in which one failed get to end too
RANK_INVARIANT = {"grad_norm", "critic_grad_norm", "skipped_step_fraction", "critic_skipped_step_fraction",
                  "lr"}  # equal on every rank: taken from rank 0


def merge_rows(results: list[list[Any]]) -> list[Any]:
    """Whole-batch rows from each rank's share (None where another rank computed the row)."""
    return [next((r[i] for r in results if r[i] is not None), None) for i in range(len(results[0]))]


def merge_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Each rank's metrics are its part of the global value: summed; maxima are maxed; rank-invariant
    numbers come from rank 0."""
    merged: dict[str, float] = {}
    for key in results[0]:
        values = [r[key] for r in results]
        merged[key] = values[0] if key in RANK_INVARIANT else max(values) if key.endswith("_max") else sum(values)
    return merged


class Supervisor:
    """Waits for remote calls while watching every actor's sentinel."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.sentinels: dict[ray.ObjectRef, str] = {}

    def watch(self, actor: Any, label: str) -> None:
        self.sentinels[actor.sentinel.remote()] = label

    def wait(self, refs: list[ray.ObjectRef], labels: list[str], what: str) -> list[Any]:
        owner = dict(zip(refs, labels))
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, _ = ray.wait(pending + list(self.sentinels), num_returns=1,
                                timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for ref in ready:
                call = ref
                if ref not in self.sentinels:
                    ref = self._death_behind(ref)
                label = self.sentinels.get(ref) or owner[ref]
                try:
                    ray.get(ref)
                except Exception as e:  # a death (sentinel or call) or an exception in the call
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, ConfigError):  # the recipe's fault, as on the local backend (exit 2)
                        raise ConfigError(f"{label}: {cause}") from None
                    if isinstance(e, ray.exceptions.RayTaskError):  # where in the worker: its frames
                        print(f"agentrl: {label} raised during {what}:\n{e}", file=sys.stderr, flush=True)
                    running = self._still_running([r for r in pending if r != call]) if ref == call else []
                    # A rank that hangs outside a collective makes its peers time out in it: they fail
                    # first, and only the ones still running can say which rank it was.
                    also = f"; still running then: {', '.join(owner[r] for r in running)}" if running else ""
                    raise RunFailed(f"{label} failed during {what}: {describe(e)}{also}") from None
                if ref in self.sentinels:
                    raise RunFailed(f"{label} stopped its watch during {what}")
                pending.remove(ref)
            if pending and time.monotonic() > deadline:
                raise RunFailed(f"{owner[pending[0]]} did not finish {what} within trainer.call_timeout_s "
                                f"({self.timeout_s:g} s)")
        return ray.get(refs)


    @staticmethod
    def _still_running(refs: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Of the other calls of a wait in which one failed, those not done within a moment (a
        peer of a collective fails soon after its partner does)."""
        if not refs:
            return []
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=STILL_RUNNING_S)
        return [r for r in refs if r not in done]

    def _death_behind(self, ref: ray.ObjectRef) -> ray.ObjectRef:
        """A dead worker's sentinel in place of a call that failed, when a worker died about then:
        the ranks of a collective fail as soon as a peer dies ('Connection closed by peer'), before
        Ray has noticed the death, and the run named a healthy rank as the one that failed."""
        try:
            ray.get(ref, timeout=0)
            return ref  # it succeeded
        except Exception:
            dead, _ = ray.wait(list(self.sentinels), num_returns=1, timeout=DEATH_NOTICE_S)
            return dead[0] if dead else ref


def describe(error: Exception) -> str:
    """One line: the worker's own exception, or how its process died."""
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        return f"{type(error.cause).__name__}: {' '.join(str(error.cause).split())[:300]}"  # one line, all of it
    if isinstance(error, ray.exceptions.ActorDiedError):
        text = " ".join(str(error).split())
        return "the process died (" + (text[text.find("Worker exit"):][:240] if "Worker exit" in text else text[:240]) + ")"
    return f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"


class WorkerGroup:
    """One role's actors behind the worker's own calls; whole-batch arguments go once to the
    object store, results are merged across ranks."""

    def __init__(self, role: str, actors: list[Any], supervisor: Supervisor, on_policy: bool = False):
        self.role, self.actors, self.supervisor, self.on_policy = role, actors, supervisor, on_policy

    def call_all(self, method: str, *args: Any) -> list[Any]:
        shared = [ray.put(a) if isinstance(a, list) else a for a in args]
        refs = [actor.call.remote(method, *shared) for actor in self.actors]
        return self.supervisor.wait(refs, [f"{self.role} rank {i}" for i in range(len(refs))], method)

    def logprobs(self, sequences: list[list[int]], masks: list[list[int]]) -> list[list[float]]:
        return merge_rows(self.call_all("logprobs", sequences, masks))

    def values(self, sequences: list[list[int]], masks: list[list[int]]) -> list[list[float]]:
        return merge_rows(self.call_all("values", sequences, masks))

    def update(self, *args: Any) -> dict[str, float]:
        return merge_metrics(self.call_all("update", *args))

    def save_state(self, path: Path) -> dict[str, Any]:
        return self.call_all("save_state", str(path))[0]

    def load_state(self, path: Path, extra: dict[str, Any]) -> None:
        self.call_all("load_state", str(path), extra)

    def save_pretrained(self, path: Path, tokenizer: Any) -> None:
        self.call_all("save_pretrained", str(path), tokenizer)

    def save(self, path: Path) -> None:
        self.call_all("save", str(path))

    def push_weights(self, sink: Any, version: int, bucket_bytes: int) -> None:
        self.call_all("push_weights", sink, version, bucket_bytes)


class RaySink:
    """A weight sync into every engine replica: each bucket through the object store once."""

    def __init__(self, rollout_actors: list[Any], timeout_s: float):
        self.actors, self.timeout_s = rollout_actors, timeout_s

    def send(self, bucket: list[tuple[str, Any]]) -> None:
        ref = ray.put(bucket)
        ray.get([actor.call.remote("load_weights", ref) for actor in self.actors], timeout=self.timeout_s)

    def finish(self, version: int) -> None:
        ray.get([actor.call.remote("finish_weights", version) for actor in self.actors], timeout=self.timeout_s)
