"""`agentrl rollout` and `eval` end to end through the real CLI, on a tiny model saved to disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.data import arithmetic_tasks
from agentrl.recipe import load_recipe
from agentrl.rollout.run import eval_name, eval_recipe, write_run_config


def test_rollout_writes_jsonl_and_summary(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml",
         f"model.path={os.path.relpath(tiny_model_dir)}",
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
    # the effective config, with the relative model path made absolute: `view` decodes from anywhere
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["model"]["path"] == str(tiny_model_dir) and config["rollout"]["group_size"] == 2
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, f"wrote {out / 'view.html'} (6 trajectories, steps 0)\n")


def offline_grader(task, messages):
    """A reward function whose grading service is down."""
    raise ConnectionError("grader at 127.0.0.1:9 refused the connection")


def test_rollout_and_eval_whose_episodes_failed_write_them_then_exit_1_naming_the_cause(tmp_path, tiny_model_dir):
    """A dead engine or grader used to give exit status 0 and an eval accuracy of 0.000, as if the
    model had scored it; now past trainer.max_failed_fraction the results are written and the
    command fails as a training step does, naming the cause."""
    for command, recipe, name in (("rollout", "recipes/rollout_cpu.yaml", "rollout.jsonl"),
                                  ("eval", "recipes/quickstart.yaml",
                                   f"eval_{eval_name(str(tiny_model_dir), str(tmp_path / 'eval'))}.jsonl")):
        out = tmp_path / command
        done = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", command, recipe, f"model.path={tiny_model_dir}", f"output_dir={out}",
             "data.num_tasks=2", "eval.num_tasks=2", "rollout.max_new_tokens_per_turn=4", "model.dtype=float32",
             "reward.function=tests.test_rollout_cli:offline_grader"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
        episodes = 2 * (4 if command == "rollout" else 1)  # rollout_cpu's group size is 4
        assert (done.returncode, done.stderr.splitlines()[-1]) == (1, (
            f"agentrl: error: {command} ({out / name}): {episodes} of {episodes} episodes failed (more than "
            f"trainer.max_failed_fraction 0.25): ConnectionError: grader at 127.0.0.1:9 refused the connection "
            f"({episodes}x)")), done.stderr[-2000:]
        assert len((out / name).read_text().splitlines()) == episodes


def interrupting_grader(task, messages):
    """Grades the first two tasks; on the third the user presses Ctrl-C (SIGINT), or
    (AGENTRL_TEST_SIGNAL) a supervisor sends the process that signal. The signal lands on the main
    thread, as a real one does; this grader, on its worker thread, never answers."""
    import signal
    import time

    if task.id.endswith("-2"):
        os.kill(os.getpid(), int(os.environ.get("AGENTRL_TEST_SIGNAL", signal.SIGINT)))
        time.sleep(60)
    return 1.0


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_an_interrupted_rollout_keeps_the_episodes_that_finished_and_no_stale_summary(tmp_path, tiny_model_dir,
                                                                                      signal_name):
    """Results used to be written only at the end: a Ctrl-C lost every finished episode, and an
    earlier run's rollout.jsonl and summary stayed beside the new config.yaml as if they were its.
    SIGTERM killed the process outright, so no clean-up ran (a launched SGLang server stayed up)."""
    import signal

    out = tmp_path / "out"
    out.mkdir()
    (out / "rollout.jsonl").write_text('{"task_id": "from an earlier run"}\n' * 5)
    (out / "rollout_summary.json").write_text("{}")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    if signal_name == "SIGTERM":
        env["AGENTRL_TEST_SIGNAL"] = str(int(signal.SIGTERM))
    # Ctrl-C as a terminal delivers it, also when this test runs where SIGINT is ignored (a job
    # started in the background by a non-interactive shell), which the child would inherit.
    with_ctrl_c = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "sys.argv[0] = 'agentrl'; runpy.run_module('agentrl.cli', run_name='__main__')")
    done = subprocess.run(
        [sys.executable, "-c", with_ctrl_c, "rollout", "recipes/rollout_cpu.yaml", f"model.path={tiny_model_dir}",
         f"output_dir={out}", "data.num_tasks=3", "rollout.group_size=1", "rollout.max_concurrent_episodes=1",
         "rollout.max_new_tokens_per_turn=4", "reward.function=tests.test_rollout_cli:interrupting_grader"],
        capture_output=True, text=True, timeout=300, env=env)
    status, last = (130, "agentrl: interrupted") if signal_name == "SIGINT" else (143, "agentrl: terminated by SIGTERM")
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stderr.splitlines()[-2:] == [
        f"agentrl: stopped early: 2 finished episode(s) of 3 kept in {out / 'rollout.jsonl'}", last]
    rows = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["reward"]) for r in rows] == [("arith-0-0", 1.0), ("arith-0-1", 1.0)]
    assert not (out / "rollout_summary.json").exists()


def test_eval_writes_its_config_beside_its_results_but_keeps_a_training_runs(tmp_path, tiny_model_dir):
    args = [sys.executable, "-m", "agentrl.cli", "eval", "recipes/quickstart.yaml", f"model.path={tiny_model_dir}",
            "eval.num_tasks=2", "rollout.max_new_tokens_per_turn=4", "model.dtype=float32"]
    done = subprocess.run(args + [f"output_dir={tmp_path / 'eval'}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "name: quickstart\n" in done.stderr  # the effective config is printed, as rollout and train print it
    assert load_recipe(tmp_path / "eval" / "config.yaml").model.path == str(tiny_model_dir)
    assert (tmp_path / "eval" / f"eval_{eval_name(str(tiny_model_dir), str(tmp_path / 'eval'))}.jsonl").is_file()
    run = tmp_path / "run"  # a training run's directory: its own config.yaml stays
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("name: trained\n")
    write_run_config(load_recipe("recipes/quickstart.yaml", [f"output_dir={run}"]))
    assert (run / "config.yaml").read_text() == "name: trained\n"


def test_eval_and_serve_print_the_effective_config_first(agentrl_in_process):
    for command in (["eval"], ["serve", "--port", "0"]):
        status, last = agentrl_in_process(*command, "recipes/rollout_cpu.yaml", "model.path=/nonexistent")
        assert status == 2 and "\nname: rollout_cpu\noutput_dir: runs/rollout_cpu\n" in agentrl_in_process.stderr
        assert last.startswith("agentrl: error: model '/nonexistent': not a local")


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


def test_a_trajectory_holding_half_a_surrogate_pair_is_still_written(tmp_path):
    """Text a plug-in built from a lone `\\ud83d` escape cannot be encoded as UTF-8: writing the
    trajectory used to raise and abort the whole rollout. The line escapes it instead, and reads
    back as the same text."""
    from agentrl.rollout.collect import write_jsonl
    from agentrl.types import Trajectory

    text = "2+2 \ud83d"
    trajectories = [Trajectory("t", "g", messages=[{"role": "tool", "content": text}]),
                    Trajectory("t2", "g", messages=[{"role": "tool", "content": "caf\u00e9"}])]
    write_jsonl(trajectories, tmp_path / "out.jsonl")
    lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert "\\ud83d" in lines[0] and json.loads(lines[0])["messages"][0]["content"] == text
    assert '"café"' in lines[1]  # other lines stay readable


def test_a_rewrite_of_trajectories_cut_short_keeps_the_file_it_was_replacing(tmp_path):
    """The rewrite in task order truncated the streamed file first: failing on the way (here a
    trajectory that cannot be written, as a full disk would) lost every finished episode."""
    from agentrl.rollout.collect import write_jsonl
    from agentrl.types import Trajectory

    out = tmp_path / "rollout.jsonl"
    write_jsonl([Trajectory("t1", "g"), Trajectory("t2", "g")], out)
    kept = out.read_text()
    unwritable = Trajectory("t3", "g", messages=[{"role": "tool", "content": object()}])
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_jsonl([Trajectory("t1", "g"), unwritable], out)
    assert out.read_text() == kept and [json.loads(line)["task_id"] for line in kept.splitlines()] == ["t1", "t2"]
    assert [p.name for p in tmp_path.iterdir()] == ["rollout.jsonl"]  # no half-written staging file left


def test_a_context_longer_than_the_models_positions_is_refused_when_the_engine_is_built(tiny_model_dir):
    """Past its positions the engine refuses each request (hf_engine.py): every long episode would fail."""
    from agentrl.errors import ConfigError
    from agentrl.rollout.run import build_engine

    config = load_recipe("recipes/rollout_cpu.yaml", [f"model.path={tiny_model_dir}", "rollout.max_context_tokens=4096"])
    with pytest.raises(ConfigError) as err:
        build_engine(config, 2)
    assert str(err.value) == (f"rollout.max_context_tokens (4096) is more than the 2048 positions of model.path "
                              f"'{tiny_model_dir}'; set it to 2048 or less")
    config = load_recipe("recipes/rollout_cpu.yaml", [f"model.path={tiny_model_dir}", "rollout.max_context_tokens=2048"])
    assert build_engine(config, 2).model.config.max_position_embeddings == 2048


def test_a_rollout_that_cannot_build_its_engine_stops_the_tool_servers_it_started(tmp_path, tiny_model_dir):
    """The tools load first (cheap checks), their servers start with them; an engine that then
    fails to build used to leave them running until the process exited."""
    import uuid

    from agentrl.errors import ConfigError
    from agentrl.rollout.run import build_runner
    from tests.test_mcp_tool import mcp_file, server_stopped

    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    config = load_recipe("recipes/rollout_cpu.yaml", [f"model.path={tiny_model_dir}", "rollout.max_context_tokens=4096",
                                                      f"rollout.tool_configs=[{mcp_file(tmp_path, ['multiply'], marker)}]"])
    with pytest.raises(ConfigError, match="rollout.max_context_tokens"):
        build_runner(config)
    assert server_stopped(marker)


def test_each_evaluated_model_has_files_of_its_own(tmp_path, monkeypatch):
    """The last directory's name alone sent runs/a/final and runs/b/final to one eval_final.jsonl."""
    monkeypatch.chdir(tmp_path)
    out = "runs/quickstart"
    assert [eval_name(path, out) for path in ["runs/quickstart/final", "runs/quickstart/previous/final",
                                              "runs/a/final", "runs/b/final", "./runs/quickstart",
                                              "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M"]] == [
        "final", "previous_final", "runs_a_final", "runs_b_final", "quickstart", "smollm2-135m-instruct",
        "HuggingFaceTB_SmolLM2-135M"]
    assert eval_name("/models/x", out) == "models_x"


