"""Seconds per GRPO step: agentrl against TRL's GRPOTrainer on the same single-turn workload (CPU).

Workload, identical on both sides: SmolLM2-135M-Instruct, full fine-tuning, in float32 (with
--dtype bfloat16 the sides differ: agentrl's engine holds bf16 weights and its trainer runs bf16
autocast; TRL's bf16 flag runs autocast over float32 weights throughout), the same generated
arithmetic prompts rendered by the same chat template, --prompts × --group completions per step
(default 4 × 4), at most --max-new-tokens new tokens (default 32) at temperature 1, the same
exact-answer reward, no KL term (beta 0), one AdamW step per batch (lr 1e-6, grad clip 1.0), clip
0.2, token-mean loss. A step is generation + logprobs + update
(+ weight sync into the engine, for agentrl). The first step of each side is a warm-up and is not
counted.

TRL runs in its own virtual environment (.venv-trl, created on first use with a pinned trl), so its
pins never touch the project's; this script re-runs itself there with --trl-worker. agentrl runs
in this interpreter through its real driver (agentrl.train.train).

Both sides run on the memory allocator agentrl's CLI uses (tcmalloc where installed, see
agentrl/allocator.py), so the comparison is of the toolkits; --trl-allocator system gives TRL the
system allocator, as a TRL user has it by default.

Prints the machine (CPU, its amx_bf16/avx512_bf16 flags, dtype, allocator) and, per side, where a step's
time goes: agentrl's rollout / logprobs / update / sync from its metrics; TRL's generation and
scoring (`_generate_and_score_completions`; with one iteration per batch and no KL it runs no extra
logprob pass) against the rest of the step (loss, backward, optimizer). A step's time is its wall
time on both sides (agentrl's `time_step_s`). TRL runs without gradient checkpointing, as agentrl
does (TRL's own default turns it on). Each side samples its own completions, so the ratio is also
printed per completion token.

Run: python bench/vs_trl.py [--steps 8] [--prompts 8 --group 4 --max-new-tokens 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import machine_line  # bench/machine.py: python puts the script's directory on sys.path

TRL_PIN = "trl==1.16.0"
TORCH_PIN = "torch==2.13.0"
LR = 1e-6
SYSTEM = "Solve the problem and end with the final number."


def ensure_trl_venv(path: Path) -> Path:
    """TRL's environment, with the transformers agentrl runs on here (both sides run the same model
    code); set up again when that version changes."""
    from importlib.metadata import version

    python = path / "bin" / "python"
    pins = [TRL_PIN, f"transformers=={version('transformers')}"]
    stamp = path / ".installed"
    if not stamp.exists() or stamp.read_text() != " ".join(pins):
        print(f"setting up {path} with {' '.join(pins)}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", TORCH_PIN], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *pins], check=True)
        stamp.write_text(" ".join(pins))
    return python


# ---------------------------------------------------------------------------------------------- TRL side
def trl_worker(workload_path: str) -> None:
    """Runs inside .venv-trl: imports only torch, datasets, transformers and trl (and, from this
    checkout, agentrl's standard-library-only allocator module, to report the allocator)."""
    import re

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    w = json.loads(Path(workload_path).read_text())
    torch.manual_seed(0)
    rows = [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}], "answer": a}
            for p, a in zip(w["prompts"], w["answers"])]

    def exact_answer(completions, answer, **_):
        scores = []
        for completion, truth in zip(completions, answer):
            numbers = re.findall(r"-?\d[\d,]*\.?\d*", completion[0]["content"])
            scores.append(float(bool(numbers) and numbers[-1].replace(",", "").rstrip(".") == truth))
        return scores

    class TimedGRPOTrainer(GRPOTrainer):
        """Adds up the seconds spent generating and scoring (rollout + logprobs) per step."""
        generate_s: list[float] = []

        def _generate_and_score_completions(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*args, **kwargs)
            finally:
                self.generate_s.append(time.perf_counter() - started)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.started = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.started)

    args = GRPOConfig(
        output_dir=w["output_dir"], use_cpu=True, bf16=w["dtype"] == "bfloat16", fp16=False, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=w["steps"], per_device_train_batch_size=w["prompts_per_step"] * w["group"],
        gradient_accumulation_steps=1, num_generations=w["group"], max_completion_length=w["max_new_tokens"],
        temperature=1.0, top_p=1.0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo",
        shuffle_dataset=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False)  # TRL's default is True; agentrl's activation_checkpointing is off
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(w["model"], padding_side="left")
    timer = StepTimer()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # agentrl/allocator.py needs only the stdlib
    from agentrl.allocator import active_allocator

    allocator = active_allocator()
    print("TRL_RESULT " + json.dumps({"step_s": timer.times, "mean_completion_tokens": lengths,
                                      "generate_s": TimedGRPOTrainer.generate_s, "allocator": allocator}), flush=True)


