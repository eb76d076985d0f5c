"""A recipe → a ready EpisodeRunner and its tasks, and `agentrl rollout` end to end.

Everything the user wrote (tool files, interaction, reward function, data settings) is loaded and
checked before the model is, so a mistake costs no model load.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from agentrl.config import RecipeConfig, to_yaml
from agentrl.errors import ConfigError
from agentrl.data import arithmetic_tasks, dataset_tasks
from agentrl.env.interaction import load_interaction
from agentrl.env.rewards import load_reward_fn
from agentrl.env.tool_env import ToolLimits
from agentrl.models import load_model, load_tokenizer
from agentrl.rollout.collect import collect, summarize, write_jsonl
from agentrl.rollout.engine import Engine
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.rollout.hf_engine import HFEngine
from agentrl.rollout.memory_saver import memory_saver_for
from agentrl.tools.loader import load_tool_files
from agentrl.tools.parsers import get_parser
from agentrl.types import Task


def load_tasks(config: RecipeConfig) -> list[Task]:
    d = config.data
    if d.source == "arithmetic":
        return arithmetic_tasks(d.num_tasks, d.seed, d.arithmetic.min_digits, d.arithmetic.max_digits)
    return dataset_tasks(d.source, d.files, d.split, d.prompt_key, d.answer_key, d.id_key, limit=d.num_tasks)


def episode_settings(config: RecipeConfig) -> EpisodeSettings:
    r = config.rollout
    return EpisodeSettings(
        max_turns=r.max_turns, max_context_tokens=r.max_context_tokens,
        max_new_tokens_per_turn=r.max_new_tokens_per_turn, max_tool_output_tokens=r.max_tool_output_tokens,
        temperature=r.temperature, top_p=r.top_p, system_prompt=r.system_prompt,
        tool_limits=ToolLimits(timeout_s=r.tool_timeout_s, max_calls_per_turn=r.max_tool_calls_per_turn),
        tool_step_rewards=config.reward.tool_step_rewards, tool_final_rewards=config.reward.tool_final_rewards,
        interaction_scores=config.reward.interaction_scores)


def build_engine(config: RecipeConfig, pad_token_id: int) -> Engine:
    """The engine `engine.name` asks for; SGLang is imported only when it is the one."""
    e = config.engine
    if e.name == "sglang":
        from agentrl.rollout.sglang_engine import build_sglang_engine

        return build_sglang_engine(config)
    saver = memory_saver_for(e.device)  # on CUDA the weights live in a region the engine can release
    with saver.region("weights"):
        model = load_model(config.model.path, config.model.dtype).to(e.device)
    return HFEngine(model, pad_token_id=pad_token_id, max_batch_size=e.max_batch_size, seed=e.seed,
                    memory_saver=saver)


def build_runner(config: RecipeConfig, engine: Engine | None = None) -> tuple[EpisodeRunner, list[Task]]:
    """User files first (cheap, fail fast), then the tokenizer, the model and the engine."""
    tools = load_tool_files(config.rollout.tool_configs)
    interaction = load_interaction(config.rollout.interaction_config) if config.rollout.interaction_config else None
    reward_fn = load_reward_fn(config.reward.function)
    tasks = load_tasks(config)
    tokenizer = load_tokenizer(config.model.path, config.model.chat_template, needs_tools=bool(tools))
    if engine is None:
        engine = build_engine(config, tokenizer.pad_token_id)
    runner = EpisodeRunner(engine, tokenizer, tools, get_parser(config.rollout.parser), episode_settings(config),
                           interaction, reward_fn)
    return runner, tasks


def run_rollout(config: RecipeConfig) -> dict[str, float]:
    """`agentrl rollout`: episodes for every task × group, written to <output_dir>/rollout.jsonl."""
    print(to_yaml(config), file=sys.stderr)
    runner, tasks = build_runner(config)
    started = time.perf_counter()
    trajectories = asyncio.run(collect(runner, tasks, config.rollout.group_size,
                                       config.rollout.max_concurrent_episodes))
    summary = summarize(trajectories, time.perf_counter() - started)
    out = Path(config.output_dir) / "rollout.jsonl"
    write_jsonl(trajectories, out)
    summary_path = out.with_name("rollout_summary.json")
    summary_path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {len(trajectories)} trajectories to {out}")
    for key, value in summary.items():
        print(f"  {key:<24} {value:.4g}")
    return summary


def run_eval(config: RecipeConfig) -> dict[str, float]:
    """`agentrl eval`: one episode per held-out task at eval.temperature; accuracy = mean outcome reward."""
    e = config.eval
    overrides = {"rollout": {**config.rollout.model_dump(), "temperature": e.temperature, "group_size": 1}}
    if e.files:
        overrides["data"] = {**config.data.model_dump(), "source": "files", "files": e.files, "num_tasks": e.num_tasks}
    elif config.data.source == "arithmetic":
        overrides["data"] = {**config.data.model_dump(), "seed": e.seed, "num_tasks": e.num_tasks}
    else:
        raise ConfigError("eval.files: held-out files are needed when data.source is not 'arithmetic'")
    eval_config = RecipeConfig.model_validate({**config.model_dump(), **overrides})
    runner, tasks = build_runner(eval_config)
    started = time.perf_counter()
    trajectories = asyncio.run(collect(runner, tasks, 1, config.rollout.max_concurrent_episodes))
    summary = summarize(trajectories, time.perf_counter() - started)
    summary["accuracy"] = sum(t.metrics.get("outcome_reward", 0.0) for t in trajectories) / len(trajectories)
    out = Path(config.output_dir) / f"eval_{Path(config.model.path).name}.jsonl"  # one file per evaluated model
    write_jsonl(trajectories, out)
    out.with_suffix(".json").write_text(json.dumps({"model": config.model.path, **summary}, indent=2))
    print(f"eval {config.model.path}: accuracy {summary['accuracy']:.3f} on {len(tasks)} held-out tasks, "
          f"tool-call rate {summary['tool_call_rate']:.2f}, mean turns {summary['mean_turns']:.2f} ({out})")
    return summary