@pytest.mark.parametrize("overrides, message", [
    (["data.seed=10000"], "eval.seed 10000 equals data.seed, so the held-out arithmetic tasks would be the training "
                          "tasks: give eval.seed a seed of its own"),
    (["sft.seed=7", "eval.seed=7", "sft.min_digits=3", "sft.max_digits=4"],
     "eval.seed 7 equals sft.seed with the same digits, so the held-out arithmetic tasks would be the warm-up's "
     "demonstrations: give eval.seed a seed of its own"),
])
def test_eval_on_the_training_tasks_stops_before_the_model_loads(tmp_path, agentrl_in_process, overrides, message):
    assert arithmetic_tasks(8, 10_000)[:3] == arithmetic_tasks(32, 10_000)[:3]  # one seed: one stream of tasks
    assert agentrl_in_process("eval", "recipes/quickstart.yaml", *overrides, f"model.path={tmp_path}/no-model",
                              f"output_dir={tmp_path}/out") == (2, f"agentrl: error: {message}")


def test_eval_on_a_training_file_stops_before_the_model_loads(tmp_path, agentrl_in_process, monkeypatch):
    """Held-out files were taken as given: eval.files naming a data.files file (here spelled
    another way) measured accuracy on the training tasks."""
    monkeypatch.chdir(tmp_path)
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text('{"question": "What is 2 + 1?", "answer": "#### 3"}\n')
    recipe = Path(__file__).parents[1] / "recipes/quickstart.yaml"
    common = [f"model.path={tmp_path}/no-model", f"output_dir={tmp_path}/out", "data.source=files",
              f"data.files=[{tmp_path}/train.jsonl]"]
    assert agentrl_in_process("eval", str(recipe), *common, "eval.files=[test.jsonl, ./train.jsonl]") == (
        2, "agentrl: error: eval.files: './train.jsonl' is also in data.files, so the held-out tasks would be "
           "training tasks: evaluate on a file of its own")
    config = load_recipe(str(recipe), [*common, "eval.files=[test.jsonl]"])
    assert eval_recipe(config).data.files == ["test.jsonl"]


