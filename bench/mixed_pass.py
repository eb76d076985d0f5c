"""What folding joining rows into the running rows' decode step buys the transformers engine.

When episodes come back from their tools, their requests join the running batch. The engine runs
the joining rows' new tokens and the running rows' next token in one packed forward pass (a mixed
pass, agentrl/rollout/packed_attention.py); the reference is the same work in the two passes a
model without SDPA attention needs: the running rows' decode step, then a forward pass for the
joining rows (each side samples one token per row, 32 in all). Both start from the same
state: a batch of 32 - J rows decoding after ~300-token prompts, and J rows joining with 300 cached
tokens (their previous turn, from the prefix cache) and `--new` new tokens each (a tool response
and the next generation prompt). Trials alternate between the two and the medians are printed,
with their ratio, for each J. SmolLM2-135M-Instruct; run: python bench/mixed_pass.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agentrl.allocator import use_tcmalloc
from agentrl.hardware import choose_dtype
from agentrl.models import load_model
from agentrl.rollout.hf_engine import HFEngine
from agentrl.rollout.running_batch import Row, RunningBatch
from agentrl.types import SamplingParams
from machine import machine_line  # bench/machine.py, beside this script


def one_join(engine: HFEngine, prompts: list[list[int]], joining: int, new: int, mixed: bool) -> float:
    """Seconds for `joining` rows to join a batch of the other prompts: one mixed pass, or a decode
    step and a join pass (the same tokens). The joining rows' previous turns are in the engine's
    prefix cache."""
    model = engine.model
    sampling = SamplingParams(10_000, 0.8, stop_token_ids=())
    batch = RunningBatch(model.config, engine.pad_token_id, engine.device, next(model.parameters()).dtype, 64,
                         cache_keyword=engine.cache_keyword)
    engine._prefill(batch, [Row(p, sampling) for p in prompts[joining:]])
    batch._reserve(64, 0, 0)  # slots for everyone: the buffers do not grow inside the timed part
    for _ in range(2):
        engine._step(batch)
    rows = [Row(p + torch.randint(100, 40_000, (new,)).tolist(), sampling) for p in prompts[:joining]]
    started = time.perf_counter()
    if mixed:
        engine._mixed(batch, rows)
    else:
        engine._step(batch)
        engine._prefill(batch, rows)
    seconds = time.perf_counter() - started
    assert all(r.hit.length == len(prompts[0]) for r in rows), "the previous turns were not reused"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--joining", type=int, nargs="+", default=[1, 4, 10])
    parser.add_argument("--new", type=int, default=30, help="new tokens per joining row")
    parser.add_argument("--trials", type=int, default=6, help="per side and J, alternating")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args()
    use_tcmalloc()  # as the CLI does; may re-run this script (agentrl/allocator.py)
    dtype = choose_dtype(args.dtype, "cpu")
    print(machine_line(str(torch.get_num_threads()), f"{dtype.dtype} ({args.dtype}: {dtype.reason})"))
    engine = HFEngine(load_model("smollm2-135m-instruct", dtype.dtype), pad_token_id=2, max_batch_size=64)
    torch.manual_seed(0)
    prompts = [torch.randint(100, 40_000, (300,)).tolist() for _ in range(32)]
    with torch.no_grad():  # every joining row's previous turn, into the prefix cache
        engine.generate_batch(prompts[:max(args.joining)], [SamplingParams(1, 0.8, stop_token_ids=())] * max(args.joining))
        for joining in args.joining:
            times = {True: [], False: []}
            for trial in range(2 * args.trials):
                mixed = trial % 2 == 0
                times[mixed].append(one_join(engine, prompts, joining, args.new, mixed))
            mixed, separate = statistics.median(times[True]), statistics.median(times[False])
            print(f"{joining:2d} rows joining {32 - joining} running ({args.new} new tokens each): mixed pass "
                  f"{mixed * 1000:.0f} ms, step + join pass {separate * 1000:.0f} ms, "
                  f"separate/mixed {separate / mixed:.2f}")


if __name__ == "__main__":
    main()
