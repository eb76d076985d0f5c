"""A recipe → a ready EpisodeRunner (or AgentRunner) and its tasks, and `agentrl rollout` end to end.

Everything the user wrote (tool files, interaction, reward function, data settings) is loaded and
checked before the model is, so a mistake costs no model load. `rollout` and `eval` write the
effective recipe to <output_dir>/config.yaml as `train` does, so `agentrl view` can decode their
trajectories; eval's is the recipe it runs (`eval_recipe`: eval.temperature, one episode per task,
the held-out tasks), so the file says how its results were made.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from agentrl.config import RecipeConfig
from agentrl.recipe import run_config_yaml, to_yaml
from agentrl.errors import ConfigError
from agentrl.hardware import choose_dtype
from agentrl.data import arithmetic_tasks, dataset_tasks
from agentrl.env.interaction import load_interaction
from agentrl.env.rewards import load_reward_fn
from agentrl.env.tool_env import ToolLimits
from agentrl.models import load_model, load_tokenizer
from agentrl.rollout.chat import ChatRenderer, SpecialTextError, stop_token_ids
from agentrl.rollout.collect import check_failures, run_streamed, summarize
from agentrl.rollout.engine import Engine
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.rollout.hf_engine import HFEngine
from agentrl.rollout.memory_saver import memory_saver_for
from agentrl.tools.builtin.gsm8k import ground_truth_number
from agentrl.tools.loader import close_tools, load_tool_files
from agentrl.tools.parsers import get_parser
from agentrl.tools.threads import failure_text
from agentrl.types import Task

if TYPE_CHECKING:
    from agentrl.serve.agent import AgentRunner


def load_tasks(config: RecipeConfig, files_key: str = "data.files") -> list[Task]:
    """The task pool; an empty one is a ConfigError naming the recipe key that chose it
    (`files_key`: data.files, or eval.files for held-out tasks), and one smaller than `num_tasks`
    asked for is named in a warning."""
    d = config.data
    if d.source == "arithmetic":
        return arithmetic_tasks(d.num_tasks, d.seed, d.arithmetic.min_digits, d.arithmetic.max_digits)
    tasks = dataset_tasks(d.source, d.files, d.split, d.prompt_key, d.answer_key, d.id_key, limit=d.num_tasks,
                          files_key=files_key)
    key, where = (files_key, f"{d.files}") if d.source == "files" else (
        "data.source", f"dataset '{d.source}' split '{d.split}'")
    if not tasks:
        raise ConfigError(f"{key}: no tasks: {where} has no rows")
    if len(tasks) < d.num_tasks:  # a training run repeats them sooner, an accuracy is over fewer
        count_key = "eval.num_tasks" if files_key == "eval.files" else "data.num_tasks"
        print(f"agentrl: warning: {count_key} is {d.num_tasks}, but {key} {where} has {len(tasks)} rows: "
              f"the run uses those {len(tasks)}", file=sys.stderr)
    if config.reward.function == "agentrl.env.rewards:gsm8k_reward":
        unscorable = [t for t in tasks if t.answer is not None and ground_truth_number(t.answer) is None]
        if unscorable:  # every episode of these scores 0, right or wrong
            first = unscorable[0]
            print(f"agentrl: warning: {len(unscorable)} of {len(tasks)} tasks have an answer with no number "
                  f"(first: {first.metadata.get('where', first.id)}: {first.answer[:60]!r}), so reward.function "
                  "(gsm8k_reward) scores every episode of them 0", file=sys.stderr)
    return tasks


def episode_settings(config: RecipeConfig) -> EpisodeSettings:
    r = config.rollout
    return EpisodeSettings(
        max_turns=r.max_turns, max_context_tokens=r.max_context_tokens,
        max_new_tokens_per_turn=r.max_new_tokens_per_turn, max_tool_output_tokens=r.max_tool_output_tokens,
        max_interaction_tokens=r.max_interaction_tokens,
        temperature=r.temperature, top_p=r.top_p, system_prompt=r.system_prompt,
        tool_limits=ToolLimits(timeout_s=r.tool_timeout_s, max_calls_per_turn=r.max_tool_calls_per_turn,
                               parallel_calls=r.parallel_tool_calls),
        interaction_timeout_s=r.interaction_timeout_s, agent_timeout_s=r.agent_timeout_s,
        reward_timeout_s=config.reward.timeout_s,
        tool_step_rewards=config.reward.tool_step_rewards, tool_final_rewards=config.reward.tool_final_rewards,
        interaction_scores=config.reward.interaction_scores)


def build_engine(config: RecipeConfig, pad_token_id: int, message_end_ids: tuple[int, ...] = ()) -> Engine:
    """The engine `engine.name` asks for; SGLang is imported only when it is the one. The tokens
    that end a chat message let the transformers engine share prompts' first messages (SGLang's
    radix cache shares any prefix)."""
    e = config.engine
    if e.name == "sglang":
        from agentrl.rollout.sglang_engine import build_sglang_engine

        return build_sglang_engine(config)
    saver = memory_saver_for(e.device)  # on CUDA the weights live in a region the engine can release
    with saver.region("weights"):
        model = load_model(config.model.path, choose_dtype(config.model.dtype, e.device).dtype).to(e.device)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and config.rollout.max_context_tokens > positions:  # else every long episode fails
        raise ConfigError(f"rollout.max_context_tokens ({config.rollout.max_context_tokens}) is more than the "
                          f"{positions} positions of model.path '{config.model.path}'; set it to {positions} or less")
    return HFEngine(model, pad_token_id=pad_token_id, max_batch_size=e.max_batch_size, seed=e.seed,
                    kv_cache_bytes=e.kv_cache_bytes, memory_saver=saver, message_end_ids=message_end_ids)


def load_user_parts(config: RecipeConfig) -> tuple[list, Callable[[], Any] | None, Any]:
    """The user's tool files, interaction and reward function, each checked: (tools, interaction
    factory, reward function)."""
    tools = load_tool_files(config.rollout.tool_configs)
    try:
        interaction_file = config.rollout.interaction_config
        if interaction_file and not Path(interaction_file).is_file():
            raise ConfigError(f"rollout.interaction_config: {interaction_file}: file not found")
        interaction = load_interaction(interaction_file) if interaction_file else None
        return tools, interaction, load_reward_fn(config.reward.function)
    except BaseException:  # the tools are open (an MCP server started)
        close_tools(tools)
        raise


def load_driver_parts(config: RecipeConfig) -> tuple[list[Task], Any]:
    """What a training driver needs without loading a model: the user's files checked, then the
    task pool and the tokenizer."""
    tools, _, _ = load_user_parts(config)
    close_tools(tools)  # checked only: the rollout workers open their own
    tasks = load_tasks(config)
    warn_unknown_tool_kwargs(tasks, tools)
    tokenizer = load_tokenizer(config.model.path, config.model.chat_template,
                               needs_tools=bool(tools) or config.rollout.agent is not None)
    check_tool_schemas(tokenizer, tools)
    return tasks, tokenizer


def warn_unknown_tool_kwargs(tasks: list[Task], tools: list) -> None:
    """One warning per name in the tasks' `tool_kwargs` that no tool of the run has, naming the first
    row that uses it: a misspelt name leaves its tool's create() without its arguments, silently.
    A warning, not an error: a dataset may carry arguments for tools another recipe uses."""
    names = {t.schema["function"]["name"] for t in tools}
    seen: set[str] = set()
    for task in tasks:
        for name in sorted(set(task.tool_kwargs) - names - seen):
            seen.add(name)
            print(f"agentrl: warning: {task.metadata.get('where', f'task {task.id!r}')}: tool_kwargs for {name!r}, "
                  f"which no tool of rollout.tool_configs has (tools: {', '.join(sorted(names)) or 'none'}); its "
                  "create() arguments go nowhere", file=sys.stderr)


def check_tool_schemas(tokenizer: Any, tools: list) -> None:
    """Stop, before any model loads, on a tool schema the chat template would render with control
    tokens in it (a description from an MCP or tool server spelling `<|im_end|>`)."""
    try:
        ChatRenderer(tokenizer, tools)
    except SpecialTextError as e:
        raise ConfigError(f"rollout.tool_configs: {e}") from None


def load_policy(config: RecipeConfig, engine: Engine | None = None, needs_tools: bool = False,
                tools: list | None = None) -> tuple[Any, Engine]:
    """The tokenizer with the recipe's chat template, the `tools`' schemas checked against it, and
    the engine on the recipe's model (unless one is given)."""
    tokenizer = load_tokenizer(config.model.path, config.model.chat_template, needs_tools=needs_tools)
    check_tool_schemas(tokenizer, tools or [])
    if engine is None:
        engine = build_engine(config, tokenizer.pad_token_id, stop_token_ids(tokenizer))
    return tokenizer, engine