def test_eval_of_other_seeds_or_digits_holds_other_tasks():
    config = load_recipe("recipes/quickstart.yaml", ["sft.seed=7", "eval.seed=7"])  # sft digits 2-3, data's 3-4
    held_out = arithmetic_tasks(config.eval.num_tasks, 7, config.data.arithmetic.min_digits,
                                config.data.arithmetic.max_digits)
    demonstrations = arithmetic_tasks(config.sft.num_examples, 7, config.sft.min_digits, config.sft.max_digits)
    assert not {t.prompt for t in held_out} & {t.prompt for t in demonstrations}
    assert eval_recipe(config).data.seed == 7


@pytest.mark.parametrize("override, message", [
    ("reward.function=null", "reward.function: null, so eval has nothing to score: its accuracy is the mean "
                             "outcome reward"),
    ("data.answer_key=null", "data.answer_key: null, so eval has nothing to score: reward.function (gsm8k_reward) "
                             "compares each answer with the task's"),
])
def test_eval_with_nothing_to_score_stops_before_the_model_loads(tmp_path, agentrl_in_process, override, message):
    tasks = tmp_path / "held_out.jsonl"
    tasks.write_text('{"question": "What is 2 + 1?", "answer": "#### 3"}\n')
    assert agentrl_in_process("eval", "recipes/quickstart.yaml", override, "data.source=files",
                              f"data.files=[{tasks}]", f"eval.files=[{tasks}]", f"model.path={tmp_path}/no-model",
                              f"output_dir={tmp_path}/out") == (2, f"agentrl: error: {message}")
