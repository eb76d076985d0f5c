"""How much of the engine's raw generation speed the multi-turn loop keeps, and how much tool
latency it hides.

Measured side by side in one run, on SmolLM2-135M-Instruct (CPU), same engine, tasks and sampling
settings (temperature 0.8) throughout:
  loop     the episode loop with the calculator: N tasks × G episodes, all concurrent;
  plain    the same engine generating exactly the loop's token count from the same first prompts in
           plain batched calls (no tools, no turns, no stop tokens: each prompt gets its share);
  delayed  the loop again with every tool call delayed by 0.5 s.
The engine's prefix cache is emptied before each, so no run reuses another's keys and values.
Prints the CPU's bf16 features and the dtype the engine ran in, tokens/s of each, the ratios
loop/plain and delayed/loop ("delayed/instant"), how many prompt tokens the loop prefilled and
reused, and how much of the total tool delay (calls × 0.5 s) did not show up as extra wall time.

Untrained SmolLM2 never calls tools, so the model first gets a short supervised warm-up on generated
calculator demonstrations (cached under runs/bench/). Run: python bench/rollout_efficiency.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from agentrl.data import arithmetic_tasks
from agentrl.env.rewards import gsm8k_reward
from agentrl.hardware import choose_dtype, cpu_bf16_support
from agentrl.models import load_model, load_tokenizer
from agentrl.rollout.collect import collect, summarize
from agentrl.rollout.chat import ChatRenderer
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.rollout.hf_engine import HFEngine
from agentrl.tools.base import FunctionTool
from agentrl.tools.builtin.calculator import calculator, evaluate, format_number
from agentrl.tools.parsers import parse_hermes
from agentrl.trainer.sft import conversation_sample, sft_train
from agentrl.types import SamplingParams, Task

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
    return summary | {key: engine.stats[key] - before[key] for key in ("prefill_tokens", "cached_tokens", "batches")}


def run_plain(engine, tokenizer, tasks, group, total_tokens, settings, batch_size):
    """Exactly `total_tokens` from the loop's first prompts, split as evenly as whole tokens allow."""
    engine.prefix_cache.clear()
    renderer = ChatRenderer(tokenizer, [calculator])
    prompts = [renderer.prompt_ids(t.messages(SYSTEM)) for t in tasks for _ in range(group)]
    shares = [total_tokens // len(prompts) + (i < total_tokens % len(prompts)) for i in range(len(prompts))]
    sampling = [SamplingParams(n, settings.temperature, settings.top_p, stop_token_ids=()) for n in shares]
    started = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), batch_size):
        completions = engine.generate_batch(prompts[i:i + batch_size], sampling[i:i + batch_size])
        generated += sum(len(c.token_ids) for c in completions)
    wall = time.perf_counter() - started
    return {"tokens_generated": generated, "wall_s": wall, "tokens_per_s": generated / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--cache", type=Path, default=Path("runs/bench/smollm2-calculator-sft"))
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args()
    torch.manual_seed(0)
    flags = cpu_bf16_support()
    dtype = choose_dtype(args.dtype, "cpu")
    model, tokenizer = warmed_up_model(args.cache, args.warmup_steps, dtype.dtype)
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=64)
    engine.generate_batch([[1, 2, 3]], [SamplingParams(4)])  # first-call costs stay out of the timings
    tasks = arithmetic_tasks(args.tasks, seed=0)
    settings = EpisodeSettings(max_turns=3, max_new_tokens_per_turn=96, max_context_tokens=1024,
                               temperature=0.8, system_prompt=SYSTEM)
    loop = run_loop(engine, tokenizer, [calculator], tasks, args.group, settings)
    plain = run_plain(engine, tokenizer, tasks, args.group, loop["tokens_generated"], settings, batch_size=64)
    slow = run_loop(engine, tokenizer, [delayed(args.delay)], tasks, args.group, settings)

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.tasks} tasks x {args.group} episodes, temperature 0.8")
    print(f"cpu: AMX {'yes' if flags['amx'] else 'no'}, AVX512-BF16 {'yes' if flags['avx512_bf16'] else 'no'}; "
          f"engine dtype {dtype.dtype} ({args.dtype}: {dtype.reason})")
    print(f"{'':8} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'tool calls':>10} {'reward':>6} {'turns':>5}")
    for name, r in (("plain", plain), ("loop", loop), ("delayed", slow)):
        print(f"{name:8} {r['tokens_generated']:7.0f} {r['wall_s']:7.1f} {r['tokens_per_s']:7.1f} "
              f"{r.get('tool_calls_per_episode', 0) * args.tasks * args.group:10.0f} "
              f"{r.get('reward_mean', float('nan')):6.2f} {r.get('mean_turns', float('nan')):5.2f}")
    print(f"ratio loop/plain tokens per second:       {loop['tokens_per_s'] / plain['tokens_per_s']:.2f}")
    print(f"ratio delayed/instant tokens per second:  {slow['tokens_per_s'] / loop['tokens_per_s']:.2f}")
    for name, r in (("loop", loop), ("delayed", slow)):
        print(f"{name}: {r['batches']} batches, prompt tokens prefilled {r['prefill_tokens']}, "
              f"reused from the prefix cache {r['cached_tokens']}")
    total_delay = slow["tool_calls_per_episode"] * args.tasks * args.group * args.delay
    extra = slow["wall_s"] - loop["wall_s"] * slow["tokens_generated"] / max(loop["tokens_generated"], 1)
    if total_delay > 0:
        print(f"tool delay: {total_delay:.1f} s in total across calls, {extra:.1f} s of extra wall time "
              f"(token-adjusted): {1 - extra / total_delay:.0%} hidden by concurrency")


if __name__ == "__main__":
    main()
