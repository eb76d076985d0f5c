"""The Ray backend: the same worker classes as the local backend, one Ray actor per rank or replica,
placed with a placement group. This module and ray_groups.py (calls into the placed actors) are
the only ones that import ray.

Placement: one bundle (`trainer.cpus_per_worker` CPUs, and a GPU on CUDA) per training rank. In the
colocated mode rank i's bundle also holds engine replica i (as in verl's hybrid engine and
OpenRLHF's colocation; the engine releases its memory while the trainer runs); in the split mode the
replicas get bundles of their own. Each role's ranks form their own process group (FSDP2 over gloo
on CPU, nccl on GPU), joined at rank 0's node address.

Failure: every actor runs a sentinel call that only returns if it dies, and every wait watches the
sentinels, so a killed or OOM-killed worker, or a method that raises, stops the run at once with
the role, rank and cause (RunFailed), and a call that outlasts `trainer.call_timeout_s` does too.
The driver then tears every actor down; nothing is left waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentrl.config import RecipeConfig
from agentrl.errors import RunFailed
from agentrl.rollout.worker import RolloutWorker
from agentrl.trainer.distributed import Ranks, init_process_group
from agentrl.trainer.ray_groups import RaySink, Supervisor, WorkerGroup
from agentrl.trainer.roles import Roles, make_critic, make_policy, make_reference
from agentrl.types import Task, Trajectory

# How long shutdown waits for the rollout workers to close what they opened before killing them:
# the tools' connections (seconds) and a launched SGLang server, which gets 30 s after SIGTERM.
CLOSE_TIMEOUT_S = 60.0


def make_rollout(config: RecipeConfig, pad_id: int, ranks: Ranks) -> RolloutWorker:
    return RolloutWorker(config, replica=ranks.rank)


@ray.remote
class RoleActor:
    """Hosts one worker: joins its role's process group, builds the worker, runs its methods."""

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.worker: Any = None
        self._stop = threading.Event()

    def node(self) -> tuple[str, int, int]:
        """(node address, a free port there, this process's pid)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, os.getpid()

    def setup(self, factory: Callable[..., Any], config: RecipeConfig, pad_id: int, ranks: Ranks, address: str,
              port: int, join_group: bool) -> None:
        if join_group:
            init_process_group(ranks, address, port, config.trainer.device.split(":")[0],
                               config.trainer.collective_timeout_s)
        self.worker = factory(config, pad_id, ranks)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def close(self) -> None:
        """The worker's own close, where it has one (a rollout worker: its engine and tools). Ray's
        kill runs no atexit hook and no finally block in the actor."""
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()

    def sentinel(self) -> None:
        """Never returns while the actor lives; its failure is how the driver learns of a death."""
        self._stop.wait()


def check_ray_address(address: str, timeout_s: float = 10.0) -> None:
    """RunFailed naming trainer.ray_address unless a Ray cluster answers there: `ray.init` retries
    an address where nothing listens, or where something other than Ray's GCS does (a wrong port),
    for about 14 minutes, printing warnings, deaf to Ctrl-C while each attempt blocks."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise RunFailed(f"trainer.ray_address: no Ray cluster answers at '{address}' "
                        f"({type(e).__name__}: {e})") from None
    if not address.startswith("ray://"):  # a Ray Client server is not a GCS: the TCP check is all
        _check_gcs(address, timeout_s)


def _check_gcs(address: str, timeout_s: float) -> None:
    """The one call Ray's own start-up makes first (GetClusterId), on a channel set up as Ray sets
    it up (TLS, auth token); Ray has no public way to ask with a time limit."""
    import grpc
    from ray._private.gcs_utils import create_gcs_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = create_gcs_channel(address)
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                                                                           timeout=timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise RunFailed(f"trainer.ray_address: the Ray cluster at '{address}' refused this process's auth token "
                            "(or its lack of one): set RAY_AUTH_MODE=token and the cluster's token "
                            "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)") from None
        raise RunFailed(f"trainer.ray_address: no Ray cluster answers at '{address}': something else listens "
                        f"there ({e.code().name}: {e.details()})") from None
    finally:
        channel.close()