def build_runner(config: RecipeConfig, engine: Engine | None = None, files_key: str = "data.files",
                 with_tasks: bool = True) -> tuple[EpisodeRunner | AgentRunner, list[Task]]:
    """User files first (cheap, fail fast), then the tokenizer, the model and the engine. With
    `rollout.agent` the runner is an AgentRunner: the agent function against the endpoint."""
    tools, interaction, reward_fn = load_user_parts(config)
    try:  # the tools' servers are running already
        agent = None
        if config.rollout.agent:
            from agentrl.serve.agent import load_agent  # the HTTP stack only when an agent needs it

            agent = load_agent(config)
        tasks = load_tasks(config, files_key) if with_tasks else []
        warn_unknown_tool_kwargs(tasks, tools)
        tokenizer, engine = load_policy(config, engine, needs_tools=bool(tools) or agent is not None, tools=tools)
    except BaseException:
        close_tools(tools)
        raise
    if agent is not None:
        from agentrl.serve.agent import AgentRunner

        return AgentRunner(agent, engine, tokenizer, tools, get_parser(config.rollout.parser),
                           episode_settings(config), reward_fn, model_name=config.model.path), tasks
    runner = EpisodeRunner(engine, tokenizer, tools, get_parser(config.rollout.parser), episode_settings(config),
                           interaction, reward_fn)
    return runner, tasks


