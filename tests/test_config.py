"""Recipe loading: strict keys, dotted overrides, one-line errors before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl.recipe import load_recipe
from agentrl.errors import ConfigError


def test_recipe_and_overrides():
    config = load_recipe("recipes/rollout_cpu.yaml", ["rollout.group_size=8", "rollout.temperature=0.5",
                                                      "data.source=files", "data.files=[a.jsonl, b.jsonl]",
                                                      "model.chat_template=hermes"])
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
    ("trainer.lr=inf", "trainer.lr: Input should be a finite number (got 'inf')"),  # fields without bounds too
    ("algorithm.kl_coef=nan", "algorithm.kl_coef: Input should be a finite number (got 'nan')"),
    # torch and random take 64-bit seeds: this one used to fail after the model loaded, with a traceback
    ("engine.seed=18446744073709551616", "engine.seed: Input should be less than 9223372036854775808"),
    ("sft.seed=-1", "sft.seed: Input should be greater than or equal to 0"),
    # pydantic named its union branch: 'model.lora.target_modules.list[str].0: Input should be a valid string'
    ("model.lora.target_modules=[1,2]", "model.lora.target_modules: expected a non-empty list of module names or "
                                        "one name such as 'all-linear' (got [1, 2])"),
    ("model.lora.target_modules=[]", "model.lora.target_modules: expected a non-empty list"),
    ("model.lora.target_modules=''", "model.lora.target_modules: expected a non-empty list"),
    # SGLang seeds NumPy (below 2**32): its scheduler failed at start, after the engine began loading
    ("engine.name=sglang engine.seed=4294967296", "engine.seed 4294967296 is too large for SGLang"),
    ("engine.name=sglang engine.seed=4294967295 trainer.engine_replicas=2", "engine.seed + trainer.engine_replicas - 1 "
                                                                           "must be below 2**32"),
    # a lower bound 1 - clip_low of 0 or less clips no ratio: the clip was silently off
    ("algorithm.clip_low=1", "algorithm.clip_low: Input should be less than 1"),
    ("data.arithmetic.max_digits=200", "data.arithmetic.max_digits: Input should be less than or equal to 49"),
    ("name=..", "name '..' names the output directory runs/<name> (output_dir unset), so it must be one directory "
                "name (no '/' or NUL byte, not empty, '.' or '..')"),
    ("name=/tmp", "name '/tmp' names the output directory runs/<name>"),
    ("name=''", "name '' names the output directory runs/<name>"),
    # the files were ignored and generated tasks ran instead
    ("data.files=[t.jsonl]", "data.files lists files, but data.source is 'arithmetic', which does not read them: "
                             "set data.source: files"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/rollout_cpu.yaml", override.split(" "))
    assert message in str(err.value)


def test_cli_rejects_bad_key_before_loading_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml",
                           "rollout.max_turn=3", "model.path=/nonexistent"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "agentrl: error: override 'rollout.max_turn=3': unknown key 'rollout.max_turn'"


def test_cli_rejects_bad_tool_file_before_loading_the_model(tmp_path, agentrl_in_process):
    bad = tmp_path / "t.yaml"
    bad.write_text("tools:\n  - class: calculator\n    schema: 3\n")
    assert agentrl_in_process("rollout", "recipes/rollout_cpu.yaml", f"rollout.tool_configs=[{bad}]",
                              "model.path=/nonexistent", f"output_dir={tmp_path / 'out'}") == (
        2, f"agentrl: error: {bad}: tool #1 (class 'calculator'): schema must be a mapping with type: function")


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
        "agentrl: error: override 'trainer.bogus_key=1': unknown key 'trainer.bogus_key'"]
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
    (["reward.function=null"], "reward.function: null, and reward.tool_step_rewards, tool_final_rewards and "
                               "interaction_scores are false: every reward would be 0 and nothing is learnt"),
    (["data.source=files", "data.files=[tasks.jsonl]", "data.answer_key=null"],
     "data.answer_key: null, so reward.function (gsm8k_reward) has no answer to compare with"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1"],
     "algorithm.kl_estimator 'k1' as a loss term (algorithm.kl_in_reward false) has a gradient of zero in expectation"),
    (["trainer.resume=auto"], "trainer.resume 'auto' continues from the newest checkpoint, and trainer.save_every 0 "
                              "writes none in 10 steps: a relaunch would start over; set trainer.save_every "
                              "between 1 and trainer.steps"),
    (["trainer.resume=auto", "trainer.save_every=20"], "trainer.resume 'auto' continues from the newest checkpoint, "
                                                       "and trainer.save_every 20 writes none in 10 steps"),
])
def test_train_rejects_groups_it_cannot_learn_from_when_the_recipe_loads(overrides, message):
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", *overrides],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()  # one line, before any model code ran
    # the override is named: each message names the key the last override set
    assert line.startswith(f"agentrl: error: override '{overrides[-1]}': {message}"), line


TOP_P_WARNING = ("agentrl: warning: rollout.top_p 0.9 samples from the nucleus only, but the update's importance "
                 "ratio and KL use the whole distribution's logprobs: a biased gradient (top_p 1 is unbiased)")
GREEDY_WARNING = ("agentrl: warning: rollout.temperature 0 samples every episode of a task alike: algorithm.advantage "
                  "'rloo' compares them with each other, so every advantage is 0 and nothing is learnt")


@pytest.mark.parametrize("overrides,warnings", [
    (["rollout.top_p=0.9"], [TOP_P_WARNING]),
    # greedy sampling ignores top_p
    (["rollout.temperature=0", "rollout.top_p=0.9", "algorithm.advantage=rloo"], [GREEDY_WARNING]),
    (["rollout.temperature=0", "algorithm.advantage=gae"], []),  # a critic's baseline still tells episodes apart
    (["reward.interaction_scores=true"], ["agentrl: warning: reward.interaction_scores is true but "
                                          "rollout.interaction_config names no interaction: no score is added"]),
    (["model.lora.rank=8", "model.lora.dropout=0.1", "trainer.mini_batches=2"], [
        "agentrl: warning: model.lora.dropout 0.1 with trainer.ppo_epochs 1 and trainer.mini_batches 2: the importance "
        "ratio compares logprobs with dropout against logprobs without it, so it is not 1 at unchanged weights and "
        "the clip acts on noise (model.lora.dropout 0 keeps the ratio exact)"]),
    (["model.lora.rank=8", "model.lora.dropout=0.1"], []),  # one pass: the ratio's two sides are the same pass
    (["trainer.placement=split", "trainer.cpus_per_worker=4"], [
        "agentrl: warning: trainer.placement 'split' and trainer.cpus_per_worker 4 place Ray workers, but "
        "trainer.backend 'local' runs every role in this process: they have no effect"]),
    (["trainer.backend=ray", "trainer.placement=split", "trainer.cpus_per_worker=4"], []),
    ([], []),
])
def test_settings_that_train_but_not_as_meant_are_warned_of(overrides, warnings):
    from agentrl.recipe import training_warnings

    config = load_recipe("recipes/quickstart.yaml", overrides, for_training=True)
    assert [f"agentrl: warning: {line}" for line in training_warnings(config)] == warnings


def test_train_prints_its_warnings_before_any_model_loads():
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", "rollout.top_p=0.9",
                           "model.path=/nonexistent/model"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "/nonexistent/model" in done.stderr.splitlines()[-1]
    assert [line for line in done.stderr.splitlines() if line.startswith("agentrl: warning:")] == [TOP_P_WARNING]


def test_gae_and_rollouts_accept_single_episode_groups():
    load_recipe("recipes/quickstart.yaml", ["rollout.group_size=1", "algorithm.advantage=gae"], for_training=True)
    load_recipe("recipes/rollout_cpu.yaml", ["rollout.group_size=1"])  # rollout and eval do not learn


@pytest.mark.parametrize("command,key", [("train", "data.files"), ("eval", "eval.files")])
def test_an_empty_task_pool_is_a_config_error(tmp_path, agentrl_in_process, command, key):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert agentrl_in_process(command, "recipes/quickstart.yaml", "data.source=files", f"{key}=[{empty}]",
                              "model.path=smollm2-135m-instruct", f"output_dir={tmp_path / 'out'}") == (
        2, f"agentrl: error: {key}: no tasks: ['{empty}'] has no rows")


def test_an_override_value_that_is_not_yaml_names_the_override():
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", ["data.files=[x"])
    assert str(err.value) == (
        "override 'data.files=[x': the value is not valid YAML (while parsing a flow sequence in \"<unicode string>\", "
        "line 1, column 1: [x ^ expected ',' or ']', but got '<stream end>' in \"<unicode string>\", line 1, "
        "column 3: [x ^)")


@pytest.mark.parametrize("text", ["Reply in C# or F# #1 priority", "#1 rule: use tools", "[x", "yes", "1:00", " 3"])
def test_text_overrides_are_taken_verbatim(text):
    config = load_recipe("recipes/quickstart.yaml", [f"rollout.system_prompt={text}", f"name={text}"])
    assert config.rollout.system_prompt == text and config.name == text


def test_overrides_keep_null_lists_and_booleans_where_the_field_takes_them():
    config = load_recipe("recipes/quickstart.yaml", [
        "rollout.system_prompt=null", "model.chat_template=~", "algorithm.dual_clip=", "trainer.steps=12",
        "trainer.lr=1e-5", "trainer.resume=true", "algorithm.kl_in_reward=false", "engine.sglang.extra_args={a: 1}"])
    assert (config.rollout.system_prompt, config.model.chat_template, config.algorithm.dual_clip) == (None, None, None)
    assert (config.trainer.steps, config.trainer.lr, config.trainer.resume) == (12, 1e-5, "auto")
    assert config.algorithm.kl_in_reward is False and config.engine.sglang.extra_args == {"a": 1}


@pytest.mark.parametrize("override,message", [
    ("trainer.steps=1:00", "trainer.steps: Input should be a valid integer, unable to parse string as an integer "
                           "(got '1:00')"),
    ("trainer.steps=0x10", "trainer.steps: Input should be a valid integer, unable to parse string as an integer "
                           "(got '0x10')"),
    ("trainer.steps=true", "trainer.steps: Input should be a valid integer, unable to parse string as an integer "
                           "(got 'true')"),
    ("trainer.lr=yes", "trainer.lr: Input should be a valid number, unable to parse string as a number (got 'yes')"),
])
def test_number_overrides_are_plain_decimal_text(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", [override])
    assert str(err.value) == f"override '{override}': {message}"


def test_an_override_that_yaml_reads_as_a_comment_is_refused():
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", ["data.files=#1"])
    assert str(err.value) == ("override 'data.files=#1': the value reads as null in YAML (' #' starts a comment); "
                              "write null for null")


def recipe_error(tmp_path, text: str | bytes) -> str:
    recipe = tmp_path / "r.yaml"
    (recipe.write_bytes if isinstance(text, bytes) else recipe.write_text)(text)
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe)
    return str(err.value).removeprefix(f"{recipe}: ")


@pytest.mark.parametrize("text,message", [
    ("name: a\ntrainer:\n  steps: 3\ntrainer:\n  lr: 0.1\n", "key 'trainer' appears twice (lines 2 and 4)"),
    ("trainer:\n  steps: 3\n  steps: 5\n", "key 'steps' appears twice (lines 2 and 3)"),
    ("trainer: {steps: 3, lr: 0.1, steps: 4}\n", "key 'steps' appears twice (lines 1 and 1)"),
    ("", "empty recipe (it sets no key; an empty file would run every default)"),
    ("# only a comment\n", "empty recipe (it sets no key; an empty file would run every default)"),
    (b"name: \xff\xfe\n", "not UTF-8 text (byte 0xff at offset 6)"),
    ("trainer: {steps: true}\n", "trainer.steps: expected a number, not a boolean (got True)"),
    ("trainer: {lr: yes}\n", "trainer.lr: expected a number, not a boolean (got True)"),
    # YAML 1.1 read these as 8 and 90 without a word; an override of the same text reads decimal
    ("trainer: {steps: 010}\n", "not valid YAML ('010' reads as 8 in YAML 1.1 (a leading 0 makes it octal); write "
                                "the number as it is meant, or quote it if it is text in \"<unicode string>\", line 1, "
                                "column 18: trainer: {steps: 010} ^)"),
    ("name: a\nseed: 1:30\n", "not valid YAML ('1:30' reads as 90 in YAML 1.1 (base 60); write the number as it is "
                              "meant, or quote it if it is text in \"<unicode string>\", line 2, column 7: seed: 1:30 ^)"),
    ("trainer:\n  lr: 1:30.5\n", "not valid YAML ('1:30.5' reads as 90.5 in YAML 1.1 (base 60); write the number as "
                                 "it is meant, or quote it if it is text in \"<unicode string>\", line 2, column 7: "
                                 "lr: 1:30.5 ^)"),
    # a section that is no mapping: an override of the section replaced it unseen, or was blamed for it
    ("name: a\ntrainer: steps=3\n", "trainer: a section, so a mapping of its keys (got 'steps=3')"),
    ("name: a\nmodel:\n  lora: 8\n", "model.lora: a section, so a mapping of its keys (got 8)"),
])
def test_recipe_files_that_would_load_something_else_than_written(tmp_path, text, message):
    assert recipe_error(tmp_path, text) == message


def test_numbers_yaml_reads_as_written_still_load(tmp_path):
    """Only the octal and base-60 readings are refused: a 0 alone, a leading 0 that reads the same
    either way, hexadecimal, underscores and quoted text stay what they were."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: '010'\nseed: 007\ntrainer: {steps: 0x0a, save_every: 0, tasks_per_step: 1_000}\n")
    config = load_recipe(recipe)
    assert (config.name, config.seed, config.trainer.steps, config.trainer.save_every,
            config.trainer.tasks_per_step) == ("010", 7, 10, 0, 1000)


