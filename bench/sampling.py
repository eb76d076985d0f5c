"""Drawing the next token of 32 rows with top-p: the engine's sampler against a full sort.

Nucleus sampling needs each row's probabilities in descending order. The engine
(agentrl/rollout/sampling.py) orders only the 256 most likely tokens when they hold the nucleus,
and falls back to sorting the whole vocabulary when they do not; the reference sorts the whole
vocabulary every time, as the engine did before. Both draw from the same logits with the same
seeds, so the drawn ids must agree, which is checked. The logits are SmolLM2-135M-Instruct's own,
over a sampled answer (peaked, as a trained model's are), and random normal logits (flat: the top
256 hold little, so the engine falls back). Also timed: top-p 1, which orders nothing.
Run: python bench/sampling.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agentrl.allocator import use_tcmalloc
from agentrl.models import load_model, load_tokenizer
from agentrl.rollout import sampling
from machine import machine_line  # bench/machine.py, beside this script


def model_logits(rows: int) -> torch.Tensor:
    """The model's next-token logits at `rows` positions of an answer it sampled itself."""
    tokenizer, model = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct", "float32")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain step by step how to compute "
                                             "17 times 23, then check the result another way."}],
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        torch.manual_seed(0)
        answer = model.generate(**prompt, max_new_tokens=rows, do_sample=True, temperature=0.8, top_p=1.0)
        return model(answer).logits[0, -rows:].float()


def alternating(draws: dict[str, object], trials: int) -> dict[str, float]:
    """Median seconds of each draw, the draws taking turns (the machine is shared and noisy)."""
    times: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(trials):
        for name, draw in draws.items():
            started = time.perf_counter()
            draw()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    use_tcmalloc()  # as the CLI does; may re-run this script (agentrl/allocator.py)
    print(machine_line(str(torch.get_num_threads()), "float32 logits"), flush=True)
    torch.manual_seed(1)
    cases = {"model": model_logits(args.rows), "flat": torch.randn(args.rows, 49152)}
    for name, logits in cases.items():
        mass = torch.softmax(logits / args.temperature, -1).topk(sampling.NUCLEUS_CANDIDATES).values.sum(-1)
        draws = {"engine": lambda: sampling.sample_tokens(logits, args.temperature, args.top_p, None),
                 "full sort": lambda: with_nucleus(_full_sort, logits, args, None),
                 "top-p 1": lambda: sampling.sample_tokens(logits, args.temperature, 1.0, None)}
        seeded = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
        same = all(torch.equal(sampling.sample_tokens(logits, args.temperature, args.top_p, seeded(seed))[0],
                               with_nucleus(_full_sort, logits, args, seeded(seed))[0]) for seed in range(5))
        t = alternating(draws, args.trials)
        print(f"{name:5} logits, {args.rows} rows x {logits.shape[1]} (top {sampling.NUCLEUS_CANDIDATES} hold "
              f"{mass.min():.3f}-{mass.max():.3f}): top-p {args.top_p} engine {t['engine'] * 1e3:6.1f} ms, "
              f"full sort {t['full sort'] * 1e3:6.1f} ms, full/engine {t['full sort'] / t['engine']:.1f}; "
              f"same draws: {'yes' if same else 'NO'}; top-p 1 {t['top-p 1'] * 1e3:.1f} ms")


def with_nucleus(nucleus, logits: torch.Tensor, args: argparse.Namespace, generator: torch.Generator | None):
    """sample_tokens with `nucleus` in place of the engine's."""
    original, sampling.nucleus = sampling.nucleus, nucleus
    try:
        return sampling.sample_tokens(logits, args.temperature, args.top_p, generator)
    finally:
        sampling.nucleus = original


def _full_sort(probs_BV: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus by sorting every row's whole vocabulary."""
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    return sorted_BV.masked_fill(sorted_BV.cumsum(dim=-1) - sorted_BV > top_p, 0.0), order_BV


if __name__ == "__main__":
    main()