def close_runner(runner: EpisodeRunner | AgentRunner) -> None:
    """What build_runner opened: the runner's tools (and agent endpoint), then its engine (a
    launched SGLang server and its weight files). Never raises (close_quietly)."""
    close_quietly("the rollout's tools", runner.close)
    close_quietly("the rollout engine", runner.engine.close)


def close_quietly(what: str, close: Callable[[], Any]) -> None:
    """Cleanup as a run ends: a failure is printed, naming `what`, and the run's outcome (or the
    error that ended it, which a raise here would replace) stands."""
    try:
        close()
    except Exception as e:
        print(f"agentrl: warning: closing {what} failed: {failure_text(e)}", file=sys.stderr)


def write_run_config(config: RecipeConfig) -> None:
    """<output_dir>/config.yaml for `agentrl view` (run_config_yaml), written once the model has
    loaded and before any episode; a training run's own (the directory holds its metrics.jsonl) is
    kept, as eval usually writes beside it."""
    run_dir = Path(config.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "metrics.jsonl").exists():
            (run_dir / "config.yaml").write_text(run_config_yaml(config))
    except OSError as e:
        raise ConfigError(f"output_dir: cannot write to '{run_dir}' ({e.strerror or e})") from None


def run_rollout(config: RecipeConfig) -> dict[str, float]:
    """`agentrl rollout`: episodes for every task × group, written to <output_dir>/rollout.jsonl."""
    print(to_yaml(config), file=sys.stderr)
    runner, tasks = build_runner(config)
    out = Path(config.output_dir) / "rollout.jsonl"
    summary_path = out.with_name("rollout_summary.json")
    try:
        write_run_config(config)
        started = time.perf_counter()
        trajectories = run_streamed(runner, tasks, config.rollout.group_size, config.rollout.max_concurrent_episodes,
                                    out, stale=(summary_path,), seed=config.engine.seed)
    finally:
        close_runner(runner)
    summary = summarize(trajectories, time.perf_counter() - started)
    summary_path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {len(trajectories)} trajectories to {out}")
    for key, value in summary.items():
        print(f"  {key:<24} {value:.4g}")
    check_failures(f"rollout ({out})", trajectories, config.trainer.max_failed_fraction)
    return summary


def eval_name(model_path: str, output_dir: str) -> str:
    """What names an evaluated model's files, one per model: its path under `output_dir` (`final`,
    `previous_final`), else under the working directory (`runs_a_final`), else as given (a builtin
    or hub name, an absolute path), with the separators as `_`. The last directory's name alone
    made runs/a/final and runs/b/final write to one file, the second run deleting the first's
    summary."""
    path = Path(model_path)
    for base in (Path(output_dir), Path.cwd()):
        try:  # abspath, not resolve: a link names the model by the link
            path = Path(os.path.abspath(model_path)).relative_to(os.path.abspath(base))
            break
        except ValueError:  # not under it
            pass
    return "_".join(part for part in path.parts if part not in ("/", ".", "..")) or Path(os.path.abspath(model_path)).name