def test_a_section_that_is_no_mapping_is_the_files_error_whatever_the_overrides(tmp_path):
    """`trainer: steps=3` with `trainer={lr: 0.1}` ran 10 steps at lr 0.1, the file's value dropped
    without a word; with `trainer.steps=3` the override was blamed: "'trainer' is not a section"."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: a\ntrainer: 5\n")
    for overrides in (["trainer={lr: 0.1}"], ["trainer.steps=3"]):
        with pytest.raises(ConfigError) as err:
            load_recipe(recipe, overrides)
        assert str(err.value) == f"{recipe}: trainer: a section, so a mapping of its keys (got 5)"


@pytest.mark.parametrize("override", ["data.files.0=x", "eval.files.x=1", "trainer.resume.x=1",
                                      "model.lora.target_modules.x=1"])
def test_a_dotted_override_below_a_field_that_holds_no_keys_names_the_override(override):
    """Below an absent list or text field a dotted key made a mapping, and the error blamed the
    recipe file ('recipes/quickstart.yaml: data.files: Input should be a valid list')."""
    field = override.rsplit(".", 1)[0]
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", [override])
    assert str(err.value) == f"override '{override}': '{field}' is not a section"
    assert load_recipe("recipes/quickstart.yaml", ["engine.sglang.extra_args.context_length=4096"]) \
        .engine.sglang.extra_args == {"context_length": 4096}  # a mapping field takes keys below it


def test_a_fields_own_check_on_a_mapping_value_still_names_the_field(tmp_path):
    """A check whose input is a mapping was taken for a whole section's, and the key was dropped."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: a\nmodel: {lora: {target_modules: {q_proj: true}}}\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe)
    assert str(err.value).startswith(f"{recipe}: model.lora.target_modules: expected a non-empty list")


