"""`agentrl rollout` end to end through the real CLI, on a tiny model saved to disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_rollout_writes_jsonl_and_summary(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml", f"model.path={tiny_model_dir}",
         f"output_dir={out}", "data.num_tasks=3", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
         "rollout.tool_configs=[tool_configs/gsm8k.yaml]"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tool_configs:\n  - tool_configs/gsm8k.yaml" in done.stderr  # the effective config is printed
    assert done.stderr.count("agentrl: memory allocator ") == 1  # said once, by the process that ran
    rows = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and [r["group_id"] for r in rows] == ["arith-0-0"] * 2 + ["arith-0-1"] * 2 + ["arith-0-2"] * 2
    for row in rows:
        assert {"task_id", "group_id", "token_ids", "loss_mask", "logprobs", "messages", "reward", "finish",
                "weight_version", "metrics"} <= set(row)
        assert len(row["token_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
        assert sum(row["loss_mask"]) == 8 and row["finish"] == "length"  # 8 random tokens, no stop
        assert row["reward"] == 0.0 and row["weight_version"] == 0
    summary = json.loads((out / "rollout_summary.json").read_text())
    assert summary["episodes"] == 6 and summary["tokens_generated"] == 48
    assert "  reward_mean              0\n" in done.stdout and "tokens_per_s" in done.stdout


@pytest.mark.slow
def test_rollout_with_smollm2(tmp_path, smollm2_dir):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml", f"output_dir={out}",
         "data.num_tasks=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=24"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(0 < sum(r["loss_mask"]) <= 24 * 3 for r in rows)
    assert all(r["messages"][0]["role"] == "system" and r["messages"][2]["role"] == "assistant" for r in rows)
