"""What FSDP2 sharding costs: training tokens/s of two FSDP2 ranks with one thread each against one
process with two threads, on the same cores and the same global batch.

Both sides are agentrl's PolicyWorker on the real SmolLM2-135M-Instruct in float32:
  fsdp    two processes, `Ranks(r, 2)`, a gloo process group on 127.0.0.1, one thread each: every
          rank takes its token-balanced half of the batch, gathers each layer's parameters for its
          forward and backward, and reduce-scatters the gradients;
  single  one process, `Ranks()`, two threads: the whole batch, no collectives.
The global batch is the same: 8 sequences of 192-320 tokens (256 on average), the prompt (the first
96-160 tokens) masked and the completion trained with a per-sequence advantage, as a GRPO step
gives it; the micro-batch token budget is the same. Token ids are drawn at random (seeded): the
speed of a step does not depend on which tokens they are. Each side makes one warm-up `update` and
then `--steps` timed ones (median); the sides run one after the other, each in fresh processes, so
that only one side's model, gradients and optimizer state are in memory at a time.

On a 2-core machine the two ranks cannot be faster than one process using both cores: the figure
is how little sharding costs (ratio fsdp/single near 1 is good). The first update's loss and
gradient norm must agree between the sides (the workers normalise by the global token count).

Run: python bench/fsdp_overhead.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from agentrl.allocator import use_tcmalloc
from agentrl.trainer.distributed import open_rendezvous, remove_rendezvous

from machine import Steal, machine_line

SEQUENCES, PROMPT_TOKENS, COMPLETION_TOKENS = 8, (96, 160), (96, 160)
TIMEOUT_S = 120.0


def make_batch(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """(sequences, loss masks, per-token advantages): prompts masked, completions trained."""
    rng = random.Random(seed)
    sequences, masks, advantages = [], [], []
    for _ in range(SEQUENCES):
        prompt, completion = rng.randint(*PROMPT_TOKENS), rng.randint(*COMPLETION_TOKENS)
        advantage = rng.gauss(0.0, 1.0)
        sequences.append([rng.randrange(vocab) for _ in range(prompt + completion)])
        masks.append([0] * prompt + [1] * completion)
        advantages.append([0.0] * prompt + [advantage] * completion)
    return sequences, masks, advantages


def run_side(rank: int, world_size: int, threads: int, rendezvous: str, args: argparse.Namespace,
             results: mp.Queue) -> None:
    """One process of one side: build the worker, one warm-up and `args.steps` timed updates."""
    torch.set_num_threads(threads)
    import torch.distributed as dist

    from agentrl.models import load_model, load_tokenizer
    from agentrl.trainer.distributed import Ranks, init_process_group
    from agentrl.trainer.policy import PolicyWorker

    ranks = Ranks(rank, world_size)
    init_process_group(ranks, rendezvous, "cpu", TIMEOUT_S)
    torch.manual_seed(0)
    pad_id = load_tokenizer(args.model).pad_token_id
    model = load_model(args.model, "float32")
    worker = PolicyWorker(model, pad_id, lr=1e-6, temperature=1.0, micro_batch_tokens=args.micro_batch_tokens,
                          ranks=ranks)
    sequences, masks, advantages = make_batch(args.vocab)
    timings, cpu, metrics = [], [], []
    for _ in range(1 + args.steps):
        if ranks.distributed:
            dist.barrier()  # both ranks start the clock together
        started, cpu_started = time.perf_counter(), time.process_time()
        metrics.append(worker.update(sequences, masks, advantages))
        timings.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)  # all of this process's threads
    results.put({"rank": rank, "seconds": timings, "cpu_seconds": cpu, "metrics": metrics,
                 "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    if ranks.distributed:
        dist.barrier()
        dist.destroy_process_group()


def run(world_size: int, threads: int, args: argparse.Namespace) -> tuple[list[dict], str]:
    """Start the side's processes, wait for all, return their results (by rank) and the CPU share."""
    context = mp.get_context("spawn")
    results = context.Queue()
    # The ranks meet at a file, as a single-node run's do (trainer/distributed.py).
    rendezvous, _ = open_rendezvous("127.0.0.1") if world_size > 1 else ("", None)
    steal = Steal()
    processes = [context.Process(target=run_side, args=(r, world_size, threads, rendezvous, args, results))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    collected = []
    deadline = time.monotonic() + 900
    try:
        while len(collected) < world_size:
            try:
                collected.append(results.get(timeout=5))
            except queue.Empty:  # check that nobody died
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    for process in processes:
                        process.kill()
                    raise SystemExit(f"the side with {world_size} process(es) failed: exit codes "
                                     f"{[p.exitcode for p in processes]}")
        for process in processes:
            process.join()
    finally:
        remove_rendezvous(rendezvous)
    return sorted(collected, key=lambda r: r["rank"]), steal.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed updates per side, after one warm-up")
    parser.add_argument("--micro-batch-tokens", type=int, default=1280,
                        help="padded tokens per forward/backward, on both sides")
    args = parser.parse_args()
    use_tcmalloc()  # as the CLI does; may re-run this script (agentrl/allocator.py)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the side processes inherit it: no load bars

    from agentrl.models import provision_builtin

    args.model = str(provision_builtin("smollm2-135m-instruct"))
    args.vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    sequences, masks, _ = make_batch(args.vocab)
    tokens = sum(len(s) for s in sequences)
    trained = sum(sum(m[1:]) for m in masks)
    print(machine_line("single 2 / fsdp 1 per rank", "float32"), flush=True)
    print(f"batch: {SEQUENCES} sequences, {tokens} tokens ({trained} trained), micro-batch budget "
          f"{args.micro_batch_tokens} tokens; 1 warm-up + {args.steps} timed updates per side; "
          f"SmolLM2-135M-Instruct, AdamW", flush=True)

    sides = {"single": run(1, 2, args), "fsdp": run(2, 1, args)}
    medians = {}
    for name, (ranks, load) in sides.items():
        per_update = [max(r["seconds"][i] for r in ranks) for i in range(1 + args.steps)]
        cpu_s = statistics.median([sum(r["cpu_seconds"][i] for r in ranks) for i in range(1, 1 + args.steps)])
        medians[name] = statistics.median(per_update[1:])
        rss = " + ".join(f"{r['peak_rss_gb']:.2f}" for r in ranks)
        print(f"{name:<7} {tokens / medians[name]:7.1f} tokens/s  median {medians[name]:6.2f} s/update "
              f"(updates {', '.join(f'{s:.1f}' for s in per_update)}; first is warm-up); "
              f"{tokens / cpu_s:5.1f} tokens per CPU-second, got {cpu_s / medians[name] / 2:.0%} of 2 cores; "
              f"peak RSS {rss} GB; machine {load}")
    print(f"ratio fsdp/single tokens per second: {medians['single'] / medians['fsdp']:.2f}")

    single, fsdp = sides["single"][0][0]["metrics"][0], [r["metrics"][0] for r in sides["fsdp"][0]]
    fsdp_loss = sum(m["loss"] for m in fsdp)  # each rank's loss is its part of the global loss
    fsdp_norm = fsdp[0]["grad_norm"]  # the same on every rank
    loss_diff = abs(fsdp_loss - single["loss"]) / max(abs(single["loss"]), 1e-12)
    norm_diff = abs(fsdp_norm - single["grad_norm"]) / single["grad_norm"]
    agree = loss_diff < 1e-4 and norm_diff < 1e-4
    print(f"first update: loss single {single['loss']:.8f} fsdp {fsdp_loss:.8f} (rel diff {loss_diff:.1e}); "
          f"grad norm single {single['grad_norm']:.6f} fsdp {fsdp_norm:.6f} (rel diff {norm_diff:.1e}): "
          f"{'agree' if agree else 'DISAGREE'} within 1e-4")


if __name__ == "__main__":
    main()
