"""Reading a recipe: a YAML file plus dotted `key=value` overrides, validated against the schema in
config.py into one RecipeConfig, or a one-line ConfigError naming the file and the key, raised
before any model, tool or dataset is loaded. Also the checks `agentrl train` adds (settings that
load but cannot train), the YAML a run writes beside its outputs, and the README's recipe
reference, generated from the schema's field descriptions (`python -m agentrl.recipe`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from agentrl.config import RecipeConfig
from agentrl.errors import ConfigError

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
    if a.kl_in_reward and a.kl_coef == 0:
        raise ConfigError("algorithm.kl_in_reward needs algorithm.kl_coef > 0")
    if t.backend == "local" and (t.world_size > 1 or t.engine_replicas > 1):
        raise ConfigError(f"trainer.world_size ({t.world_size}) and trainer.engine_replicas ({t.engine_replicas}) "
                          "above 1 need trainer.backend 'ray'")
    if t.placement == "colocated" and t.engine_replicas > t.world_size:
        raise ConfigError(f"trainer.placement 'colocated' puts each engine beside a training rank: "
                          f"trainer.engine_replicas ({t.engine_replicas}) must not exceed trainer.world_size "
                          f"({t.world_size})")


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dicts; the value is parsed as YAML ('3' → 3, '[a]' → list)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{override}': expected key=value")
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{override}': '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None


def load_recipe(path: str | Path | None, overrides: list[str] = (), for_training: bool = False) -> RecipeConfig:
    """Recipe file + overrides → validated config, or a one-line ConfigError (naming the file).
    With `for_training`, combinations that cannot train are rejected too (check_training)."""
    data: dict[str, Any] = {}
    source = str(path) if path else "<defaults>"
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"{path}: recipe not found")
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a recipe is a mapping of sections")
    for override in overrides:
        apply_override(data, override)
    try:
        config = RecipeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_error(e)}") from None
    if for_training:
        try:
            check_training(config)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    return config


def describe_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
    if first["type"] == "extra_forbidden":
        return f"unknown key '{where}'{more}"
    if not where:
        return f"{first['msg']}{more}"
    return f"{where}: {first['msg']} (got {first.get('input')!r}){more}"


def to_yaml(config: RecipeConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


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