def test_exponents_without_a_dot_are_numbers_in_recipe_files_and_overrides(tmp_path):
    """YAML 1.1 reads `8e-1` as text: in engine.sglang.extra_args, which no schema converts, SGLang
    was handed the string '8e-1'."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: a\nengine:\n  sglang:\n    extra_args: {mem_fraction_static: 8e-1, x: '1e-3'}\n"
                      "trainer: {lr: 3e-6}\n")
    config = load_recipe(recipe, ["engine.sglang.extra_args.context_length=1e4", "engine.sglang.extra_args.y=-2E-1"])
    assert config.engine.sglang.extra_args == {"mem_fraction_static": 0.8, "x": "1e-3", "context_length": 10000.0,
                                               "y": -0.2}
    assert config.trainer.lr == 3e-6


def test_a_recipe_that_cannot_be_read_is_named(tmp_path):
    """read_text's OSError ended the command in a traceback (no permission; a device refusing reads)."""
    with pytest.raises(ConfigError) as err:
        load_recipe("/proc/self/mem")
    assert str(err.value) == "/proc/self/mem: cannot be read (Input/output error)"


def test_merge_keys_may_override_what_they_merge(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  <<: {steps: 3, lr: 0.1}\n  steps: 5\n")
    config = load_recipe(recipe)
    assert (config.trainer.steps, config.trainer.lr) == (5, 0.1)


@pytest.mark.parametrize("overrides,message", [
    # a section's check names its keys: the last override setting one of them is named (it was
    # '<defaults>', the recipe, for a value the recipe never wrote)
    (["trainer.bf16_autocast=maybe"], "override 'trainer.bf16_autocast=maybe': trainer.bf16_autocast: expected "
                                      "true or false (got 'maybe'); trainer.dtype replaces it"),
    (["sft.bf16_autocast=null"], "override 'sft.bf16_autocast=null': sft.bf16_autocast: expected true or false "
                                 "(got None); sft.dtype replaces it"),
    (["trainer.bf16_autocast=true", "trainer.dtype=float32"],
     "override 'trainer.dtype=float32': trainer.bf16_autocast and trainer.dtype are both set; keep only dtype"),
    (["data.arithmetic.min_digits=5"], "override 'data.arithmetic.min_digits=5': data.arithmetic.min_digits (5) is "
                                       "larger than data.arithmetic.max_digits (4)"),
    (["data.arithmetic.max_digits=2", "data.arithmetic.min_digits=3", "trainer.steps=3"],
     "override 'data.arithmetic.min_digits=3': data.arithmetic.min_digits (3) is larger than "
     "data.arithmetic.max_digits (2)"),
    # the maximum's override is named too: the recipe's own digits were blamed
    (["data.arithmetic.max_digits=2"], "override 'data.arithmetic.max_digits=2': data.arithmetic.min_digits (3) is "
                                       "larger than data.arithmetic.max_digits (2)"),
    (["sft.max_digits=1"], "override 'sft.max_digits=1': sft.min_digits (2) is larger than sft.max_digits (1)"),
    # a field's own check: the override that set it is named
    (["engine.device=gpu"], "override 'engine.device=gpu': engine.device: expected 'cpu', 'cuda' or 'cuda:N' "
                            "(got 'gpu')"),
    (["trainer.device=cuda:x"], "override 'trainer.device=cuda:x': trainer.device: expected 'cpu', 'cuda' or "
                                "'cuda:N' (got 'cuda:x')"),
    # torch refuses these when the run first uses the device, after the recipe was accepted
    (["trainer.device=cuda:01"], "override 'trainer.device=cuda:01': trainer.device: expected 'cpu', 'cuda' or "
                                 "'cuda:N' (got 'cuda:01')"),
    (["engine.device=cuda:\u0661"], "override 'engine.device=cuda:\u0661': engine.device: expected 'cpu', 'cuda' "
                                    "or 'cuda:N' (got 'cuda:\u0661')"),
])
def test_section_checks_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_recipe(None, overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("available,count,device,seen", [
    (False, 0, "cuda", "no CUDA device"), (True, 2, "cuda:2", "only 2 CUDA devices"),
    (True, 1, "cuda:1", "only 1 CUDA device")])
def test_a_cuda_device_that_is_not_there_is_a_config_error(monkeypatch, available, count, device, seen):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ConfigError) as err:
        load_recipe(None, [f"trainer.device={device}"], devices=("engine.device", "trainer.device"))
    assert str(err.value) == (f"override 'trainer.device={device}': trainer.device: '{device}' is not available "
                              f"(torch {torch.__version__} sees {seen})")
    load_recipe(None, [f"trainer.device={device}"], devices=("engine.device",))  # a device the command does not use
    if available:
        load_recipe(None, ["engine.device=cuda:0"], devices=("engine.device",))


def test_cli_checks_the_cuda_device_before_loading_anything():
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml",
                           "engine.device=cuda:99", "model.path=/nonexistent"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("agentrl: error: override 'engine.device=cuda:99': engine.device: 'cuda:99' is not "
                           "available (torch "), line


def test_a_broken_chat_template_stops_at_load(tmp_path, tiny_model_dir):
    from agentrl.models import load_tokenizer

    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}\n{{ m.content }{% endfor %}")
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(tiny_model_dir), str(template))
    assert str(err.value) == f"model.chat_template: {template}: line 2: not valid Jinja (unexpected '}}')"
    template.write_text("{% for m in messages %}{{ m.content }}{% generation %}x{% endgeneration %}{% endfor %}")
    assert load_tokenizer(str(tiny_model_dir), str(template)).chat_template == template.read_text()


