"""The recipe schema: one strict pydantic model, read from YAML plus dotted `key=value` overrides.

Every field has a default and a one-line description (the README's recipe reference is generated
from them). An unknown or misspelt key is an error naming its dotted path, raised before any model,
tool or dataset is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field("smollm2-135m-instruct", description="Local model directory, hub id, or builtin name.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weight dtype of the engine's model.")
    chat_template: str | None = Field(
        None, description="'hermes', a Jinja file, or null for the model's own (hermes if it ignores tools).")


class ArithmeticConfig(_Section):
    min_digits: int = Field(3, ge=1, description="Fewest digits of a generated operand.")
    max_digits: int = Field(4, ge=1, description="Most digits of a generated operand.")


class DataConfig(_Section):
    source: str = Field("arithmetic", description="'arithmetic' (generated), 'files', or a hub dataset id.")
    files: list[str] = Field(default_factory=list, description="jsonl/json/parquet/csv files when source is 'files'.")
    split: str = Field("train", description="Split of a hub dataset.")
    prompt_key: str = Field("question", description="Column holding the user prompt.")
    answer_key: str | None = Field("answer", description="Column holding the ground truth (null: none).")
    id_key: str | None = Field(None, description="Column holding a task id (null: row index).")
    num_tasks: int = Field(8, ge=1, description="How many tasks a rollout uses.")
    seed: int = Field(0, description="Seed of the arithmetic generator.")
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig, description="Generator settings.")


class RolloutConfig(_Section):
    tool_configs: list[str] = Field(default_factory=list, description="Tool YAML files (tool_configs/*.yaml).")
    interaction_config: str | None = Field(None, description="Interaction YAML file, or null for none.")
    parser: Literal["hermes"] = Field("hermes", description="Function-call format the model emits.")
    system_prompt: str | None = Field(None, description="System message placed before each task's prompt.")
    group_size: int = Field(4, ge=1, description="Episodes sampled per task (a GRPO group).")
    max_concurrent_episodes: int = Field(64, ge=1, description="Episodes in flight at once.")
    max_turns: int = Field(4, ge=1, description="Assistant turns per episode.")
    max_tool_calls_per_turn: int = Field(4, ge=1, description="Calls run per turn; extra calls get an error.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Seconds a tool call may take.")
    max_tool_output_tokens: int = Field(256, ge=8, description="Tool output beyond this is cut, with a marker.")
    max_context_tokens: int = Field(2048, ge=16, description="Prompt plus every turn, in tokens.")
    max_new_tokens_per_turn: int = Field(256, ge=1, description="Tokens one assistant turn may sample.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")


class EngineConfig(_Section):
    name: Literal["hf"] = Field("hf", description="Inference engine: 'hf' (transformers).")
    device: str = Field("cpu", description="Torch device of the engine.")
    max_batch_size: int = Field(64, ge=1, description="Generate calls decoded together.")
    seed: int = Field(0, description="Sampling seed.")


class RewardConfig(_Section):
    function: str | None = Field("agentrl.env.rewards:gsm8k_reward",
                                 description="Outcome reward 'module:attr' (task, messages) -> float, or null.")
    tool_step_rewards: bool = Field(False, description="Add the tools' per-call rewards.")
    tool_final_rewards: bool = Field(False, description="Add each tool's end-of-episode reward.")
    interaction_scores: bool = Field(False, description="Add the interaction's scores.")


class RecipeConfig(_Section):
    name: str = Field("run", description="Run name; names the output directory.")
    output_dir: str | None = Field(None, description="Where outputs go (default runs/<name>).")
    seed: int = Field(0, description="Global seed.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Where tasks come from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="The episode loop.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The inference engine.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How rewards are summed.")

    @model_validator(mode="after")
    def _derive(self) -> "RecipeConfig":
        if self.output_dir is None:
            self.output_dir = str(Path("runs") / self.name)
        if self.data.arithmetic.min_digits > self.data.arithmetic.max_digits:
            raise ValueError("data.arithmetic.min_digits is larger than max_digits")
        return self


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


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> RecipeConfig:
    """Recipe file + overrides → validated config, or a one-line ConfigError."""
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
        return RecipeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_error(e)}") from None


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


if __name__ == "__main__":  # python -m agentrl.config: print the recipe reference
    print(reference_markdown())
