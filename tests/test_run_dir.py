"""A run directory across restarts: nothing an earlier run left is deleted or taken for the new
run's, a model save interrupted halfway leaves a loadable directory, and a resumed run's
metrics.jsonl holds every step its checkpoint holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentrl.tracking import RunLogger
from agentrl.trainer.checkpoint import atomic_directory, check_replaceable
from agentrl.train import set_aside_earlier_run


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def write(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def test_a_second_restart_keeps_the_run_the_first_set_aside(tmp_path, capsys):
    """Run A finished; run B set it aside and failed at step 1; run C used to delete previous/,
    and A's final/ with it."""
    write(tmp_path, "final/model.safetensors", "checkpoints/step_3/trainer_state.pt", "metrics.jsonl", "config.yaml",
          "eval_final.json", "eval_final.jsonl", "rollout.jsonl", "view.html", "plots/reward.png", "eval_base.json")
    set_aside_earlier_run(tmp_path)  # B starts
    assert tree(tmp_path) == ["previous/checkpoints/step_3/trainer_state.pt", "previous/config.yaml",
                              "previous/eval_base.json", "previous/eval_final.json", "previous/eval_final.jsonl",
                              "previous/final/model.safetensors", "previous/metrics.jsonl",
                              "previous/plots/reward.png", "previous/rollout.jsonl", "previous/view.html"]
    write(tmp_path, "config.yaml", "metrics.jsonl")  # B fails at step 1
    capsys.readouterr()
    set_aside_earlier_run(tmp_path, resuming=True)  # C, with trainer.resume=auto: nothing to resume
    assert tree(tmp_path) == ["previous.1/checkpoints/step_3/trainer_state.pt", "previous.1/config.yaml",
                              "previous.1/eval_base.json", "previous.1/eval_final.json",
                              "previous.1/eval_final.jsonl", "previous.1/final/model.safetensors",
                              "previous.1/metrics.jsonl", "previous.1/plots/reward.png", "previous.1/rollout.jsonl",
                              "previous.1/view.html", "previous/config.yaml", "previous/metrics.jsonl"]
    assert capsys.readouterr().err == (
        f"agentrl: {tmp_path} held an earlier run (config.yaml, metrics.jsonl); moved to {tmp_path / 'previous'} "
        f"(it had no checkpoint to resume); the previous/ before it is now {tmp_path / 'previous.1'}\n")


def test_an_evaluation_made_before_any_run_stays(tmp_path):
    write(tmp_path, "eval_base.json", "eval_base.jsonl")
    set_aside_earlier_run(tmp_path)
    assert tree(tmp_path) == ["eval_base.json", "eval_base.jsonl"]


def test_a_save_interrupted_while_the_old_model_goes_leaves_the_new_one(tmp_path, monkeypatch):
    """The old directory was deleted file by file before the new one was renamed in: a SIGTERM in
    between left a final/ without config.json, which every later launch refused."""
    import agentrl.trainer.checkpoint as checkpoint

    target = tmp_path / "final"
    write(target, "config.json", "model.safetensors")
    real_rmtree = shutil.rmtree

    def interrupted(path, *args, **kwargs):
        if (Path(path) / "config.json").is_file():  # an old model: its first file goes, then the signal lands
            (Path(path) / "config.json").unlink()
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(target) as staging:
            write(staging, "config.json", "model.safetensors", "tokenizer.json")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    check_replaceable(target)  # the next launch accepts it
    with atomic_directory(target) as staging:  # and the next save clears what the interrupted one left
        write(staging, "config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_resumed_runs_metrics_hold_every_step_of_its_checkpoint(tmp_path):
    """Lines flushed but lost with the machine (the checkpoint is synced to disk, metrics.jsonl is
    not) came back from the checkpoint's history; they used to stay missing."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    history = [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}]
    with RunLogger(tmp_path, {}, 3, start_step=2, history=history, progress=False) as logger:
        logger.log(3, {"reward_mean": 0.3})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}, {"step": 3, "reward_mean": 0.3}]
