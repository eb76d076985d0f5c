"""Seconds to move the policy's weights from the training ranks into an engine replica in another
process, against a plain in-memory copy of the same bytes.

Measured side by side in one run, SmolLM2-135M-Instruct in float32 (every distinct state-dict
tensor once, as the sync sends them; the tied output head rides on the embedding):
  sync   the Ray backend's own path (trainer/launch.py): RayRoles on a local Ray (127.0.0.1) starts
         the policy rank(s) and a RolloutWorker with its transformers engine as actors, colocated;
         the timed call is the body of RayRoles.sync_weights: PolicyWorker.push_weights on every
         rank (with 2 ranks, FSDP2 shards gathered tensor by tensor, a gloo collective) feeding
         RaySink, which puts each `trainer.sync_bucket_mb` bucket in Ray's object store once and
         has the replica copy it into its live model, then flush and take the new version;
  copy   the floor (FACTS.md): one flat `copy_` of the same bytes into a preallocated tensor in one
         process, with as many threads as the engine actor has; and, for scale, the same bytes
         copied tensor by tensor, as the engine's update_weights does.
Each sync or copy is repeated (one warm-up, then `--repeats`, median), sync and copy alternating so
that both see the same machine load; for each bucket size and each number of training ranks.

Ray serializes torch tensors zero-copy here, as agentrl sets it (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1;
the replica receives read-only views of the object store, which it only copies from). With
--with-copies the whole set is measured again on a second local Ray that copies tensors instead.

Run: python bench/weight_sync.py [--bucket-mb 256 32] [--world-sizes 1 2] [--repeats 5] [--with-copies]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from agentrl.allocator import use_tcmalloc

from machine import Steal, machine_line


def recipe(model: str, world_size: int, output_dir: Path):
    from agentrl.config import RecipeConfig

    return RecipeConfig.model_validate({
        "name": "weight_sync", "output_dir": str(output_dir), "seed": 0,
        "model": {"path": model, "dtype": "float32"},
        "algorithm": {"advantage": "grpo", "kl_coef": 0.0},  # policy and rollout actors only
        "trainer": {"backend": "ray", "world_size": world_size, "engine_replicas": 1, "placement": "colocated",
                    "cpus_per_worker": 1.0, "collective_timeout_s": 120.0, "call_timeout_s": 600.0}})


class Floor:
    """The same tensors the sync sends, flattened once; copies into preallocated memory."""

    def __init__(self, model: str):
        from agentrl.models import load_model
        from agentrl.trainer.distributed import full_tensors

        state = dict(full_tensors(load_model(model, "float32")))  # what a sync sends: tied tensors once
        self.nbytes = sum(t.numel() * t.element_size() for t in state.values())
        self.flat = torch.cat([t.reshape(-1) for t in state.values()])
        self.flat_target = torch.empty_like(self.flat)
        sizes = [t.numel() for t in state.values()]  # per-tensor views of the same two buffers
        self.tensors = [v.view(t.shape) for v, t in zip(self.flat.split(sizes), state.values())]
        self.targets = [v.view(t.shape) for v, t in zip(self.flat_target.split(sizes), state.values())]

    def flat_copy(self) -> float:
        started = time.perf_counter()
        self.flat_target.copy_(self.flat)
        return time.perf_counter() - started

    def per_tensor_copy(self) -> float:
        started = time.perf_counter()
        for target, tensor in zip(self.targets, self.tensors):
            target.copy_(tensor)
        return time.perf_counter() - started


def measure(roles, floor: Floor, bucket_mb: int, repeats: int, version: int) -> tuple[dict[str, list[float]], int]:
    """Alternating syncs and copies; the first of each is a warm-up (dropped). Returns the timings
    and the last weight version sent."""
    from agentrl.trainer.ray_groups import RaySink

    timings: dict[str, list[float]] = {"sync": [], "flat": [], "per_tensor": []}
    for _ in range(1 + repeats):
        version += 1
        timings["flat"].append(floor.flat_copy())
        timings["per_tensor"].append(floor.per_tensor_copy())
        started = time.perf_counter()
        # RayRoles.sync_weights with this bucket size
        roles.policy.push_weights(RaySink(roles.rollout, roles.config.trainer.call_timeout_s), version,
                                  bucket_mb << 20)
        timings["sync"].append(time.perf_counter() - started)
        if roles.weight_version() != version:
            raise SystemExit(f"the engine reports weight version {roles.weight_version()} after sending {version}")
    return {name: values[1:] for name, values in timings.items()}, version


def report(label: str, timings: dict[str, list[float]], floor: Floor, load: str) -> None:
    gb = floor.nbytes / 1e9
    medians = {name: statistics.median(values) for name, values in timings.items()}
    print(f"{label}: {load}")
    for name, text in (("sync", "sync via Ray"), ("flat", "flat copy_"), ("per_tensor", "per-tensor copy_")):
        print(f"  {text:<17} {gb / medians[name]:6.2f} GB/s  median {medians[name]:7.3f} s "
              f"({', '.join(f'{s:.3f}' for s in timings[name])})")
    print(f"  ratio sync/flat-copy GB/s: {medians['flat'] / medians['sync']:.3f} "
          f"(sync takes {medians['sync'] / medians['flat']:.0f}x the floor)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 32], help="trainer.sync_bucket_mb values")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], help="training ranks (FSDP2 above 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per setting, after one warm-up")
    parser.add_argument("--with-copies", action="store_true",
                        help="also measure with Ray copying tensors (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench/weight_sync"))
    args = parser.parse_args()
    use_tcmalloc()  # as the CLI does; may re-run this script (agentrl/allocator.py)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the actors inherit it: no load bars
    from agentrl.trainer.ray_settings import ray_environment

    ray_environment(private=True)  # before ray is imported: loopback only, as agentrl runs it
    import ray

    from agentrl.models import load_tokenizer, provision_builtin

    model = str(provision_builtin("smollm2-135m-instruct"))
    tokenizer = load_tokenizer(model)
    threads = 1  # RoleActor runs each worker with int(trainer.cpus_per_worker) threads
    torch.set_num_threads(threads)
    floor = Floor(model)
    print(machine_line(f"{threads} in the engine actor and for the copy", "float32"), flush=True)
    print(f"weights: {len(floor.tensors)} tensors, {floor.nbytes / 1e6:.1f} MB sent per sync "
          f"1 warm-up + {args.repeats} timed syncs per setting; ray {ray.__version__}, loopback only", flush=True)

    version = 0
    for zero_copy in (True, False) if args.with_copies else (True,):
        version = run_ray(model, tokenizer, floor, args, zero_copy, version)


def run_ray(model: str, tokenizer, floor: Floor, args: argparse.Namespace, zero_copy: bool, version: int) -> int:
    """A local Ray for one serialization mode (the workers read it from their environment at start)."""
    import ray

    from agentrl.trainer.launch import RayRoles
    from agentrl.trainer.ray_cluster import start_local_ray

    os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1" if zero_copy else "0"
    start_local_ray([{"CPU": 1.0}] * max(args.world_sizes))
    try:
        for world_size in args.world_sizes:
            roles = RayRoles(recipe(model, world_size, args.output_dir), tokenizer)
            try:
                for bucket_mb in args.bucket_mb:
                    steal = Steal()
                    timings, version = measure(roles, floor, bucket_mb, args.repeats, version)
                    label = (f"{world_size} training rank{'s' if world_size > 1 else ''}, buckets of {bucket_mb} MiB"
                             + ("" if zero_copy else ", Ray copying tensors (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0)"))
                    report(label, timings, floor, steal.stop())
            finally:
                roles.shutdown()
    finally:
        ray.shutdown()
    return version


if __name__ == "__main__":
    main()
