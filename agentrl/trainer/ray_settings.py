"""What a run on Ray needs settled before Ray is imported: the recipe's Ray settings, checked before
any model loads (check_ray_settings), and the environment Ray reads when it is imported
(ray_environment). Imports neither ray nor torch.
"""

from __future__ import annotations

import os

from agentrl.config import RecipeConfig
from agentrl.errors import ConfigError


def ray_environment(private: bool) -> None:
    """What Ray reads from the environment when it is imported, set before it is."""
    if private:
        # A single-node Ray of this run's own: left to itself it binds and connects on the
        # machine's network address; this keeps every socket on 127.0.0.1. No usage reports.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Tensors arrive as views of Ray's object store instead of copies (a weight sync is 3x faster,
    # bench/weight_sync.py); receivers only read them (the engines copy them into their weights).
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")


def ray_address_parts(address: str) -> tuple[str, int]:
    """(host, port) of a trainer.ray_address other than 'auto' (host:port, [IPv6]:port or
    ray://host:port), or a ConfigError naming the key."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    if not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigError(f"trainer.ray_address: expected host:port, ray://host:port or 'auto', got '{address}'")
    return host, int(port)


def check_ray_settings(config: RecipeConfig) -> None:
    """Under trainer.backend 'ray', what would otherwise fail only at ray.init or inside every actor,
    as a ConfigError naming the key, before any model loads. A device index: Ray shows each actor
    only the GPU it gives it (as cuda:0), so 'cuda:1' names no device there ('cuda:0' is each
    actor's own GPU, as 'cuda' is). The engines get a share of a GPU only when the training ranks
    are on CUDA (colocated or split alike); otherwise they see every GPU."""
    t = config.trainer
    if t.backend != "ray":
        return
    devices = [("trainer.device", t.device)] + ([("engine.device", config.engine.device)]
                                                if t.device.startswith("cuda") else [])
    for key, device in devices:
        if ":" in device and device != "cuda:0":
            raise ConfigError(f"{key}: '{device}' names a GPU by index, but with trainer.backend 'ray' each actor "
                              "sees only the GPU Ray gives it; use 'cuda'")
    if t.ray_address and t.ray_address != "auto":
        ray_address_parts(t.ray_address)
    if t.device.startswith("cuda") and not t.ray_address:  # the run's own Ray, on this machine's GPUs
        import torch

        split = t.engine_replicas if t.placement == "split" else 0
        needed, seen = t.world_size + split, torch.cuda.device_count() if torch.cuda.is_available() else 0
        if needed > seen:  # Ray was told of as many as asked for, and a rank got a GPU that is not there
            replicas = f" + {split} engine replica{'s' * (split != 1)} (trainer.placement 'split')" if split else ""
            raise ConfigError(f"trainer.world_size {t.world_size}{replicas} on {t.device} needs {needed} GPU"
                              f"{'s' * (needed != 1)}, one each; torch {torch.__version__} sees {seen or 'none'}")