class RayRoles(Roles):
    """Every role as a group of Ray actors (trainer.backend 'ray')."""

    def __init__(self, config: RecipeConfig, tokenizer: Any):
        self.config, self.tokenizer = config, tokenizer
        t = config.trainer
        self._started_ray = not ray.is_initialized() and t.ray_address is None
        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
        if t.ray_address:
            check_ray_address(t.ray_address)
            ray.init(address=t.ray_address, namespace="agentrl", log_to_driver=True)
        elif self._started_ray:
            start_local_ray(self._bundles())
        restore_signal_handlers(handlers)
        self.supervisor = Supervisor(t.call_timeout_s)
        self.actors: list[tuple[str, Any]] = []
        self.pids: dict[str, int] = {}
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
        groups = {role: self._start_role(role, factory, where, sharing) for role, factory, where in roles}
        self.rollout = groups["rollout"]
        self.policy = WorkerGroup("policy", groups["policy"], self.supervisor,
                                  on_policy=t.ppo_epochs == 1 and t.mini_batches == 1)
        self.reference = WorkerGroup("reference", groups["reference"], self.supervisor) if "reference" in groups else None
        self.critic = WorkerGroup("critic", groups["critic"], self.supervisor) if "critic" in groups else None
        self._write_worker_table()

    def _start_role(self, role: str, factory: Callable[..., Any], where: list[int], sharing: list[int]) -> list[Any]:
        """One actor per bundle in `where`, started, watched, then set up together (they rendezvous)."""
        t = self.config.trainer
        actors, labels = [], []
        for i, bundle in enumerate(where):
            share = 1.0 / sharing[bundle]
            actor = RoleActor.options(
                num_cpus=t.cpus_per_worker * share, num_gpus=share if t.device.startswith("cuda") else 0,
                max_concurrency=2,  # one slot for the sentinel
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
            ).remote(max(1, int(t.cpus_per_worker)))
            labels.append(f"rollout replica {i}" if role == "rollout" else f"{role} rank {i}")
            actors.append(actor)
            self.actors.append((labels[-1], actor))
            self.supervisor.watch(actor, labels[-1])
        nodes = self.supervisor.wait([a.node.remote() for a in actors], labels, "start-up")
        self.pids.update({label: pid for label, (_, _, pid) in zip(labels, nodes)})
        address, port, _ = nodes[0]
        trains = role != "rollout"  # training ranks form a process group; engine replicas are independent
        self.supervisor.wait([a.setup.remote(factory, self.config, self.tokenizer.pad_token_id, Ranks(i, len(actors)),
                                             address, port, trains) for i, a in enumerate(actors)], labels, "set-up")
        return actors

    def _write_worker_table(self) -> None:
        """<output_dir>/workers.json: role, rank and process id of every actor, for whoever runs the job."""
        import json

        run_dir = Path(self.config.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "workers.json").write_text(json.dumps(self.pids, indent=2))

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
        if getattr(self, "group", None) is not None:
            remove_placement_group(self.group)
            self.group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def restore_signal_handlers(handlers: dict[int, Any]) -> None:
    """ray.init installs, in the driver, a C++ handler for SIGTERM that prints a stack dump and
    ends the process on the spot: no finally block runs, so no worker is closed and no exit line
    printed. The Python handlers set before it (the CLI's: clean-up first, then one line and
    128 + the signal's number) are put back."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        return
    for signum, handler in handlers.items():
        if callable(handler):
            signal.signal(signum, handler)


def start_local_ray(bundles: list[dict[str, float]]) -> None:
    """A Ray instance for this run only, on loopback (see roles.start_roles), without usage
    reporting or a dashboard; `address="local"`, or `ray.init` would join a cluster that `ray
    start` left recorded on this machine (and refuse the CPU count, or hang on a dead one)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cpus = max(sum(b.get("CPU", 0.0) for b in bundles), float(os.cpu_count() or 1))
    gpus = sum(b.get("GPU", 0.0) for b in bundles)
    ray.init(address="local", num_cpus=int(cpus + 0.999), num_gpus=int(gpus), include_dashboard=False,
             namespace="agentrl", _node_ip_address="127.0.0.1", log_to_driver=True, configure_logging=False)