def test_tools_serve_refuses_a_port_out_of_range(capsys):
    from agentrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["tools", "serve", "tool_configs/calculator.yaml", "--token", "t", "--port", "70000"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "agentrl tools serve: error: argument --port: '70000' is not a port number (0-65535; 0 picks a free one)")


@pytest.mark.parametrize("override,value", [
    ('rollout.system_prompt="Be brief."', "Be brief."), ("rollout.system_prompt='it''s # one'", "it's # one"),
    ('rollout.system_prompt="yes"', "yes"), ('rollout.system_prompt=""', ""),
    ('rollout.system_prompt="a" or "b"', '"a" or "b"'),  # quotes inside text are no YAML scalar: verbatim
])
def test_a_quoted_text_override_is_its_yaml_scalar(override, value):
    config = load_recipe("recipes/quickstart.yaml", [override, 'data.source=files', 'data.files=["a b.jsonl"]',
                                                     'trainer.steps="5"'])
    assert (config.rollout.system_prompt, config.data.files, config.trainer.steps) == (value, ["a b.jsonl"], 5)


def test_a_key_repeated_inside_an_override_value_is_an_error():
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", ["data.arithmetic={min_digits: 1, min_digits: 4}"])
    assert str(err.value) == ("override 'data.arithmetic={min_digits: 1, min_digits: 4}': key 'min_digits' "
                              "appears twice in the value")


