"""Reading a recipe: a YAML file plus dotted `key=value` overrides, validated against the schema in
config.py into one RecipeConfig, or a one-line ConfigError naming the file and the key, raised
before any model, tool or dataset is loaded. Also the checks `agentrl train` adds (settings that
load but cannot train), the checks that a CUDA device the recipe names exists and that its output
directories can be written to, the YAML a run writes beside its outputs, and the README's recipe
reference, generated from the schema's field descriptions (`python -m agentrl.recipe`).

Recipe files and override values are read with yaml_files' loader (UTF-8, no key repeated in a
mapping); overrides apply in order (a later one wins), and a mapping given for a section is merged
into it.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from agentrl.config import RecipeConfig, value_types
from agentrl.errors import ConfigError
from agentrl.yaml_files import RepeatedKey, UniqueKeyLoader, dump_recipe, load_yaml, one_line

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def check_training(config: RecipeConfig) -> None:
    """Settings that load but cannot train: one ConfigError naming the keys. `agentrl train` runs
    this when the recipe loads; `rollout` and `eval` do not need it (they do not learn)."""
    a, r, t = config.algorithm, config.rollout, config.trainer
    if a.advantage in GROUP_ESTIMATORS and r.group_size < 2:
        raise ConfigError(f"algorithm.advantage '{a.advantage}' compares the episodes of a task with each other: "
                          f"rollout.group_size must be at least 2 (got {r.group_size})")
    episodes = r.group_size * t.tasks_per_step
    if t.mini_batches > episodes:
        raise ConfigError(f"trainer.mini_batches ({t.mini_batches}) is more than the episodes of a step "
                          f"(rollout.group_size × trainer.tasks_per_step = {episodes})")
    if t.resume == "auto" and not 0 < t.save_every <= t.steps:
        raise ConfigError(f"trainer.resume 'auto' continues from the newest checkpoint, and trainer.save_every "
                          f"{t.save_every} writes none in {t.steps} steps: a relaunch would start over; set "
                          "trainer.save_every between 1 and trainer.steps")
    w = config.reward
    if not (w.tool_step_rewards or w.tool_final_rewards or w.interaction_scores):  # the outcome is the only reward
        if w.function is None:
            raise ConfigError("reward.function: null, and reward.tool_step_rewards, tool_final_rewards and "
                              "interaction_scores are false: every reward would be 0 and nothing is learnt")
        if config.data.answer_key is None and config.data.source != "arithmetic" and \
                w.function == "agentrl.env.rewards:gsm8k_reward":  # (arithmetic tasks carry answers)
            raise ConfigError("data.answer_key: null, so reward.function (gsm8k_reward) has no answer to compare "
                              "with: every reward would be 0 and nothing is learnt")
    if a.kl_in_reward and a.kl_coef == 0:
        raise ConfigError("algorithm.kl_in_reward needs algorithm.kl_coef > 0")
    if a.kl_coef > 0 and not a.kl_in_reward and a.kl_estimator == "k1":
        # d/dθ of log π(a) - log π_ref(a) is the score ∇log π(a), whose mean over the policy's own
        # samples is 0: as a loss term k1 adds noise and never pulls towards the reference.
        raise ConfigError("algorithm.kl_estimator 'k1' as a loss term (algorithm.kl_in_reward false) has a gradient "
                          "of zero in expectation, so the KL penalty would do nothing: use 'k2' or 'k3' in the loss, "
                          "or k1 with algorithm.kl_in_reward true")
    if t.backend == "local" and (t.world_size > 1 or t.engine_replicas > 1):
        raise ConfigError(f"trainer.world_size ({t.world_size}) and trainer.engine_replicas ({t.engine_replicas}) "
                          "above 1 need trainer.backend 'ray'")
    if t.backend == "local" and t.ray_address:  # else the run trains alone here, not on the cluster asked for
        raise ConfigError(f"trainer.ray_address ({t.ray_address!r}) joins a Ray cluster, which only trainer.backend "
                          "'ray' uses (backend 'local' runs every role in this process)")
    if t.placement == "colocated" and t.engine_replicas > t.world_size:
        raise ConfigError(f"trainer.placement 'colocated' puts each engine beside a training rank: "
                          f"trainer.engine_replicas ({t.engine_replicas}) must not exceed trainer.world_size "
                          f"({t.world_size})")
    e = config.engine
    if e.name == "sglang" and e.sglang.mode == "server" and e.sglang.url and t.engine_replicas > 1:
        # Each replica releases and resumes its engine's memory around every update: SGLang's
        # scheduler stops at a resume of a region it has resumed already (a KeyError in its tags).
        raise ConfigError(f"engine.sglang.url gives one SGLang server, and each of the trainer.engine_replicas "
                          f"({t.engine_replicas}) replicas would release, resume and update it on its own: SGLang "
                          "stops at the second resume; set trainer.engine_replicas to 1, or leave engine.sglang.url "
                          "unset to launch a server for each replica")


def training_warnings(config: RecipeConfig) -> list[str]:
    """Settings that train, but not as a user may think: one line each, printed as `agentrl train`
    starts."""
    a, r = config.algorithm, config.rollout
    found = []
    if r.temperature > 0 and r.top_p < 1:
        # The engines report, and the trainer recomputes, logprobs of the whole softmax (sampling.py).
        found.append(f"rollout.top_p {r.top_p} samples from the nucleus only, but the update's importance ratio "
                     "and KL use the whole distribution's logprobs: a biased gradient (top_p 1 is unbiased)")
    if r.temperature == 0 and a.advantage in GROUP_ESTIMATORS:
        found.append(f"rollout.temperature 0 samples every episode of a task alike: algorithm.advantage "
                     f"'{a.advantage}' compares them with each other, so every advantage is 0 and nothing is learnt")
    if config.reward.interaction_scores and not r.interaction_config:
        found.append("reward.interaction_scores is true but rollout.interaction_config names no interaction: "
                     "no score is added")
    lora, t = config.model.lora, config.trainer
    if lora.rank and lora.dropout > 0 and (t.ppo_epochs > 1 or t.mini_batches > 1):
        # The old logprobs come from a pass without dropout; the training passes drop adapter inputs.
        found.append(f"model.lora.dropout {lora.dropout} with trainer.ppo_epochs {t.ppo_epochs} and "
                     f"trainer.mini_batches {t.mini_batches}: the importance ratio compares logprobs with dropout "
                     "against logprobs without it, so it is not 1 at unchanged weights and the clip acts on noise "
                     "(model.lora.dropout 0 keeps the ratio exact)")
    placed = [f"trainer.{key} {value}" for key, value, default in (
        ("placement", f"'{t.placement}'", "'colocated'"), ("cpus_per_worker", f"{t.cpus_per_worker:g}", "1"))
        if value != default]
    if t.backend == "local" and placed:
        found.append(f"{' and '.join(placed)} place Ray workers, but trainer.backend 'local' runs every role in "
                     "this process: they have no effect")
    return found


NULLS = ("", "null", "Null", "NULL", "~")  # what YAML reads as null


def field_annotation(parts: list[str]) -> Any:
    """The annotation of the recipe field at a dotted path; None where the path names no field."""
    node: Any = RecipeConfig
    for part in parts:
        if not (isinstance(node, type) and issubclass(node, BaseModel)) or part not in node.model_fields:
            return None
        node = node.model_fields[part].annotation
    return node


def override_value(override: str, key: str, raw: str) -> Any:
    """The value of `key=raw` as its field reads it. A quoted YAML scalar ('"Be brief."') is its text,
    for every field. Otherwise text fields take the raw text verbatim (YAML would cut 'C# #1 priority'
    at a comment, read '#1 rule' as null and 'yes' as true); number fields take it as decimal text for
    the schema to parse (YAML 1.1 reads '1:00' as 60, '0x10' as 16); lists, mappings, booleans,
    choices and unknown keys are YAML ('[a, b]', 'true'), with no key repeated in a mapping."""
    types, nullable = value_types(field_annotation(key.split(".")))
    if not raw.strip() or (nullable and raw.strip() in NULLS):
        return None
    if types == {str} or (types and types <= {int, float}):
        quoted = quoted_text(raw)
        return quoted if quoted is not None else raw if types == {str} else raw.strip()
    try:
        value = yaml.load(raw, Loader=UniqueKeyLoader)
    except RepeatedKey as e:
        raise ConfigError(f"override '{override}': key '{e.key}' appears twice in the value") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{override}': the value is not valid YAML ({one_line(e)})") from None
    if value is None and raw.strip() not in NULLS:
        raise ConfigError(f"override '{override}': the value reads as null in YAML (' #' starts a comment); "
                          "write null for null")
    return value


def quoted_text(raw: str) -> str | None:
    """The text of a YAML scalar in single or double quotes ('"a # b"' → 'a # b'); None for
    anything else (text that merely has quotes inside it, like '"a" or "b"', is no scalar)."""
    text = raw.strip()
    if len(text) < 2 or text[0] not in "'\"" or text[-1] != text[0]:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return value if isinstance(value, str) else None


def is_section(parts: list[str]) -> bool:
    """Whether the dotted path names a section of the recipe (a mapping of fields)."""
    types, _ = value_types(field_annotation(parts))
    return any(isinstance(t, type) and issubclass(t, BaseModel) for t in types)


def holds_keys(parts: list[str]) -> bool:
    """Whether a dotted key may go on below this path: a section, a mapping field
    (`engine.sglang.extra_args`), or no field of the schema (its error is 'unknown key')."""
    annotation = field_annotation(parts)
    if annotation is None or is_section(parts):
        return True
    types, _ = value_types(annotation)
    return any((get_origin(t) or t) is dict for t in types)


def merge_section(target: dict[str, Any], value: dict[Any, Any], parts: list[str]) -> None:
    """Set `value`'s keys in the section `target` (at `parts`), recursing into subsections, so keys
    the override does not name keep the recipe's values."""
    for key, item in value.items():
        path = parts + [str(key)]
        if isinstance(item, dict) and is_section(path):
            if not isinstance(target.get(key), dict):
                target[key] = {}
            merge_section(target[key], item, path)
        else:
            target[key] = item


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dicts, the value read as the field's type (override_value); a
    mapping given for a section is merged into it (merge_section). A key set again (scripts append
    to a base list of overrides) takes the later value."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{override}': expected key=value")
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None and is_section(parts[: i + 1]):  # absent, or a section left empty
            node[part] = {}
        child = node.setdefault(part, {})
        # A field of other values, set or not: 'data.files.0=x' made data.files the mapping {'0': 'x'}.
        if not isinstance(child, dict) or not holds_keys(parts[: i + 1]):
            raise ConfigError(f"override '{override}': '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    value = override_value(override, key, raw)
    if isinstance(value, dict) and is_section(parts):
        if not isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = {}
        merge_section(node[parts[-1]], value, parts)
    else:
        node[parts[-1]] = value


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigError(f"{path}: recipe not found")
    data = load_yaml(path)
    if data is None:
        raise ConfigError(f"{path}: empty recipe (it sets no key; an empty file would run every default)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections")
    return _empty_sections_filled(data, [], path)


def _empty_sections_filled(data: dict[str, Any], parts: list[str], source: str | Path) -> dict[str, Any]:
    """`data` with each section written with no keys (`trainer:` above lines all commented out),
    which YAML reads as null, as an empty mapping: the section's defaults. A section written as
    anything but a mapping is refused here, naming the file: an override of the section would
    otherwise replace it unseen (`trainer: steps=3` with `trainer={lr: 0.1}` ran 10 steps) or be
    blamed for it."""
    for key, value in data.items():
        path = parts + [str(key)]
        if not isinstance(key, str) or not is_section(path):
            continue
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{source}: {'.'.join(path)}: a section, so a mapping of its keys (got {value!r})")
        data[key] = _empty_sections_filled(value or {}, path, source)
    return data


def check_devices(config: RecipeConfig, keys: tuple[str, ...]) -> None:
    """Each CUDA device named at `keys` (dotted) exists, or a ConfigError naming the key. torch is
    imported only when one of them names CUDA, so a CPU recipe stays free of it here."""
    wanted = {key: device for key in keys if (device := config_value(config, key)).startswith("cuda")}
    if not wanted:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key, device in wanted.items():
        if int(device.partition(":")[2] or 0) >= count:
            seen = f"only {count} CUDA device{'s' * (count != 1)}" if count else "no CUDA device"
            raise ConfigError(f"{key}: '{device}' is not available (torch {torch.__version__} sees {seen})")


def check_sglang_on_cpu(config: RecipeConfig, training: bool) -> None:
    """An SGLang engine on a CPU where SGLang computes with its AMX kernels runs bfloat16 only and
    takes no weight updates (sglang_engine.check_cpu_engine): such a recipe stops here rather than
    once the trainer's model has loaded. torch is imported only for an SGLang engine on a CPU; a
    given server is as it was started."""
    e = config.engine
    if e.name != "sglang" or not e.device.startswith("cpu") or (e.sglang.mode == "server" and e.sglang.url):
        return
    from agentrl.rollout.sglang_engine import check_cpu_engine

    check_cpu_engine(config, training)


def check_output_dirs(config: RecipeConfig, keys: tuple[str, ...]) -> None:
    """Each directory named at `keys` (dotted) can be made and written to: it is no file, no parent
    of it is a file, and a file can be made in the nearest one that exists; or a ConfigError naming
    the key, before a run's work rather than after it. Nothing is left behind: the probe file is
    anonymous. A probe rather than os.access, which says yes to root on read-only file systems
    and on /proc."""
    for key in keys:
        path = Path(config_value(config, key))
        try:  # exists() raises what is not "no such file": a name too long, a parent not searchable
            existing = next(p for p in (path, *path.parents) if p.exists())
        except OSError as e:
            raise ConfigError(f"{key}: '{path}' cannot be used ({e.strerror or e})") from None
        if not existing.is_dir():
            where = "" if existing == path else f" cannot be created: '{existing}'"
            raise ConfigError(f"{key}: '{path}'{where} is a file, not a directory")
        longest = os.pathconf(existing, "PC_NAME_MAX")
        for part in path.relative_to(existing).parts:  # the names still to be made
            if len(os.fsencode(part)) > longest:
                raise ConfigError(f"{key}: '{path}' cannot be created: the name '{part[:32]}…' is "
                                  f"{len(os.fsencode(part))} bytes, beyond the file system's {longest}")
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as e:
            raise ConfigError(f"{key}: '{existing}' is not writable ({e.strerror or e})") from None


def config_value(config: BaseModel, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def load_recipe(path: str | Path | None, overrides: list[str] = (), for_training: bool = False,
                devices: tuple[str, ...] = (), outputs: tuple[str, ...] = ()) -> RecipeConfig:
    """Recipe file + overrides → validated config, or a one-line ConfigError (naming the file).
    With `for_training`, combinations that cannot train are rejected too (check_training); the
    CUDA devices named at the dotted keys `devices` must exist (check_devices), an SGLang engine
    among them must be one SGLang runs on this CPU (check_sglang_on_cpu), and the
    directories named at `outputs` must be ones the run can write to (check_output_dirs)."""
    source = str(path) if path else "<defaults>"
    data = read_recipe_file(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    try:
        config = RecipeConfig.model_validate(data)
    except ValidationError as e:
        message = describe_error(e)
        raise ConfigError(f"{blamed(e, overrides) or named_in(message, overrides) or source}: {message}") from None
    try:
        if for_training:
            check_training(config)
        check_devices(config, devices)
        if "engine.device" in devices:
            check_sglang_on_cpu(config, training=for_training)
        check_output_dirs(config, outputs)
    except ConfigError as e:
        raise ConfigError(f"{named_in(str(e), overrides) or source}: {e}") from None
    return config


def named_in(message: str, overrides: list[str]) -> str | None:
    """"override '<it>'" for the last override whose key `message` names: a check over several keys
    (a whole section's, or one made after validation) says which keys it is about, not where the
    value came from."""
    named = [o for o in overrides
             if re.search(rf"(?<![\w.]){re.escape(o.partition('=')[0].strip())}(?![\w.])", message)]
    return f"override '{named[-1]}'" if named else None


def blamed(e: ValidationError, overrides: list[str]) -> str | None:
    """"override '<it>'" when the value the first error is about came from an override (the last
    one that set that key or a section above it), else None: the recipe file wrote it."""
    first = e.errors()[0]
    where = [str(p) for p in first["loc"]]

    def sets_it(override: str) -> bool:
        key, _, raw = override.partition("=")
        parts = key.split(".")
        if (first["type"] == "extra_forbidden" and where and len(parts) > len(where)
                and parts[: len(where)] == where):
            return True  # it sets something inside the unknown key the error is about ('foo.bar=1': 'foo')
        if not where or where[: len(parts)] != parts:
            return False
        try:  # a mapping given for a section, or a list: does it hold the rest of the path?
            value = yaml.load(raw, Loader=UniqueKeyLoader) if len(parts) < len(where) else None
        except yaml.YAMLError:
            return False
        for part in where[len(parts):]:
            if isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]  # 'data.files=[1]': the error is at data.files.0
            elif isinstance(value, dict) and part in value:
                value = value[part]
            else:
                return False
        return True

    setting = [o for o in overrides if sets_it(o)]
    return f"override '{setting[-1]}'" if setting else None


def describe_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
    if first["type"] == "extra_forbidden":
        return f"unknown key '{where}'{more}"
    # a check of a whole section (or of the recipe) names its keys itself; its input is the section
    if not where or (first["type"] == "value_error" and is_section([str(p) for p in first["loc"]])):
        return f"{message}{more}"
    return f"{where}: {message} (got {first.get('input')!r}){more}"


def to_yaml(config: RecipeConfig) -> str:
    return dump_recipe(config.model_dump(mode="json"), sort_keys=False)


def run_config_yaml(config: RecipeConfig) -> str:
    """What `train`, `rollout` and `eval` write to <output_dir>/config.yaml: the effective recipe, with a
    model.path that names a local directory made absolute, so that `agentrl view` finds the
    tokenizer from any working directory (a relative path meant the one the run started in)."""
    data = config.model_dump(mode="json")
    if Path(config.model.path).is_dir():
        data["model"]["path"] = str(Path(config.model.path).resolve())
    return dump_recipe(data, sort_keys=False)


def reference_markdown() -> str:
    """The recipe reference table (README), generated from the schema so it cannot drift."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            rows.append(f"| `{prefix}{name}` | `{shown}` | {field.description} |")

    walk(RecipeConfig, "")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m agentrl.recipe: print the recipe reference
    print(reference_markdown())
