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


def test_a_save_keeps_a_users_folders_named_like_its_own_and_clears_only_its_leftovers(tmp_path, monkeypatch):
    """A save used to stage in <target>.tmp and set the old model aside in <target>.old, deleting
    whatever was there first: a user's sft.old/ of notes went with an `agentrl sft` to sft/."""
    import agentrl.trainer.checkpoint as checkpoint

    target = tmp_path / "sft"
    write(tmp_path, "sft.old/notes.txt", "sft.tmp/notes.txt", ".sft.agentrl-notes/notes.txt")
    mine = tree(tmp_path)
    for _ in range(2):  # a first save, then one replacing its model
        with atomic_directory(target) as staging:
            write(staging, "config.json")
    assert tree(tmp_path) == sorted(mine + ["sft/config.json"])

    real_replace = checkpoint.os.replace

    def killed_before_the_new_model_goes_in(source, destination):
        real_replace(source, destination)
        if Path(destination).name.startswith(".sft.agentrl-"):  # the old model is aside: the signal lands
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.os, "replace", killed_before_the_new_model_goes_in)
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(target) as staging:
            write(staging, "config.json")
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".sft.agentrl-")]
    assert len(leftovers) == 3  # the user's, the staged model and the old one set aside
    with atomic_directory(target) as staging:  # the next save clears them, and nothing of the user's
        write(staging, "config.json")
    assert tree(tmp_path) == sorted(mine + ["sft/config.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sft.agentrl-notes", "sft", "sft.old", "sft.tmp"]


def test_a_save_replaces_a_symlinked_model_directory_and_leaves_what_it_pointed_to(tmp_path):
    """final -> elsewhere/final: the save moves the link aside and puts the model in its place, as
    it always did; reserving the set-aside name with a directory made that rename fail (a directory
    cannot replace a link) after the whole model was written."""
    elsewhere = tmp_path / "disk" / "final"
    write(elsewhere.parent, "final/config.json")
    run = tmp_path / "run"
    run.mkdir()
    (run / "final").symlink_to(elsewhere)
    with atomic_directory(run / "final") as staging:
        write(staging, "config.json", "model.safetensors")
    assert not (run / "final").is_symlink() and tree(run) == ["final/config.json", "final/model.safetensors"]
    assert tree(elsewhere) == ["config.json"]  # what the link pointed to is not the save's to delete


def test_an_evaluation_before_the_first_training_run_stays_but_an_earlier_run_moves_whole(tmp_path, capsys):
    """`agentrl eval` writes its config.yaml beside its results; a first `agentrl train` in that
    directory took the config.yaml for an earlier run's and moved the evaluation to previous/."""
    write(tmp_path, "config.yaml", "eval_sft.json", "eval_sft.jsonl")
    set_aside_earlier_run(tmp_path)
    assert tree(tmp_path) == ["config.yaml", "eval_sft.json", "eval_sft.jsonl"]
    write(tmp_path, "rollout.jsonl", "rollout_summary.json")  # a rollout's results likewise
    set_aside_earlier_run(tmp_path)
    assert not (tmp_path / "previous").exists() and capsys.readouterr().err == ""

    write(tmp_path, "metrics.jsonl", "tensorboard/events")  # a training run: it moves with all of them
    set_aside_earlier_run(tmp_path)
    assert tree(tmp_path) == ["previous/config.yaml", "previous/eval_sft.json", "previous/eval_sft.jsonl",
                              "previous/metrics.jsonl", "previous/rollout.jsonl", "previous/rollout_summary.json",
                              "previous/tensorboard/events"]
    ray = tmp_path / "ray"  # a Ray run stopped before its first step: its recipe and its workers' table
    write(ray, "config.yaml", "workers.json")
    set_aside_earlier_run(ray)
    assert tree(ray) == ["previous/config.yaml", "previous/workers.json"]


def test_eval_writes_and_prints_the_recipe_it_runs(tmp_path, tiny_model_dir, capsys):
    """Eval runs one greedy episode per held-out task (eval.seed's); its config.yaml and the recipe
    it printed said rollout.temperature 1.0, group_size 8 and data.seed 0, the training recipe's."""
    import yaml

    from agentrl.recipe import load_recipe
    from agentrl.rollout.run import run_eval

    config = load_recipe("recipes/quickstart.yaml", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}",
                                                      "eval.num_tasks=2", "rollout.max_new_tokens_per_turn=2",
                                                      "model.dtype=float32"])
    assert (config.rollout.temperature, config.rollout.group_size, config.data.seed) == (1.0, 8, 0)
    run_eval(config)
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    e = config.eval
    assert (written["rollout"]["temperature"], written["rollout"]["group_size"]) == (e.temperature, 1)
    assert (written["data"]["seed"], written["data"]["num_tasks"]) == (e.seed, 2)
    printed = yaml.safe_load(capsys.readouterr().err.split("\nagentrl", 1)[0])
    assert printed["rollout"] == written["rollout"] and printed["data"] == written["data"]
