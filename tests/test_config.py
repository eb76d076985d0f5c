"""Recipe loading: strict keys, dotted overrides, one-line errors before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl.recipe import load_recipe
from agentrl.errors import ConfigError


def test_recipe_and_overrides():
    config = load_recipe("recipes/rollout_cpu.yaml", ["rollout.group_size=8", "rollout.temperature=0.5",
                                                      "data.files=[a.jsonl, b.jsonl]", "model.chat_template=hermes"])
    assert config.rollout.group_size == 8 and config.rollout.temperature == 0.5
    assert config.data.files == ["a.jsonl", "b.jsonl"] and config.model.chat_template == "hermes"
    assert config.rollout.tool_configs == ["tool_configs/calculator.yaml"]
    assert config.output_dir == "runs/rollout_cpu"


@pytest.mark.parametrize("override,message", [
    ("rollout.bogus_key=1", "unknown key 'rollout.bogus_key'"),
    ("trainer.bogus_key=1", "unknown key 'trainer.bogus_key'"),
    ("rollout.group_size=zero", "rollout.group_size: Input should be a valid integer"),
    ("rollout.top_p=1.5", "rollout.top_p: Input should be less than or equal to 1"),
    ("rollout.group_size", "override 'rollout.group_size': expected key=value"),
    ("model.path.x=1", "'model.path' is not a section"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/rollout_cpu.yaml", [override])
    assert message in str(err.value)


def test_cli_rejects_bad_key_before_loading_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml",
                           "rollout.max_turn=3", "model.path=/nonexistent"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "agentrl: error: recipes/rollout_cpu.yaml: unknown key 'rollout.max_turn'"


def test_cli_rejects_bad_tool_file_before_loading_the_model(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text("tools:\n  - class: calculator\n    schema: 3\n")
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml",
                           f"rollout.tool_configs=[{bad}]", "model.path=/nonexistent"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"agentrl: error: {bad}: tool #1 (class 'calculator'): schema must be a mapping with type: function")


def test_readme_recipe_reference_matches_schema():
    from pathlib import Path

    from agentrl.recipe import reference_markdown

    readme = Path("README.md").read_text()
    block = readme.split("<!-- recipe-reference:start -->\n")[1].split("\n<!-- recipe-reference:end -->")[0]
    assert block == reference_markdown(), "README recipe reference is stale: run python -m agentrl.recipe"


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_training_commands_reject_a_bad_key_before_any_model_code(command):
    probe = ("import sys; from agentrl.cli import main; rc = main(sys.argv[1:]); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", probe, command, "recipes/quickstart.yaml", "trainer.bogus_key=1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "agentrl: error: recipes/quickstart.yaml: unknown key 'trainer.bogus_key'"]
    assert done.stdout.strip() == "[]"  # neither torch nor transformers was even imported


@pytest.mark.parametrize("recipe", sorted(str(p) for p in __import__("pathlib").Path("recipes").glob("*.yaml")))
def test_every_shipped_recipe_and_its_tool_files_load(recipe):
    from agentrl.env.interaction import load_interaction
    from agentrl.tools.loader import load_tool_files

    config = load_recipe(recipe)
    tools = load_tool_files(config.rollout.tool_configs)
    assert tools or not config.rollout.tool_configs
    if config.rollout.interaction_config:
        load_interaction(config.rollout.interaction_config)


def test_gsm8k_recipe_header_overrides_make_a_cpu_run():
    header = [line.lstrip("#").strip().rstrip("\\").strip()
              for line in open("recipes/gsm8k_tool.yaml") if line.startswith("#")]
    start = next(i for i, line in enumerate(header) if line.startswith("agentrl train") and "model.path" in line)
    words = " ".join(header[start:start + 4]).split()
    config = load_recipe(words[2], words[3:])
    assert config.model.path == "smollm2-135m-instruct" and config.engine.device == config.trainer.device == "cpu"
    assert config.engine.name == "hf" and load_recipe("recipes/gsm8k_tool.yaml").engine.name == "sglang"
    assert config.data.files == ["../shared/data/gsm8k/train.jsonl"] and config.trainer.steps == 2
    assert config.trainer.micro_batch_tokens == 2048  # two ranks and a reference fit in 24 GB


@pytest.mark.parametrize("overrides,message", [
    (["rollout.group_size=1"], "algorithm.advantage 'grpo' compares the episodes of a task with each other: "
                               "rollout.group_size must be at least 2 (got 1)"),
    (["rollout.group_size=1", "algorithm.advantage=rloo"], "algorithm.advantage 'rloo' compares"),
    (["rollout.group_size=1", "trainer.tasks_per_step=1", "algorithm.advantage=reinforce_pp"],
     "algorithm.advantage 'reinforce_pp' compares"),
    (["trainer.mini_batches=64"], "trainer.mini_batches (64) is more than the episodes of a step "
                                  "(rollout.group_size × trainer.tasks_per_step = 32)"),
    (["algorithm.kl_in_reward=true"], "algorithm.kl_in_reward needs algorithm.kl_coef > 0"),
])
def test_train_rejects_groups_it_cannot_learn_from_when_the_recipe_loads(overrides, message):
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", *overrides],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()  # one line, before any model code ran
    assert line.startswith(f"agentrl: error: recipes/quickstart.yaml: {message}"), line


def test_gae_and_rollouts_accept_single_episode_groups():
    load_recipe("recipes/quickstart.yaml", ["rollout.group_size=1", "algorithm.advantage=gae"], for_training=True)
    load_recipe("recipes/rollout_cpu.yaml", ["rollout.group_size=1"])  # rollout and eval do not learn


@pytest.mark.parametrize("command,key", [("train", "data.files"), ("eval", "eval.files")])
def test_an_empty_task_pool_is_a_config_error(tmp_path, command, key):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    pool = "data.files" if command == "train" else "eval.files"
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", command, "recipes/quickstart.yaml",
                           "data.source=files", f"{pool}=[{empty}]", "model.path=smollm2-135m-instruct"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == f"agentrl: error: {key}: no tasks: ['{empty}'] has no rows"
