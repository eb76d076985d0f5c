"""The Ray backend: the same worker classes as the local backend, one Ray actor per rank or replica,
placed with a placement group. This module, ray_cluster.py (the cluster: the run's own or one it
joins) and ray_groups.py (calls into the placed actors) are the only ones that import ray.

Placement: one bundle (`trainer.cpus_per_worker` CPUs, and a GPU on CUDA) per training rank. In the
colocated mode rank i's bundle also holds engine replica i (as in verl's hybrid engine and
OpenRLHF's colocation; the engine releases its memory while the trainer runs); in the split mode the
replicas get bundles of their own. Each role's ranks form their own process group (FSDP2 over gloo
on CPU, nccl on GPU), joined where rank 0's actor says when the role starts
(distributed.open_rendezvous): a file for the run's own Ray, whose ranks all run on this machine,
else rank 0's node address, at a port it binds then and keeps until its store takes it over.

Failure: every actor runs a sentinel call that only returns if it dies, and every wait watches the
sentinels, so a killed or OOM-killed worker, or a method that raises, stops the run at once with
the role, rank and cause (RunFailed), and a call that outlasts `trainer.call_timeout_s` does too.
The driver then tears every actor down; nothing is left waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentrl.config import RecipeConfig
from agentrl.errors import RunFailed
from agentrl.hardware import choose_dtype
from agentrl.rollout.worker import RolloutWorker
from agentrl.trainer.distributed import Ranks, init_process_group, open_rendezvous, remove_rendezvous
from agentrl.trainer.ray_cluster import (check_ray_address, fair_threads, restore_signal_handlers, start_local_ray,
                                         usable_cores)
from agentrl.trainer.ray_groups import RaySink, Supervisor, WorkerGroup
from agentrl.trainer.ray_settings import check_ray_settings
from agentrl.trainer.roles import Roles, make_critic, make_policy, make_reference
from agentrl.types import Task, Trajectory

# How long shutdown waits for the rollout workers to close what they opened before killing them:
# the tools' connections (seconds) and a launched SGLang server, which gets 30 s after SIGTERM.
CLOSE_TIMEOUT_S = 60.0


def pinned_cpu_dtypes(config: RecipeConfig) -> RecipeConfig:
    """The recipe the actors get: each `auto` dtype on a CPU resolved once, in the driver. Each
    actor, a process of its own, would time its own start-up probe, and on a machine whose bf16 and
    float32 timings are close, ranks could choose differently (FSDP shards of two dtypes, an engine
    whose numerics are not the trainer's). On CUDA the choice depends on the device alone."""
    updates: dict[str, Any] = {}
    for section, device in (("model", config.engine.device), ("trainer", config.trainer.device)):
        settings = getattr(config, section)
        if settings.dtype == "auto" and device.startswith("cpu"):
            updates[section] = settings.model_copy(update={"dtype": choose_dtype("auto", device).dtype})
    return config.model_copy(update=updates)


def make_rollout(config: RecipeConfig, pad_id: int, ranks: Ranks) -> RolloutWorker:
    return RolloutWorker(config, replica=ranks.rank)


# `close` has a thread of its own: in the default group, behind the sentinel's slot, it waited for
# a `collect` still running (a run stopped by a signal or a failure mid-rollout) until shutdown gave
# up and killed the actor, and a launched SGLang server and the last sync's weight files stayed.
@ray.remote(concurrency_groups={"close": 1})
class RoleActor:
    """Hosts one worker: joins its role's process group, builds the worker, runs its methods."""

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.worker: Any = None
        self._stop = threading.Event()
        self._listener: socket.socket | None = None

    def node(self) -> tuple[str, int]:
        """(node address, this process's pid)."""
        return ray.util.get_node_ip_address(), os.getpid()

    def rendezvous(self) -> str:
        """Rank 0's choice of where its role's ranks meet (a TCP port stays bound and listening from
        now until `setup` hands it to the store)."""
        url, self._listener = open_rendezvous(ray.util.get_node_ip_address())
        return url

    def setup(self, factory: Callable[..., Any], config: RecipeConfig, pad_id: int, ranks: Ranks,
              rendezvous: str, join_group: bool) -> None:
        if join_group:
            listener, self._listener = self._listener, None
            init_process_group(ranks, rendezvous, config.trainer.device.split(":")[0],
                               config.trainer.collective_timeout_s, listener)
        self.worker = factory(config, pad_id, ranks)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    @ray.method(concurrency_group="close")
    def close(self) -> None:
        """The worker's own close, where it has one (a rollout worker: its engine and tools), even
        while a call still runs (the actor is killed next). Ray's kill runs no atexit hook and no
        finally block in the actor."""
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()

    def sentinel(self) -> None:
        """Never returns while the actor lives; its failure is how the driver learns of a death."""
        self._stop.wait()


class RayRoles(Roles):
    """Every role as a group of Ray actors (trainer.backend 'ray')."""

    def __init__(self, config: RecipeConfig, tokenizer: Any):
        check_ray_settings(config)  # before any actor starts: each would fail on its own
        self.config, self.tokenizer = pinned_cpu_dtypes(config), tokenizer
        t = config.trainer
        self._started_ray = not ray.is_initialized() and t.ray_address is None
        self.threads = max(1, int(t.cpus_per_worker))
        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
        if t.ray_address:
            check_ray_address(t.ray_address)
            ray.init(address=t.ray_address, namespace="agentrl", log_to_driver=True)
        elif self._started_ray:
            cores = usable_cores()
            self.threads, warning = fair_threads(t.world_size, t.cpus_per_worker, self._bundles(), cores)
            if warning:
                print(f"agentrl: warning: {warning}", file=sys.stderr)
            start_local_ray(self._bundles())
        restore_signal_handlers(handlers)
        self.supervisor = Supervisor(t.call_timeout_s)
        self.actors: list[tuple[str, Any]] = []
        self.pids: dict[str, int] = {}
        self.rendezvous: list[str] = []  # where each role's ranks met, removed once they are gone
        try:
            self._place()
        except BaseException:
            self.shutdown()
            raise

    def _bundles(self) -> list[dict[str, float]]:
        t = self.config.trainer
        gpu = {"GPU": 1.0} if t.device.startswith("cuda") else {}
        count = t.world_size + (t.engine_replicas if t.placement == "split" else 0)
        return [{"CPU": t.cpus_per_worker, **gpu} for _ in range(count)]

    def _place(self) -> None:
        t, a = self.config.trainer, self.config.algorithm
        bundles = self._bundles()
        self.group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(f"Ray could not place {len(bundles)} bundles of {bundles[0]} within 120 s "
                            f"(cluster resources: {ray.cluster_resources()})") from None
        engine_bundle = (list(range(t.engine_replicas)) if t.placement == "colocated"
                         else list(range(t.world_size, t.world_size + t.engine_replicas)))
        roles: list[tuple[str, Callable[..., Any], list[int]]] = [("rollout", make_rollout, engine_bundle),
                                                                  ("policy", make_policy, list(range(t.world_size)))]
        if a.kl_coef > 0:
            roles.append(("reference", make_reference, list(range(t.world_size))))
        if a.advantage == "gae":
            roles.append(("critic", make_critic, list(range(t.world_size))))
        sharing = [sum(b in where for _, _, where in roles) for b in range(len(bundles))]
        # Every actor's process starts at once: each spends seconds importing torch, which started
        # role by role would add up. The workers are then built one role at a time: the engine
        # replicas first, so that an engine sizing its KV cache from the memory it finds free
        # (SGLang's mem_fraction) does not find the trainers' weights there yet; then each training
        # role, whose ranks each load a whole model before sharding it, so that two roles' whole
        # copies are never in memory at once.
        started = {role: self._start_actors(role, where, sharing) for role, _, where in roles}
        everyone = [(label, actor) for actors in started.values() for label, actor in actors]
        nodes = self.supervisor.wait([a.node.remote() for _, a in everyone], [label for label, _ in everyone],
                                     "start-up")
        self.pids.update({label: pid for (label, _), (_, pid) in zip(everyone, nodes)})
        for role, factory, _ in roles:
            self._set_up(role, factory, started[role])
        groups = {role: [actor for _, actor in actors] for role, actors in started.items()}
        self.rollout = groups["rollout"]
        self.policy = WorkerGroup("policy", groups["policy"], self.supervisor,
                                  on_policy=t.ppo_epochs == 1 and t.mini_batches == 1)
        self.reference = WorkerGroup("reference", groups["reference"], self.supervisor) if "reference" in groups else None
        self.critic = WorkerGroup("critic", groups["critic"], self.supervisor) if "critic" in groups else None

    def _start_actors(self, role: str, where: list[int], sharing: list[int]) -> list[tuple[str, Any]]:
        """One watched actor per bundle in `where`, labelled as errors name it."""
        t = self.config.trainer
        actors = []
        for i, bundle in enumerate(where):
            share = 1.0 / sharing[bundle]
            actor = RoleActor.options(
                num_cpus=t.cpus_per_worker * share, num_gpus=share if t.device.startswith("cuda") else 0,
                max_concurrency=2,  # one slot for the sentinel
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
            ).remote(self.threads)
            label = f"rollout replica {i}" if role == "rollout" else f"{role} rank {i}"
            actors.append((label, actor))
            self.actors.append((label, actor))
            self.supervisor.watch(actor, label)
        return actors

    def _set_up(self, role: str, factory: Callable[..., Any], actors: list[tuple[str, Any]]) -> None:
        """Builds one role's workers together; a training role's ranks first meet where its rank 0
        says (engine replicas are independent)."""
        trains = role != "rollout"
        rendezvous = ""
        if trains and len(actors) > 1:
            label, first = actors[0]
            rendezvous = self.supervisor.wait([first.rendezvous.remote()], [label], "start-up")[0]
            self.rendezvous.append(rendezvous)
        self.supervisor.wait([actor.setup.remote(factory, self.config, self.tokenizer.pad_token_id,
                                                 Ranks(i, len(actors)), rendezvous, trains)
                              for i, (_, actor) in enumerate(actors)], [label for label, _ in actors], "set-up")

    def worker_table(self) -> dict[str, int]:
        return dict(self.pids)

    def _rollout_call(self, method: str, *args: Any) -> list[Any]:
        labels = [f"rollout replica {i}" for i in range(len(self.rollout))]
        return self.supervisor.wait([a.call.remote(method, *args) for a in self.rollout], labels, method)

    def collect(self, tasks: list[Task]) -> list[Trajectory]:
        """Whole groups dealt round-robin to the replicas; results back in task order."""
        replicas = len(self.rollout)
        parts = [tasks[i::replicas] for i in range(replicas)]
        labels = [f"rollout replica {i}" for i in range(replicas)]
        results = self.supervisor.wait([a.call.remote("collect", part) for a, part in zip(self.rollout, parts)],
                                       labels, "collect")
        group = self.config.rollout.group_size
        return [traj for j in range(len(tasks))
                for traj in results[j % replicas][(j // replicas) * group:(j // replicas + 1) * group]]

    def release_memory(self) -> None:
        self._rollout_call("release_memory")

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        self._rollout_call("resume_memory", tags)

    def sync_weights(self, version: int) -> None:
        t = self.config.trainer
        self.policy.push_weights(RaySink(self.rollout, t.call_timeout_s), version, t.sync_bucket_mb << 20)

    def weight_version(self) -> int:
        return min(self._rollout_call("version"))

    def rollout_rng_states(self) -> list[Any]:
        return self._rollout_call("rng_state")

    def set_rollout_rng_states(self, states: list[Any]) -> None:
        labels = [f"rollout replica {i}" for i in range(len(self.rollout))]
        refs = [a.call.remote("set_rng_state", state) for a, state in zip(self.rollout, states)]
        self.supervisor.wait(refs, labels[:len(refs)], "set_rng_state")

    def save_model(self, path: Path) -> None:
        self.policy.save_pretrained(path, self.tokenizer)

    def save_critic(self, path: Path) -> None:
        self.critic.save(path)

    def shutdown(self) -> None:
        actors = getattr(self, "actors", [])
        # Only the rollout workers open anything outside their memory; the training ranks may be
        # stuck in a collective with a dead rank. A worker that is dead, or still busy when the
        # time is up, is killed as it is.
        closing = [actor.close.remote() for label, actor in actors if label.startswith("rollout")]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT_S)
        for _, actor in actors:
            ray.kill(actor, no_restart=True)
        # A file rendezvous is on this machine (its ranks met at a loopback address, distributed.py).
        for rendezvous in getattr(self, "rendezvous", []):
            remove_rendezvous(rendezvous)
        # The run's own Ray takes its placement group down with it. Asking for the removal would
        # wait on its GCS, which a signal to the whole process group (a closed terminal) has ended
        # already: Ray's client retries for 60 s, then ends the driver with status 1.
        if getattr(self, "group", None) is not None and not self._started_ray:
            remove_placement_group(self.group)
        self.group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
