"""The Ray cluster a run uses: its own, started on loopback (start_local_ray), or one it joins at
trainer.ray_address, checked first (check_ray_address). With launch.py (which places the actors)
and ray_groups.py (which calls them), the only modules that import ray.

A Ray the run starts itself is told the machine has at least the bundles' CPUs, so that a recipe
asking for more ranks than there are cores still runs (a warning says so, and each actor's torch
threads are cut to its share of the cores, fair_threads): a small excess is common and works (two
ranks and an engine of its own on two cores), and refusing it would stop runs that train fine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any, Iterator

import ray

from agentrl.errors import RunFailed
from agentrl.trainer.ray_settings import ray_address_parts


def check_ray_address(address: str, timeout_s: float = 10.0) -> None:
    """RunFailed naming trainer.ray_address unless a Ray cluster answers there: `ray.init` retries
    an address where nothing listens, or where something other than Ray's GCS does (a wrong port),
    for about 14 minutes, printing warnings, deaf to Ctrl-C while each attempt blocks."""
    if address == "auto":
        return
    host, port = ray_address_parts(address)  # a ConfigError for what is no address at all
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
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


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (`taskset`, a container's
    `--cpuset-cpus`), which os.cpu_count() ignores, reporting every core of the host."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def fair_threads(world_size: int, cpus_per_worker: float, bundles: list[dict[str, float]],
                 cores: int) -> tuple[int, str | None]:
    """(torch threads of each actor, a warning or None) for a Ray of the run's own on `cores` cores.
    Where the bundles ask for more CPUs than there are, each actor's threads are cut to its
    bundle's share of the cores (at least 1): a rank with more threads than cores only contends
    with the others."""
    threads = max(1, int(cpus_per_worker))
    wanted = sum(b.get("CPU", 0.0) for b in bundles)
    if wanted <= cores:
        return threads, None
    threads = max(1, min(threads, cores // len(bundles)))
    engines = len(bundles) - world_size
    split = f" and {engines} engine replica bundle{'s' * (engines != 1)} (trainer.placement split)" if engines else ""
    return threads, (f"trainer.world_size {world_size}{split} at trainer.cpus_per_worker {cpus_per_worker:g} ask for "
                     f"{wanted:g} CPUs on a machine with {cores} core{'s' * (cores != 1)}: the workers share them, "
                     f"{threads} torch thread{'s' * (threads != 1)} each, and each loads its own model copy")


def start_local_ray(bundles: list[dict[str, float]]) -> None:
    """A Ray instance for this run only, on loopback (see roles.start_roles), without usage
    reporting or a dashboard; `address="local"`, or `ray.init` would join a cluster that `ray
    start` left recorded on this machine (and refuse the CPU count, or hang on a dead one)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cpus = max(sum(b.get("CPU", 0.0) for b in bundles), float(usable_cores()))
    gpus = sum(b.get("GPU", 0.0) for b in bundles)
    with dashboard_kept_home():
        ray.init(address="local", num_cpus=int(cpus + 0.999), num_gpus=int(gpus), include_dashboard=False,
                 namespace="agentrl", _node_ip_address="127.0.0.1", log_to_driver=True, configure_logging=False)


# A proxy address where nothing listens (the discard port): a request sent to it is refused at once.
REFUSING_PROXY = "http://127.0.0.1:9"
LOOPBACK_NAMES = "127.0.0.1,localhost,::1"


@contextlib.contextmanager
def dashboard_kept_home() -> Iterator[None]:
    """While Ray starts, its dashboard process is given a proxy that refuses. Even without a
    dashboard, and with usage reporting off, that process runs Ray's usage module, which on start
    asks the cloud metadata endpoints which cloud it runs on: two HTTP requests to 169.254.169.254
    and a DNS lookup of metadata.google.internal, the only traffic of a private Ray that leaves the
    machine. Ray has no setting for it; its HTTP client takes the proxy from the environment and
    gives up at the refusal. The process's own connections (to the GCS on 127.0.0.1, over gRPC,
    which reads the same variables) pass by the no-proxy list. No other process gets the variables:
    the workers' tools may need the network. Should Ray's private start_ray_process move, Ray starts
    as before (and the requests leave again)."""
    try:
        from ray._private import ray_constants, services
        original, dashboard = services.start_ray_process, ray_constants.PROCESS_TYPE_DASHBOARD
    except (ImportError, AttributeError):
        original = None
    if original is None:
        yield
        return
    proxy = {name: REFUSING_PROXY for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
    proxy |= {name: LOOPBACK_NAMES for name in ("no_proxy", "NO_PROXY")}

    def start_ray_process(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if process_type == dashboard:
            if len(args) >= 2:  # (fate_share, env_updates, ...) given by position
                args = (args[0], {**(args[1] or {}), **proxy}, *args[2:])
            else:
                kwargs["env_updates"] = {**(kwargs.get("env_updates") or {}), **proxy}
        return original(command, process_type, *args, **kwargs)

    services.start_ray_process = start_ray_process
    try:
        yield
    finally:
        services.start_ray_process = original
