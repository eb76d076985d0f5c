"""Seconds per GRPO step: agentrl against TRL's GRPOTrainer on the same single-turn workload (CPU).

Workload, identical on both sides: SmolLM2-135M-Instruct in float32, the same generated arithmetic
prompts rendered by the same chat template, 4 prompts × 4 completions per step, at most 32 new
tokens at temperature 1, the same exact-answer reward, no KL term (beta 0), one AdamW step per batch
(lr 1e-6, grad clip 1.0), clip 0.2, token-mean loss. A step is generation + logprobs + update
(+ weight sync into the engine, for agentrl). The first step of each side is a warm-up and is not
counted.

TRL runs in its own virtual environment (.venv-trl, created on first use with a pinned trl), so its
pins never touch the project's; this script re-runs itself there with --trl-worker. agentrl runs
in this interpreter through its real driver (agentrl.train.train).

Run: python bench/vs_trl.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRL_PIN = "trl==1.16.0"
TORCH_PIN = "torch==2.13.0"
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS, LR = 4, 4, 32, 1e-6
SYSTEM = "Solve the problem and end with the final number."


def ensure_trl_venv(path: Path) -> Path:
    python = path / "bin" / "python"
    if not (path / ".installed").exists():
        print(f"creating {path} with {TRL_PIN} (first run only)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", TORCH_PIN], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", TRL_PIN], check=True)
        (path / ".installed").touch()
    return python


# ---------------------------------------------------------------------------------------------- TRL side
def trl_worker(workload_path: str) -> None:
    """Runs inside .venv-trl: imports only torch, datasets, transformers and trl."""
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

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.started = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.started)

    args = GRPOConfig(
        output_dir=w["output_dir"], use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=w["steps"], per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0, top_p=1.0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo",
        shuffle_dataset=False, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(w["model"], padding_side="left")
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    print("TRL_RESULT " + json.dumps({"step_s": timer.times, "mean_completion_tokens": lengths}), flush=True)


# ------------------------------------------------------------------------------------------ agentrl side
def run_agentrl(model_path: str, steps: int, output_dir: Path) -> dict:
    from agentrl.config import RecipeConfig
    from agentrl.train import train

    config = RecipeConfig.model_validate({
        "name": "vs_trl", "output_dir": str(output_dir), "seed": 0,
        "model": {"path": model_path, "dtype": "float32"},
        "data": {"source": "arithmetic", "num_tasks": PROMPTS_PER_STEP * steps},
        "rollout": {"tool_configs": [], "system_prompt": SYSTEM, "group_size": GROUP, "max_turns": 1,
                    "max_new_tokens_per_turn": MAX_NEW_TOKENS, "temperature": 1.0, "top_p": 1.0},
        "algorithm": {"advantage": "grpo", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0,
                      "aggregation": "token-mean"},
        "trainer": {"steps": steps, "tasks_per_step": PROMPTS_PER_STEP, "lr": LR, "grad_clip": 1.0,
                    "micro_batch_tokens": 8192}})
    history = train(config)
    step_s = [sum(h[k] for k in ("time_rollout_s", "time_logprobs_s", "time_update_s", "time_sync_s"))
              for h in history]
    return {"step_s": step_s, "mean_completion_tokens": [h["response_tokens"] for h in history]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per side; the first is a warm-up")
    parser.add_argument("--trl-venv", default=".venv-trl")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)

    import torch

    from agentrl.data import arithmetic_tasks
    from agentrl.models import provision_builtin

    python = ensure_trl_venv(Path(args.trl_venv))
    model_path = str(provision_builtin("smollm2-135m-instruct"))
    out = Path("runs/bench/vs_trl")
    out.mkdir(parents=True, exist_ok=True)
    tasks = arithmetic_tasks(PROMPTS_PER_STEP * args.steps, seed=0)  # what agentrl's data section generates
    workload = {"model": model_path, "steps": args.steps, "output_dir": str(out / "trl"),
                "prompts": [t.prompt for t in tasks], "answers": [t.answer.removeprefix("#### ") for t in tasks]}
    (out / "workload.json").write_text(json.dumps(workload))

    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
          f"{torch.get_num_threads()}; {args.steps} steps per side, first is warm-up", flush=True)
    ours = run_agentrl(model_path, args.steps, out / "agentrl")
    done = subprocess.run([str(python), __file__, "--trl-worker", str(out / "workload.json")],
                          capture_output=True, text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("TRL_RESULT ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"TRL run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    theirs = json.loads(line.removeprefix("TRL_RESULT "))

    rows = []
    for name, result in (("agentrl", ours), ("trl", theirs)):
        timed = result["step_s"][1:]
        rows.append((name, statistics.mean(timed), statistics.mean(result["mean_completion_tokens"])))
        print(f"{name:<8} {statistics.mean(timed):6.2f} s/step (median {statistics.median(timed):.2f}, "
              f"steps {', '.join(f'{s:.1f}' for s in result['step_s'])}); "
              f"mean completion {rows[-1][2]:.1f} tokens")
    print(f"ratio trl/agentrl seconds per step: {rows[1][1] / rows[0][1]:.2f}")


if __name__ == "__main__":
    main()
