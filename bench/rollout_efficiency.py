"""How much of the engine's raw generation speed the multi-turn loop keeps, and how much tool
latency it hides.

Measured side by side in one run, on SmolLM2-135M-Instruct (CPU), same engine, tasks and sampling
settings (temperature 0.8) throughout:
  loop        the episode loop with the calculator: N tasks × G episodes, all concurrent;
  plain       the same engine generating, from each episode's first prompt, exactly as many
              tokens as that episode generated over all its turns, all asked at once (no tools, no
              turns, no stop tokens): the same total and the same spread of lengths, so the ratio
              is what the turns cost, not how unevenly the sampled answers ended;
  plain-even  the same total split evenly over the prompts (no row outlasts the others, so no
              steps run with a thinned-out batch): reported beside it, the stricter reference;
  delayed     the loop again with every tool call delayed by 0.5 s.
The engine's prefix cache is emptied before each, so no run reuses another's keys and values.
Prints the CPU's bf16 features and the dtype the engine ran in; then per round (`--rounds`, the
runs interleaved, because the machine is noisy) tokens/s of each, the ratios loop/plain (and
loop/plain-even) and delayed/loop ("delayed/instant"), prompt tokens prefilled and reused from the
prefix cache (the loop prefills every tool response and generation prompt on top of what plain
prefills), requests that joined a running batch (for plain: ones that missed the first batch),
requests that joined as copies of another with the same prompt (a group's episodes that made the
same tool call, and a group's first prompts; `--group 1 --tasks 32` runs without them), and how much of the total tool delay (calls × 0.5 s) did not show up as extra wall time; finally the
medians of the ratios over the rounds, with their range. An untimed loop and plain run first.

Untrained SmolLM2 never calls tools, so the model first gets a short supervised warm-up on generated
calculator demonstrations (cached under runs/bench/). Run: python bench/rollout_efficiency.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from agentrl.allocator import use_tcmalloc
from agentrl.data import arithmetic_tasks
from agentrl.env.rewards import gsm8k_reward
from agentrl.hardware import choose_dtype
from agentrl.models import load_model, load_tokenizer
from agentrl.rollout.collect import collect, summarize
from agentrl.rollout.chat import ChatRenderer, stop_token_ids
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.rollout.hf_engine import HFEngine
from agentrl.tools.base import FunctionTool
from agentrl.tools.builtin.calculator import calculator, evaluate, format_number
from agentrl.tools.parsers import parse_hermes
from agentrl.trainer.sft import conversation_sample, sft_train
from agentrl.types import SamplingParams, Task
from machine import machine_line  # bench/machine.py, beside this script

SYSTEM = "Solve the problem. Use the calculator tool for arithmetic, then state the final answer."


def demonstration(task: Task) -> list[dict]:
    expression = task.metadata["expression"]
    value = format_number(evaluate(expression))
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt},
            {"role": "assistant", "content": call}, {"role": "tool", "name": "calculator", "content": value},
            {"role": "assistant", "content": f"The answer is {value}."}]


def warmed_up_model(cache: Path, steps: int, dtype: str):
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    if (cache / "config.json").is_file():
        return load_model(str(cache), dtype), tokenizer
    model = load_model("smollm2-135m-instruct")
    renderer = ChatRenderer(tokenizer, [calculator])
    samples = [conversation_sample(renderer, demonstration(t))
               for t in arithmetic_tasks(64, seed=1000, min_digits=2, max_digits=3)]
    started = time.perf_counter()
    losses = sft_train(model, samples, tokenizer.pad_token_id, steps=steps, batch_size=4, lr=2e-4)
    print(f"warm-up: {steps} SFT steps in {time.perf_counter() - started:.0f} s, "
          f"loss {losses[0]:.3f} -> {statistics.mean(losses[-5:]):.3f}")
    model.save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    return load_model(str(cache), dtype), tokenizer


def delayed(seconds: float) -> FunctionTool:
    """The calculator, same name and schema, answering `seconds` late."""

    async def slow_calculator(expression: str) -> str:
        await asyncio.sleep(seconds)
        return calculator(expression)

    return FunctionTool(slow_calculator, schema=calculator.schema)


def run_loop(engine, tokenizer, tools, tasks, group, settings):
    engine.prefix_cache.clear()
    before = dict(engine.stats)
    runner = EpisodeRunner(engine, tokenizer, tools, parse_hermes, settings, reward_fn=gsm8k_reward)
    started = time.perf_counter()
    trajectories = asyncio.run(collect(runner, tasks, group, max_concurrent=len(tasks) * group))
    summary = summarize(trajectories, time.perf_counter() - started)
    summary["per_episode"] = [t.num_generated for t in trajectories]  # in the order of run_plain's prompts
    counts = {key: engine.stats[key] - before[key]
              for key in ("prefill_tokens", "cached_tokens", "batches", "copied_requests")}
    return summary | counts | {"joined": engine.stats["joined_requests"] - before["joined_requests"]}


def run_plain(engine, tokenizer, tasks, group, shares, settings):
    """`shares[i]` tokens from the loop's i-th first prompt, asked concurrently through `generate`
    like the loop (so the same decode thread serves both)."""
    engine.prefix_cache.clear()
    renderer = ChatRenderer(tokenizer, [calculator])
    prompts = [renderer.prompt_ids(t.messages(SYSTEM)) for t in tasks for _ in range(group)]

    async def ask_all():
        return await asyncio.gather(*(
            engine.generate(p, SamplingParams(n, settings.temperature, settings.top_p, stop_token_ids=()))
            for p, n in zip(prompts, shares)))

    before = dict(engine.stats)
    started = time.perf_counter()
    generated = sum(len(c.token_ids) for c in asyncio.run(ask_all()))
    wall = time.perf_counter() - started
    counts = {key: engine.stats[key] - before[key] for key in ("prefill_tokens", "cached_tokens", "copied_requests")}
    # Requests that missed the first batch and joined it later (a loaded machine): shown, not hidden.
    joined = engine.stats["joined_requests"] - before["joined_requests"]
    return {"tokens_generated": generated, "wall_s": wall, "tokens_per_s": generated / wall, "joined": joined} | counts


def report(name: str, r: dict, episodes: int) -> None:
    print(f"{name:10} {r['tokens_generated']:7.0f} {r['wall_s']:7.1f} {r['tokens_per_s']:7.1f} "
          f"{r.get('tool_calls_per_episode', 0) * episodes:10.0f} {r.get('reward_mean', float('nan')):6.2f} "
          f"{r.get('mean_turns', float('nan')):5.2f} {r.get('prefill_tokens', 0):8.0f} "
          f"{r.get('cached_tokens', 0):7.0f} {r.get('joined', 0):6.0f} {r.get('copied_requests', 0):6.0f}")


def even_shares(total: int, n: int) -> list[int]:
    return [total // n + (i < total % n) for i in range(n)]


def one_round(engine, tokenizer, tasks, args, settings) -> tuple[float, float, float, float]:
    """loop, both plains and delayed side by side; returns loop/plain, loop/plain-even,
    delayed/instant and the share of the tool delay hidden."""
    episodes = args.tasks * args.group
    loop = run_loop(engine, tokenizer, [calculator], tasks, args.group, settings)
    plain = run_plain(engine, tokenizer, tasks, args.group, loop["per_episode"], settings)
    even = run_plain(engine, tokenizer, tasks, args.group, even_shares(int(loop["tokens_generated"]), episodes),
                     settings)
    slow = run_loop(engine, tokenizer, [delayed(args.delay)], tasks, args.group, settings)
    print(f"{'':10} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'tool calls':>10} {'reward':>6} {'turns':>5} "
          f"{'prefill':>8} {'reused':>7} {'joined':>6} {'copies':>6}")
    for name, r in (("plain", plain), ("plain-even", even), ("loop", loop), ("delayed", slow)):
        report(name, r, episodes)
    total_delay = slow["tool_calls_per_episode"] * episodes * args.delay
    extra = slow["wall_s"] - loop["wall_s"] * slow["tokens_generated"] / max(loop["tokens_generated"], 1)
    hidden = 1 - extra / total_delay if total_delay > 0 else float("nan")
    ratios = (loop["tokens_per_s"] / plain["tokens_per_s"], loop["tokens_per_s"] / even["tokens_per_s"],
              slow["tokens_per_s"] / loop["tokens_per_s"], hidden)
    print(f"loop/plain {ratios[0]:.2f} (loop/plain-even {ratios[1]:.2f}), delayed/instant {ratios[2]:.2f}; "
          f"tool delay {total_delay:.1f} s in total, {extra:.1f} s of extra wall time (token-adjusted): "
          f"{hidden:.0%} hidden by concurrency")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5, help="loop, plain, delayed this many times, interleaved")
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--cache", type=Path, default=Path("runs/bench/smollm2-calculator-sft"))
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--separate-joins", action="store_true",
                        help="rows joining the running batch get a forward pass of their own (as for non-SDPA models)")
    args = parser.parse_args()
    use_tcmalloc()  # as the CLI does; may re-run this script (agentrl/allocator.py)
    torch.manual_seed(0)
    dtype = choose_dtype(args.dtype, "cpu")
    model, tokenizer = warmed_up_model(args.cache, args.warmup_steps, dtype.dtype)
    # The message ends let the engine share the prompts' first message, as the CLI's engine does.
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=64,
                      message_end_ids=stop_token_ids(tokenizer))
    engine.mixed_passes = engine.mixed_passes and not args.separate_joins
    # First-call costs stay out of the timings. Every timed run goes through `generate`, so the same
    # decode thread serves all three: on a loaded 2-core machine torch ran 2.4x slower in the main
    # thread than in a worker thread, which would skew a comparison across the two.
    asyncio.run(engine.generate([1, 2, 3], SamplingParams(4)))
    tasks = arithmetic_tasks(args.tasks, seed=0)
    settings = EpisodeSettings(max_turns=3, max_new_tokens_per_turn=96, max_context_tokens=1024,
                               temperature=0.8, system_prompt=SYSTEM)
    print(machine_line(str(torch.get_num_threads()), f"{dtype.dtype} ({args.dtype}: {dtype.reason})"))
    print(f"{args.tasks} tasks x {args.group} episodes, temperature 0.8; joining rows in "
          f"{'the decode step' if engine.mixed_passes else 'passes of their own'}")
    # One untimed loop and plain first: the first 32-row batches, mixed passes and buffer growth
    # would otherwise fall on the first round's loop alone.
    warm = run_loop(engine, tokenizer, [calculator], tasks, args.group, settings)
    run_plain(engine, tokenizer, tasks, args.group, warm["per_episode"], settings)
    rounds = [one_round(engine, tokenizer, tasks, args, settings) for _ in range(args.rounds)]
    def spread(i: int) -> str:
        values = [r[i] for r in rounds]
        return f"{statistics.median(values):.2f} (range {min(values):.2f}-{max(values):.2f})"

    print(f"median over {args.rounds} rounds: loop/plain {spread(0)}, loop/plain-even {spread(1)}, "
          f"delayed/instant {spread(2)}, tool delay hidden {statistics.median(r[3] for r in rounds):.0%}")


if __name__ == "__main__":
    main()