# ------------------------------------------------------------------------------------------ agentrl side
def run_agentrl(model_path: str, steps: int, output_dir: Path, prompts: int, group: int, max_new_tokens: int,
                dtype: str) -> dict:
    from agentrl.config import RecipeConfig
    from agentrl.train import train

    config = RecipeConfig.model_validate({
        "name": "vs_trl", "output_dir": str(output_dir), "seed": 0,
        "model": {"path": model_path, "dtype": dtype},
        "data": {"source": "arithmetic", "num_tasks": prompts * steps},
        "rollout": {"tool_configs": [], "system_prompt": SYSTEM, "group_size": group, "max_turns": 1,
                    "max_new_tokens_per_turn": max_new_tokens, "temperature": 1.0, "top_p": 1.0},
        "algorithm": {"advantage": "grpo", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0,
                      "aggregation": "token-mean"},
        "trainer": {"steps": steps, "tasks_per_step": prompts, "lr": LR, "grad_clip": 1.0, "dtype": dtype,
                    "micro_batch_tokens": 8192}})
    history = train(config)
    step_s = [h["time_step_s"] for h in history]  # wall time of the whole step, as TRL's callback takes it
    parts = {k.removeprefix("time_").removesuffix("_s"): [h[k] for h in history]
             for k in ("time_rollout_s", "time_logprobs_s", "time_update_s", "time_sync_s")}
    return {"step_s": step_s, "mean_completion_tokens": [h["response_tokens"] for h in history], "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per side; the first is a warm-up")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both sides: float32, or bf16 (TRL's bf16 flag, agentrl's engine and trainer dtype)")
    parser.add_argument("--trl-venv", default=".venv-trl")
    parser.add_argument("--trl-allocator", choices=("same", "system"), default="same",
                        help="TRL on the allocator agentrl runs on (tcmalloc where installed), or on the system's")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    from agentrl.allocator import use_tcmalloc

    allocator = use_tcmalloc()  # agentrl/allocator.py; may run this script again with tcmalloc preloaded
    import torch

    from agentrl.data import arithmetic_tasks
    from agentrl.models import provision_builtin

    python = ensure_trl_venv(Path(args.trl_venv))
    model_path = str(provision_builtin("smollm2-135m-instruct"))
    out = Path("runs/bench/vs_trl")
    out.mkdir(parents=True, exist_ok=True)
    tasks = arithmetic_tasks(args.prompts * args.steps, seed=0)  # what agentrl's data section generates
    workload = {"model": model_path, "steps": args.steps, "output_dir": str(out / "trl"), "dtype": args.dtype,
                "prompts_per_step": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
                "prompts": [t.prompt for t in tasks], "answers": [t.answer.removeprefix("#### ") for t in tasks]}
    (out / "workload.json").write_text(json.dumps(workload))

    print(machine_line(str(torch.get_num_threads()), args.dtype), flush=True)
    trl_env = dict(os.environ)
    if args.trl_allocator == "system":
        trl_env.pop("LD_PRELOAD", None)
    print(f"{args.prompts} prompts x {args.group} completions, up to {args.max_new_tokens} new tokens; "
          f"{args.steps} steps per side, the first is a warm-up", flush=True)
    ours = run_agentrl(model_path, args.steps, out / "agentrl", args.prompts, args.group, args.max_new_tokens,
                       args.dtype)
    done = subprocess.run([str(python), __file__, "--trl-worker", str(out / "workload.json")],
                          capture_output=True, text=True, env=trl_env)
    line = next((l for l in done.stdout.splitlines() if l.startswith("TRL_RESULT ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"TRL run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    theirs = json.loads(line.removeprefix("TRL_RESULT "))

    print(f"memory allocator: agentrl {allocator}, trl {theirs['allocator']}")
    rows = []
    for name, result in (("agentrl", ours), ("trl", theirs)):
        timed = result["step_s"][1:]
        rows.append((name, statistics.mean(timed), statistics.mean(result["mean_completion_tokens"][1:])))
        print(f"{name:<8} {statistics.mean(timed):6.2f} s/step (median {statistics.median(timed):.2f}, "
              f"steps {', '.join(f'{s:.1f}' for s in result['step_s'])}); "
              f"mean completion {rows[-1][2]:.1f} tokens (timed steps)")
    mean = lambda values: statistics.mean(values[1:])  # noqa: E731  warm-up step left out
    print("agentrl per step: " + ", ".join(f"{k} {mean(v):.2f} s" for k, v in ours["parts"].items()))
    if len(theirs["generate_s"]) == len(theirs["step_s"]):
        generate, total = mean(theirs["generate_s"]), mean(theirs["step_s"])
        print(f"trl per step: generate+score {generate:.2f} s, loss+backward+optimizer {total - generate:.2f} s")
    print(f"ratio trl/agentrl seconds per step: {rows[1][1] / rows[0][1]:.2f}")
    # Each side samples its own completions: a step's cost follows their length.
    per_token = (rows[1][1] / rows[1][2]) / (rows[0][1] / rows[0][2])
    print(f"ratio trl/agentrl seconds per step per completion token: {per_token:.2f}"
          + ("  (mean completion lengths differ by more than 5%)" if abs(rows[1][2] / rows[0][2] - 1) > 0.05 else ""))


if __name__ == "__main__":
    main()