def test_a_key_set_again_by_a_later_override_takes_the_later_value():
    """Scripts append to a base list of overrides; the last word is the one that counts."""
    config = load_recipe("recipes/quickstart.yaml", ["trainer.steps=1", "trainer.steps=5", "rollout={group_size: 2}",
                                                     "rollout.group_size=3", "data.arithmetic.min_digits=1",
                                                     "data={arithmetic: {max_digits: 2}}"])
    assert (config.trainer.steps, config.rollout.group_size) == (5, 3)
    assert (config.data.arithmetic.min_digits, config.data.arithmetic.max_digits) == (1, 2)


def test_a_mapping_override_is_merged_into_its_section():
    config = load_recipe("recipes/quickstart.yaml", ["rollout={group_size: 2, max_turns: 5}", "rollout.temperature=0.5",
                                                     "data={arithmetic: {min_digits: 1}}"])
    r, d = config.rollout, config.data
    assert (r.group_size, r.max_turns, r.temperature) == (2, 5, 0.5)
    assert r.tool_configs == ["tool_configs/calculator.yaml"] and r.system_prompt.startswith("Solve the problem.")
    assert (d.source, d.num_tasks, d.arithmetic.min_digits, d.arithmetic.max_digits) == ("arithmetic", 256, 1, 4)
    config = load_recipe("recipes/quickstart.yaml", ["engine.sglang.extra_args={a: 1}"])
    assert config.engine.sglang.extra_args == {"a": 1}  # a mapping field, not a section: set as given


