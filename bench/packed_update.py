"""A GRPO update with each group's rows packed (prompt once, one decoder call per micro-batch)
against every row in full, one padded row each.

agentrl/trainer/packing.py lays out a group's rows as `[prompt | rest_1 | rest_2 | ...]`; on a CPU
the trainer's attention over it is segmented (segment_attention.py: only the pairs the layout
allows). Three sides run `PolicyWorker.update` on the same worker (SmolLM2-135M-Instruct, AdamW,
token-mean PPO loss) and the same batch, taking turns (the machine is shared and noisy): packed
(segmented attention, where a micro-batch is wide enough for it to pay), packed with the 4D mask
over whole packed rows and its own cost model, and every row in full, padded to the micro-batch's
longest (what the trainer does for models it cannot pack). The packed side's logprobs are
compared with those in full on the same weights before any update (they differ by float rounding:
~1e-5 in float32, a few hundredths in bf16). The default batch has the quickstart's shape: 4
prompts of 250 tokens × 8 completions of 80–190 tokens (`--groups 8 --group-size 4 --prompt 60
--completion 20 64` is bench/vs_trl.py's).
Prints the decoder tokens each side runs (padding included), the median seconds per update and
their ratios. Run: python bench/packed_update.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from agentrl.allocator import use_tcmalloc
from agentrl.hardware import choose_dtype
from agentrl.models import load_model
from agentrl.trainer.packing import pack_cost
from agentrl.trainer.policy import PolicyWorker
from machine import machine_line  # bench/machine.py, beside this script


def grpo_batch(groups: int, size: int, prompt: int, completion: tuple[int, int], seed: int = 0):
    """(sequences, masks, advantages): `groups` random prompts, `size` completions each."""
    rng = random.Random(seed)
    sequences, masks, advantages = [], [], []
    for _ in range(groups):
        shared = [rng.randrange(100, 40_000) for _ in range(prompt)]
        for _ in range(size):
            n = rng.randint(*completion)
            sequences.append(shared + [rng.randrange(100, 40_000) for _ in range(n)])
            masks.append([0] * prompt + [1] * n)
            advantages.append([0.0] * prompt + [rng.choice((-1.0, 1.0))] * n)
    return sequences, masks, advantages


def decoder_tokens(worker: PolicyWorker, sequences, masks) -> int:
    """Tokens the decoder runs for one pass over the batch, padding included."""
    plan = worker.ranks.micro_batch_plan(list(range(len(sequences))), sequences, masks, worker.micro_batch_tokens,
                                         worker.pack_cost)
    return sum(len(micro) * max(p.length for p in micro) for micro in plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=250)
    parser.add_argument("--completion", type=int, nargs=2, default=[80, 190])
    parser.add_argument("--micro-batch-tokens", type=int, default=2048, help="the quickstart's")
    parser.add_argument("--trials", type=int, default=4, help="updates per side, after one warm-up each")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args()
    use_tcmalloc()  # as the CLI does; may re-run this script (agentrl/allocator.py)
    dtype = choose_dtype(args.dtype, "cpu")
    print(machine_line(str(torch.get_num_threads()), f"{dtype.dtype} ({args.dtype}: {dtype.reason})"), flush=True)
    sequences, masks, advantages = grpo_batch(args.groups, args.group_size, args.prompt, tuple(args.completion))
    worker = PolicyWorker(load_model("smollm2-135m-instruct", "float32"), 2, lr=1e-6, temperature=1.0,
                          micro_batch_tokens=args.micro_batch_tokens, bf16_autocast=dtype.dtype == "bfloat16")
    model = worker.model
    segmented = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    # name -> (attention, cost): packed with segmented attention (the trainer's CPU default), packed
    # with the 4D mask over whole rows (its cost model), every row in full
    sides = {"packed": (segmented, worker.pack_cost), "packed, mask": ("sdpa", pack_cost(model)),
             "rows in full": ("sdpa", None)}

    def use(side: str) -> None:
        attention, worker.pack_cost = sides[side]
        model.set_attn_implementation(attention)

    tokens, logprobs = {}, {}
    for name in sides:
        use(name)
        tokens[name] = decoder_tokens(worker, sequences, masks)
        logprobs[name] = worker.logprobs(sequences, masks)
    gaps = [abs(a - b) for x, y, mask in zip(logprobs["packed"], logprobs["rows in full"], masks)
            for a, b, m in zip(x, y, mask) if m]
    trained = sum(sum(m[1:]) for m in masks)
    print(f"{args.groups} prompts of {args.prompt} tokens x {args.group_size} completions of "
          f"{args.completion[0]}-{args.completion[1]} tokens ({trained} trained); micro-batches of "
          f"{args.micro_batch_tokens} padded tokens; logprobs packed vs in full on trained tokens: mean gap "
          f"{statistics.mean(gaps):.1e}, max {max(gaps):.1e} (float rounding: ~1e-5 in float32)")
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for trial in range(args.trials + 1):
        for name in sides:
            use(name)
            started = time.perf_counter()
            worker.update(sequences, masks, advantages)
            if trial:  # the first of each side is a warm-up
                seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    for name in sides:
        print(f"{name:12} decoder tokens {tokens[name]:6d}, update {median[name]:6.2f} s "
              f"({', '.join(f'{s:.2f}' for s in seconds[name])})")
    print(f"in full / packed: tokens {tokens['rows in full'] / tokens['packed']:.2f}, "
          f"seconds {median['rows in full'] / median['packed']:.2f}; packed with the mask / packed: seconds "
          f"{median['packed, mask'] / median['packed']:.2f}")


if __name__ == "__main__":
    main()