def eval_recipe(config: RecipeConfig) -> RecipeConfig:
    """The recipe `agentrl eval` runs: the given one with one episode per task at eval.temperature
    (rollout.temperature and rollout.group_size), on the held-out tasks (eval.files, or the
    arithmetic tasks of eval.seed) as data. It is the one eval prints and writes to config.yaml,
    so that they say how its results were made."""
    if config.reward.function is None:
        raise ConfigError("reward.function: null, so eval has nothing to score: its accuracy is the mean outcome "
                          "reward")
    if config.data.answer_key is None and config.data.source != "arithmetic" and \
            config.reward.function == "agentrl.env.rewards:gsm8k_reward":  # (arithmetic tasks carry answers)
        raise ConfigError("data.answer_key: null, so eval has nothing to score: reward.function (gsm8k_reward) "
                          "compares each answer with the task's")
    e = config.eval
    overrides = {"rollout": {**config.rollout.model_dump(), "temperature": e.temperature, "group_size": 1}}
    if e.files:
        training = {os.path.realpath(f) for f in config.data.files} if config.data.source == "files" else set()
        shared = next((f for f in e.files if os.path.realpath(f) in training), None)
        if shared is not None:
            raise ConfigError(f"eval.files: '{shared}' is also in data.files, so the held-out tasks would be training "
                              "tasks: evaluate on a file of its own")
        overrides["data"] = {**config.data.model_dump(), "source": "files", "files": e.files, "num_tasks": e.num_tasks}
    elif config.data.source == "arithmetic":
        # Same seed and digits: the generator's stream, and so the first tasks, would be the training ones.
        a, s = config.data.arithmetic, config.sft
        if e.seed == config.data.seed:
            raise ConfigError(f"eval.seed {e.seed} equals data.seed, so the held-out arithmetic tasks would be the "
                              "training tasks: give eval.seed a seed of its own")
        if s.data == "arithmetic" and e.seed == s.seed and (a.min_digits, a.max_digits) == (s.min_digits, s.max_digits):
            raise ConfigError(f"eval.seed {e.seed} equals sft.seed with the same digits, so the held-out arithmetic "
                              "tasks would be the warm-up's demonstrations: give eval.seed a seed of its own")
        overrides["data"] = {**config.data.model_dump(), "seed": e.seed, "num_tasks": e.num_tasks}
    else:
        raise ConfigError("eval.files: held-out files are needed when data.source is not 'arithmetic'")
    return RecipeConfig.model_validate({**config.model_dump(), **overrides})


def run_eval(config: RecipeConfig) -> dict[str, float]:
    """`agentrl eval`: one episode per held-out task at eval.temperature; accuracy = mean outcome reward."""
    try:
        eval_config = eval_recipe(config)
    except Exception:  # the recipe as given, first, as every command prints it
        print(to_yaml(config), file=sys.stderr)
        raise
    print(to_yaml(eval_config), file=sys.stderr)
    e = config.eval
    runner, tasks = build_runner(eval_config, files_key="eval.files" if e.files else "data.files")
    out = Path(config.output_dir) / f"eval_{eval_name(config.model.path, config.output_dir)}.jsonl"
    try:
        write_run_config(eval_config)
        started = time.perf_counter()
        trajectories = run_streamed(runner, tasks, 1, config.rollout.max_concurrent_episodes, out,
                                    stale=(out.with_suffix(".json"),), seed=eval_config.engine.seed)
    finally:
        close_runner(runner)
    summary = summarize(trajectories, time.perf_counter() - started)
    # A failed episode counts as wrong: accuracy is over every held-out task.
    summary["accuracy"] = sum(t.metrics.get("outcome_reward", 0.0) for t in trajectories
                              if t.finish != "error") / len(trajectories)
    out.with_suffix(".json").write_text(json.dumps({"model": config.model.path, **summary}, indent=2))
    failed = f", {summary['episodes_failed']:.0f} failed" if summary["episodes_failed"] else ""
    print(f"eval {config.model.path}: accuracy {summary['accuracy']:.3f} on {len(tasks)} held-out tasks{failed}, "
          f"tool-call rate {summary['tool_call_rate']:.2f}, mean turns {summary['mean_turns']:.2f} ({out})")
    check_failures(f"eval ({out})", trajectories, config.trainer.max_failed_fraction)
    return summary