def test_an_output_directory_that_cannot_be_made_stops_the_command_first(tmp_path):
    (tmp_path / "afile").write_text("")
    for command, key, value, message in [
        ("rollout", "output_dir", tmp_path / "afile", f"'{tmp_path / 'afile'}' is a file, not a directory"),
        ("eval", "output_dir", tmp_path / "afile" / "run",
         f"'{tmp_path / 'afile' / 'run'}' cannot be created: '{tmp_path / 'afile'}' is a file, not a directory"),
        ("sft", "sft.output", tmp_path / "afile", f"'{tmp_path / 'afile'}' is a file, not a directory")]:
        done = subprocess.run([sys.executable, "-m", "agentrl.cli", command, "recipes/quickstart.yaml",
                               f"{key}={value}", "model.path=/nonexistent", "sft.base_model=/nonexistent"],
                              capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stderr) == (2, f"agentrl: error: override '{key}={value}': {key}: {message}\n")
    # Where no file can be made, whatever the permission bits tell root (os.access said yes to /proc).
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "recipes/quickstart.yaml",
                           "output_dir=/proc/agentrl-run", "model.path=/nonexistent"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(
        "agentrl: error: override 'output_dir=/proc/agentrl-run': output_dir: '/proc' is not writable ("), done.stderr


