"""RunLogger: TensorBoard event files read back with TensorBoard's own reader, metrics.jsonl, resume, W&B."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agentrl.errors import ConfigError
from agentrl.tracking import RunLogger, check_wandb, tag_for

STEPS = [
    {"reward_mean": 0.25, "accuracy": 0.5, "kl_ref": 0.001, "time_rollout_s": 3.5, "finish_stop": 0.75,
     "tools/calculator/latency_s": 0.125, "loss": -0.5},
    {"reward_mean": 0.5, "accuracy": 0.625, "kl_ref": 0.002, "time_rollout_s": 3.0, "finish_stop": 1.0,
     "tools/calculator/latency_s": 0.25, "loss": -0.25},
    {"reward_mean": 0.875, "accuracy": 1.0, "kl_ref": 0.004, "time_rollout_s": 2.5, "finish_stop": 1.0,
     "tools/calculator/latency_s": 0.0625, "loss": 0.125},
]


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tags_group_flat_keys_and_keep_slashes():
    assert tag_for("reward_mean") == "reward/mean"
    assert tag_for("accuracy") == "reward/accuracy"
    assert tag_for("time_update_s") == "time/update_s"
    assert tag_for("finish_max_turns") == "finish/max_turns"
    assert tag_for("tool_call_rate") == "tools/call_rate"
    assert tag_for("approx_kl") == "kl/approx"
    assert tag_for("grad_norm") == "train/grad_norm"
    assert tag_for("tools/calculator/latency_s") == "tools/calculator/latency_s"


def test_three_steps_reach_tensorboard_and_jsonl(tmp_path, capsys):
    config = {"model": {"path": "smollm2-135m-instruct"}, "trainer": {"steps": 3}}
    with RunLogger(tmp_path, config, total_steps=3) as logger:
        for step, metrics in enumerate(STEPS, start=1):
            logger.log(step, metrics)
            # flushed per step: a crash after this line loses nothing already logged
            assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == step
    found = scalars(tmp_path)
    assert sorted(found) == ["finish/stop", "kl/ref", "reward/accuracy", "reward/mean", "time/rollout_s",
                             "tools/calculator/latency_s", "train/loss"]
    # TensorBoard stores float32: every value here is exactly representable
    assert found["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 0.875)]
    assert found["tools/calculator/latency_s"] == [(1, 0.125), (2, 0.25), (3, 0.0625)]
    assert found["train/loss"] == [(1, -0.5), (2, -0.25), (3, 0.125)]
    assert found["time/rollout_s"] == [(1, 3.5), (2, 3.0), (3, 2.5)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": step, **metrics} for step, metrics in enumerate(STEPS, start=1)]
    bar = capsys.readouterr().out
    assert "3/3" in bar and "reward=0.875" in bar and "acc=1.00" in bar and "kl_ref=0.0040" in bar
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n")) == config  # the config is stored as text beside the scalars


def test_resume_keeps_earlier_steps_once_and_a_fresh_run_starts_empty(tmp_path):
    with RunLogger(tmp_path, {}, total_steps=3, progress=False) as logger:
        for step, metrics in enumerate(STEPS, start=1):
            logger.log(step, metrics)
    # killed after step 3, resumed from a checkpoint of step 2: step 3 is logged again with new numbers
    with RunLogger(tmp_path, {}, total_steps=3, start_step=2, progress=False) as logger:
        logger.log(3, {"reward_mean": 0.0625})
    assert scalars(tmp_path)["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 0.0625)]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    with RunLogger(tmp_path, {}, total_steps=3, progress=False) as logger:
        logger.log(1, {"reward_mean": 0.75})
    assert scalars(tmp_path)["reward/mean"] == [(1, 0.75)]
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "reward_mean": 0.75}]


def test_resume_skips_a_line_the_crash_cut_short(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.25}\n{"step": 2, "reward_mean": 0.5}\n'
                                            '{"step": 3, "rew')
    with RunLogger(tmp_path, {}, total_steps=3, start_step=2, progress=False) as logger:
        logger.log(3, {"reward_mean": 0.0625})
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}, {"step": 3, "reward_mean": 0.0625}]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_wandb_is_never_imported_unless_configured(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with RunLogger(tmp_path, {}, total_steps=1, progress=False) as logger:
        logger.log(1, {"reward_mean": 1.0})
    assert "wandb" not in sys.modules


def test_wandb_configured_but_missing_fails_at_start(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail even where it is installed
    with pytest.raises(ConfigError, match=r"^wandb project 'agentrl-runs' is configured but the wandb "
                                          r"package is not installed"):
        RunLogger(tmp_path, {}, total_steps=1, wandb="agentrl-runs", progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing was started


def test_the_early_wandb_check_names_the_recipe_key_and_imports_nothing_unconfigured(monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    check_wandb(None)
    assert "wandb" not in sys.modules
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as err:
        check_wandb("agentrl-runs")
    assert str(err.value) == ("trainer.wandb_project: wandb project 'agentrl-runs' is configured but the wandb "
                              "package is not installed (pip install wandb, or leave the wandb project unset)")


def test_wandb_receives_project_config_and_grouped_scalars(tmp_path, monkeypatch):
    # The W&B service is remote and unreachable here, so a module named `wandb` stands in at the
    # import boundary and records the calls the logger makes through wandb's public API.
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "wandb.py").write_text(textwrap.dedent("""
        calls = []
        class Run:
            id = "3xq9k2ab"
            def log(self, data, step=None): calls.append(("log", data, step))
            def finish(self): calls.append(("finish",))
        def teardown(): calls.append(("teardown",))
        def init(**kwargs):
            calls.append(("init", kwargs))
            return Run()
    """))
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    run_dir = tmp_path / "grpo-1"
    with RunLogger(run_dir, {"seed": 3}, total_steps=2, wandb="agentrl-runs", progress=False) as logger:
        logger.log(1, {"reward_mean": 0.5, "tools/calculator/latency_s": 0.25, "note": "text is not a scalar"})
    calls = list(sys.modules["wandb"].calls)
    assert calls == [("init", {"project": "agentrl-runs", "name": "grpo-1", "dir": str(run_dir),
                               "config": {"seed": 3}}),
                     ("log", {"reward/mean": 0.5, "tools/calculator/latency_s": 0.25}, 1),
                     ("finish",), ("teardown",)]  # the service goes with the run (see RunLogger.close)
    # A resumed run logs into the same W&B run; a fresh one in the same directory starts its own.
    assert (run_dir / "wandb_run_id").read_text() == "3xq9k2ab\n"
    for start_step, again in ((1, {"id": "3xq9k2ab", "resume": "allow"}), (0, {})):
        with RunLogger(run_dir, {"seed": 3}, total_steps=2, wandb="agentrl-runs", progress=False,
                       start_step=start_step):
            pass
        assert sys.modules["wandb"].calls[-3] == ("init", {"project": "agentrl-runs", "name": "grpo-1",
                                                           "dir": str(run_dir), "config": {"seed": 3}, **again})
    monkeypatch.delitem(sys.modules, "wandb")  # the stand-in goes with this test
