"""One decode step of rows that all share a length: the engine's attention against transformers' SDPA.

When no row of a decode step has padding, transformers passes no mask and sends the one-token
queries to SDPA with `enable_gqa`; the engine's attention (agentrl/rollout/packed_attention.py)
groups each key head's query heads as its queries instead. This times one forward pass of R rows
with 300 cached tokens each (SmolLM2-135M-Instruct: 9 query heads, 3 key heads), the same model
switching its attention between the two every other trial, and prints the medians and their ratio
for each R, in bfloat16 and float32. Run: python bench/decode_step.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from agentrl.allocator import use_tcmalloc
from agentrl.models import load_model
from agentrl.rollout import packed_attention
from agentrl.rollout.kv_cache import cache_keyword, returned_cache
from machine import machine_line  # bench/machine.py, beside this script


def step_seconds(model, cache: DynamicCache, tokens_B1: torch.Tensor, positions_B1: torch.Tensor) -> float:
    """One decode step on `cache`, which is cropped back afterwards."""
    length = cache.get_seq_length()
    started = time.perf_counter()
    model(input_ids=tokens_B1, position_ids=positions_B1, use_cache=True, **{cache_keyword(model): cache})
    seconds = time.perf_counter() - started
    cache.crop(length - cache.get_seq_length())  # a negative count: tokens to remove
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--cached", type=int, default=300)
    parser.add_argument("--trials", type=int, default=10, help="per side, alternating")
    args = parser.parse_args()
    use_tcmalloc()  # as the CLI does; may re-run this script (agentrl/allocator.py)
    print(machine_line(str(torch.get_num_threads()), "bfloat16, then float32"), flush=True)
    torch.manual_seed(0)
    for dtype in ("bfloat16", "float32"):
        model = load_model("smollm2-135m-instruct", dtype)
        with torch.no_grad():
            for rows in args.rows:
                ids = torch.randint(100, 40_000, (rows, args.cached))
                prefix = returned_cache(model(input_ids=ids, use_cache=True, logits_to_keep=1))
                tokens, positions = torch.randint(100, 40_000, (rows, 1)), torch.full((rows, 1), args.cached)
                times: dict[str, list[float]] = {"sdpa": [], packed_attention.NAME: []}
                for trial in range(2 * args.trials + 2):
                    name = ("sdpa", packed_attention.NAME)[trial % 2]
                    model.set_attn_implementation(name)
                    seconds = step_seconds(model, prefix, tokens, positions)
                    if trial >= 2:  # one warm-up trial each
                        times[name].append(seconds)
                ours, theirs = (statistics.median(times[k]) for k in (packed_attention.NAME, "sdpa"))
                print(f"{dtype:8} {rows:2d} rows x {args.cached} cached tokens: engine attention {ours * 1e3:6.1f} ms, "
                      f"transformers' SDPA {theirs * 1e3:6.1f} ms, SDPA/engine {theirs / ours:.2f}")
        model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()