def test_a_command_without_its_recipe_names_only_the_recipe_as_missing():
    """Overrides are optional; argparse used to list them as required too."""
    for command in ("rollout", "serve"):
        done = subprocess.run([sys.executable, "-m", "agentrl.cli", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr.endswith(f"agentrl {command}: error: the following arguments are required: recipe\n")


def test_a_section_left_empty_takes_its_defaults_and_dotted_overrides_reach_into_it(tmp_path):
    """`trainer:` with every key commented out is null in YAML: it was refused as not a mapping,
    and `trainer.steps=2` was refused as "'trainer' is not a section"."""
    path = tmp_path / "r.yaml"
    path.write_text("name: r\ntrainer:\n  # steps: 3\nmodel:\n  lora:\n")
    assert load_recipe(path).trainer.steps == 10 and load_recipe(path).model.lora.rank == 0
    config = load_recipe(path, ["trainer.steps=2", "model.lora.rank=8"])
    assert (config.trainer.steps, config.model.lora.rank) == (2, 8)


def test_a_bad_value_from_an_override_is_blamed_on_the_override_not_the_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", ["trainer.steps=4", "trainer.lr=abc"])
    assert str(err.value).startswith("override 'trainer.lr=abc': trainer.lr: Input should be a valid number")
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", ["trainer={lr: abc}"])
    assert str(err.value).startswith("override 'trainer={lr: abc}': trainer.lr: Input should be a valid number")
    path = tmp_path / "r.yaml"
    path.write_text("name: r\ntrainer:\n  lr: abc\n")  # the file's value, beside an override of its section
    with pytest.raises(ConfigError) as err:
        load_recipe(path, ["trainer={steps: 3}"])
    assert str(err.value).startswith(f"{path}: trainer.lr: Input should be a valid number")


def test_a_bad_list_item_is_blamed_on_its_override_and_a_files_section_error_on_the_file(tmp_path):
    """A list item's error (at data.files.0) was blamed on the recipe file, which never wrote it; a
    section check failing on the file's keys was blamed on any override inside that section."""
    for overrides, message in [
        (["data.source=files", "data.files=[1]"], "override 'data.files=[1]': data.files.0: Input should be a valid "
                                                 "string (got 1)"),
        (["rollout.tool_configs=[a, 5]"], "override 'rollout.tool_configs=[a, 5]': rollout.tool_configs.1: Input "
                                          "should be a valid string (got 5)")]:
        with pytest.raises(ConfigError) as err:
            load_recipe("recipes/quickstart.yaml", overrides)
        assert str(err.value) == message
    path = tmp_path / "r.yaml"
    path.write_text("name: r\ntrainer: {bf16_autocast: true, dtype: float32}\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(path, ["trainer.steps=5"])
    assert str(err.value) == f"{path}: trainer.bf16_autocast and trainer.dtype are both set; keep only dtype"
    with pytest.raises(ConfigError) as err:  # an unknown key inside an unknown section is still the override's
        load_recipe("recipes/quickstart.yaml", ["trainer.steps=5", "foo.bar=1"])
    assert str(err.value) == "override 'foo.bar=1': unknown key 'foo'"


@pytest.mark.parametrize("overrides,message", [
    # timedelta(seconds=1e14) overflowed in each rank's process-group set-up, after Ray had started
    (["trainer.collective_timeout_s=1e14"], "trainer.collective_timeout_s: Input should be less than or equal to "
                                            "31536000 (got '1e14')"),
    (["rollout.tool_timeout_s=1e300"], "rollout.tool_timeout_s: Input should be less than or equal to 31536000"),
    # a NUL byte passed every check (Path.exists says False) and failed when the run made the directory
    (["name=a\0b"], "name 'a\\x00b' names the output directory runs/<name> (output_dir unset), so it must be one "
                    "directory name (no '/' or NUL byte, not empty, '.' or '..')"),
    (["output_dir=/tmp/a\0b"], "output_dir: a path cannot contain a NUL byte (got '/tmp/a\\x00b')"),
    # the run trained alone in this process instead of on the cluster
    (["trainer.ray_address=10.1.2.3:6379"], "trainer.ray_address ('10.1.2.3:6379') joins a Ray cluster, which only "
                                            "trainer.backend 'ray' uses (backend 'local' runs every role in this "
                                            "process)"),
])
def test_values_that_would_fail_deep_in_a_run_stop_at_load(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/quickstart.yaml", overrides, for_training=True)
    assert str(err.value).startswith(f"override '{overrides[-1]}': {message}"), str(err.value)


def test_a_name_too_long_for_the_file_system_is_a_config_error_not_a_traceback(tmp_path):
    """Below a directory that exists, looking the name up raised OSError (a traceback); below one
    still to be made (runs/ on a fresh clone) it passed every check, and training began before
    the first mkdir failed."""
    long = "a" * 300
    for value, message in [
        (tmp_path / long, f"'{tmp_path / long}' cannot be used (File name too long)"),
        (tmp_path / "runs" / long, f"'{tmp_path / 'runs' / long}' cannot be created: the name '{'a' * 32}…' is "
                                   "300 bytes, beyond the file system's 255")]:
        done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml",
                               f"output_dir={value}"], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stderr) == (2, f"agentrl: error: override 'output_dir={value}': output_dir: "
                                                     f"{message}\n")


def test_optional_path_fields_take_override_text_verbatim():
    """`PathText | None` fields were read as YAML: a '#' cut the path, '0x10' became 16, 'on' True."""
    config = load_recipe("recipes/quickstart.yaml", ["output_dir=runs/a #1", "model.chat_template=0x10",
                                                     "sft.output=on", "critic.path=null"])
    assert (config.output_dir, config.model.chat_template, config.sft.output, config.critic.path) == (
        "runs/a #1", "0x10", "on", None)


def test_a_home_directory_in_a_path_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_recipe("recipes/quickstart.yaml", ["output_dir=~/runs/x", "sft.output=~/sft", "data.source=files",
                                                     "data.files=[~/tasks.jsonl]"])
    assert (config.output_dir, config.sft.output, config.data.files) == (
        f"{tmp_path}/runs/x", f"{tmp_path}/sft", [f"{tmp_path}/tasks.jsonl"])


def test_overrides_may_follow_an_option(capsys):
    """The README's `serve RECIPE [key=value ...] [--host H] [--port N]`, in either order: an override
    after --port was an unrecognised argument."""
    from agentrl.cli import parse_arguments

    args = parse_arguments(["serve", "recipes/quickstart.yaml", "rollout.top_p=0.9", "--port", "9",
                            "rollout.temperature=0.5"])
    assert (args.overrides, args.port) == (["rollout.top_p=0.9", "rollout.temperature=0.5"], 9)
    with pytest.raises(SystemExit) as exit_:
        parse_arguments(["serve", "recipes/quickstart.yaml", "--port", "9", "--bogus", "a=1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "agentrl: error: unrecognized arguments: --bogus a=1"


def test_a_written_recipe_loads_back_with_texts_that_read_as_numbers(tmp_path):
    """Recipes read `1e-5` (no dot) as a number, which yaml.safe_dump does not know: a run named
    after its learning rate wrote a config.yaml whose `name` loaded as the float 1e-05."""
    from agentrl.recipe import run_config_yaml

    config = load_recipe("recipes/quickstart.yaml", ["name=1e-5", "rollout.system_prompt='2E+3'", "trainer.lr=1e-5",
                                                     "model.path=smollm2-135m-instruct"])
    assert (config.name, config.rollout.system_prompt, config.trainer.lr) == ("1e-5", "2E+3", 1e-5)
    (tmp_path / "config.yaml").write_text(run_config_yaml(config))
    again = load_recipe(str(tmp_path / "config.yaml"))
    assert again.model_dump() == config.model_dump()
