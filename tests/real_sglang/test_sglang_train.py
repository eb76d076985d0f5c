"""`agentrl train` with engine.name=sglang: two GRPO steps through the CLI, SGLang in the process
and as a server the run launches.

SmolLM2 in float32 on both sides, so the engine's sampling logprobs equal the trainer's to float32
noise on every step; step 2 samples with the weights synced after step 1, so a lost sync would
show as a gap of the size of the update. The reward is a character-count parity of the final reply,
so groups get mixed rewards and every step moves the weights. A launched server receives the
weights as safetensors shards in a temporary directory; the run deletes it and stops the server
when it ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.real_sglang.episodes import REAL_SGLANG, SYNCS_WEIGHTS, record

pytestmark = [*REAL_SGLANG, SYNCS_WEIGHTS]

REWARD_PLUGIN = '''
def length_parity(task, messages):
    return float(len(messages[-1]["content"]) % 2 == 0)  # the last turn as sampled, cut off or not
'''


def processes_with(variable: str) -> list[int]:
    """Processes whose environment holds `variable` (NAME=value): the run's and its children's."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and variable.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # ended while we looked, or not ours to read
            pass
    return found


@pytest.mark.parametrize("mode", ["in_process", "server"])
def test_grpo_steps_through_the_cli_with_the_sglang_engine(tmp_path, mode):
    (tmp_path / "parity_reward.py").write_text(REWARD_PLUGIN)
    out = tmp_path / "run"
    run_tmp = tempfile.mkdtemp(prefix="t", dir="/tmp")  # the run's TMPDIR; short: SGLang's sockets live there
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TMPDIR": run_tmp}
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", "engine.name=sglang",
         f"engine.sglang.mode={mode}",
         "model.path=smollm2-135m-instruct", "model.dtype=float32", "trainer.dtype=float32",
         f"output_dir={out}", "reward.function=parity_reward:length_parity", "data.num_tasks=4",
         "trainer.steps=2", "trainer.tasks_per_step=2", "rollout.group_size=4", "rollout.max_turns=2",
         "rollout.max_new_tokens_per_turn=24", "trainer.lr=1e-4", "engine.sglang.max_total_tokens=8192",
         "engine.sglang.mem_fraction=0.3", "engine.sglang.update_bucket_bytes=134217728"],
        capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["weight_version"] for r in rows] == [0, 1]  # sampled with
    assert [r["synced_version"] for r in rows] == [1, 2]  # and synced after the step
    assert 0 < rows[0]["reward_mean"] < 1 and rows[0]["grad_norm"] > 0  # step 1 moved the weights
    for row in rows:
        assert row["rollout_logprob_diff"] < 1e-4, row["rollout_logprob_diff"]
    assert f"saved {out / 'final'}" in done.stdout
    assert not processes_with(f"TMPDIR={run_tmp}")  # no server or scheduler outlived the run
    assert not list(Path(run_tmp).glob("agentrl-weights-*"))  # the last sync's shards are gone
    shutil.rmtree(run_tmp)
    prefix = "train_" if mode == "in_process" else "train_server_"
    record(**{prefix + "time_sync_s": [round(r["time_sync_s"], 2) for r in rows],
              prefix + "time_rollout_s": [round(r["time_rollout_s"], 1) for r in rows],
              prefix + "rollout_logprob_diff": [r["rollout_logprob_diff"] for r in rows]})
