"""The RL driver. One step: collect groups → release engine memory → old and reference logprobs →
(critic values) → advantages → policy (and critic) update → resume the engine's weights → weight sync
(new version, cache flush) → resume its KV cache → log.

Everything a step needs is built once in `train`; the loop body reads top to bottom. The roles are
plain objects in this process (trainer.backend 'local') or the same classes as Ray actors, sharded
over ranks ('ray', trainer/launch.py); the driver makes the same calls either way.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from agentrl.algos.losses import kl_estimate
from agentrl.config import AlgorithmConfig, RecipeConfig
from agentrl.recipe import check_sglang_on_cpu, check_training, run_config_yaml, to_yaml, training_warnings
from agentrl.errors import ConfigError
from agentrl.hardware import choose_dtype
from agentrl.memory import release_freed_memory
from agentrl.rollout.collect import check_failures, summarize, write_jsonl
from agentrl.rollout.run import load_driver_parts
from agentrl.trainer.checkpoint import RECIPE, check_replaceable, latest_checkpoint, unreadable
from agentrl.trainer.critic import CriticWorker, check_critic_path
from agentrl.trainer.policy import PolicyWorker, ReferenceWorker
from agentrl.trainer.ray_settings import check_ray_settings
from agentrl.trainer.roles import Roles, start_roles
from agentrl.tracking import WANDB_RUN_ID, RunLogger, check_wandb
from agentrl.trainer.returns import gae_targets, outcome_advantages, token_advantages
from agentrl.types import Task, Trajectory


def step_record(step: int, trajectories: list[Trajectory], rollout: dict[str, float], update: dict[str, float],
                times: dict[str, float], synced_version: int) -> dict[str, float]:
    """One metrics.jsonl line: rollout summary, update metrics, time split, weight versions.
    `weight_version` is the oldest version the engine reported for this step's samples;
    `synced_version` the one it holds after this step's sync."""
    ok = [tr for tr in trajectories if tr.finish != "error"]
    rewards = torch.tensor([tr.reward for tr in ok] or [0.0])
    return {"step": step, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(ok) > 1 else 0.0,
            "accuracy": sum(tr.metrics.get("outcome_reward", 0.0) for tr in ok) / max(len(ok), 1),
            "response_tokens": rollout["tokens_generated"] / len(trajectories),
            **{k: v for k, v in rollout.items() if k not in ("reward_mean", "wall_s")},
            **update, **times, "weight_version": min(tr.weight_version for tr in trajectories),
            "synced_version": synced_version, "tokens_per_s": rollout["tokens_generated"] / times["time_step_s"]}


def masked_mean(rows: list[list[float]], masks: list[list[int]]) -> float:
    """The mean of per-token values over the trained tokens (mask 1, the first token of a sequence
    aside: nothing predicts it)."""
    tokens = sum(sum(mask[1:]) for mask in masks)
    return sum(v for row, mask in zip(rows, masks) for v, m in zip(row[1:], mask[1:]) if m) / max(tokens, 1)


def learn(trajectories: list[Trajectory], group_size: int, a: AlgorithmConfig, policy: PolicyWorker,
          reference: ReferenceWorker | None, critic: CriticWorker | None, times: dict[str, float]) -> dict[str, float]:
    # policy, reference and critic are the workers themselves (local) or their Ray groups: same calls
    """Old and reference logprobs, advantages, and the policy (and critic) update, on the episodes
    that did not fail; returns the update's metrics and adds the time split to `times`."""
    clock = time.perf_counter()
    per_sequence = outcome_advantages(trajectories, group_size, a) if critic is None else None
    trained = [tr for tr in trajectories if tr.finish != "error"]
    if not trained:  # every episode failed and trainer.max_failed_fraction allowed it: nothing to learn
        times.update(time_logprobs_s=0.0, time_update_s=0.0)
        # An update of no rows takes no optimizer step but advances the learning-rate schedule,
        # which counts RL steps (trainer.warmup_steps), and reports the step's learning rate.
        return policy.update([], [], [], [], [] if reference else None, None)
    sequences, masks = [tr.token_ids for tr in trained], [tr.loss_mask for tr in trained]
    old = None if policy.on_policy else policy.logprobs(sequences, masks)
    ref = reference.logprobs(sequences, masks) if reference else None
    kl = None
    if ref is not None and a.kl_in_reward:
        base = old or policy.logprobs(sequences, masks)
        kl = [kl_estimate(torch.tensor(p), torch.tensor(q), a.kl_estimator).tolist() for p, q in zip(base, ref)]
    if critic is not None:
        values = critic.values(sequences, masks)
        advantages, returns = gae_targets(trained, values, a, kl)
    else:
        advantages = token_advantages(trained, [x for x in per_sequence if x is not None], a, kl)
    times["time_logprobs_s"] = time.perf_counter() - clock

    clock = time.perf_counter()
    update = policy.update(sequences, masks, advantages, old, None if a.kl_in_reward else ref,
                           [tr.logprobs for tr in trained])
    if kl is not None:  # the KL went into the rewards, not the loss: report it as the update would
        update["kl_ref"] = masked_mean(kl, masks)
    if critic is not None:
        update |= critic.update(sequences, masks, returns, values)
    release_freed_memory()  # once a step, after the largest allocations (see agentrl/memory.py)
    times["time_update_s"] = time.perf_counter() - clock
    return update


def train(config: RecipeConfig) -> list[dict[str, float]]:
    check_training(config)
    check_sglang_on_cpu(config, training=True)  # load_recipe checks it only when told the engine's device
    check_ray_settings(config)
    print(to_yaml(config), file=sys.stderr)
    for warning in training_warnings(config):
        print(f"agentrl: warning: {warning}", file=sys.stderr)
    # What would otherwise fail only once the models are loaded (RunLogger starts after them):
    check_wandb(config.trainer.wandb_project)
    if config.algorithm.advantage == "gae" and config.critic.path:
        check_critic_path(config.critic.path)
    pool, tokenizer = load_driver_parts(config)  # the user's files are checked before any model loads
    if config.rollout.agent:  # checked here too: a run that cannot start writes nothing
        from agentrl.serve.agent import load_agent

        load_agent(config)
    run_dir = Path(config.output_dir)
    check_run_dir(config, run_dir)
    if config.trainer.resume == "auto":
        check_resume(config, latest_checkpoint(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    roles = start_roles(config, tokenizer)
    try:
        history = run_steps(config, roles, pool, run_dir)
        roles.save_model(run_dir / "final")
        if roles.critic is not None:
            roles.save_critic(run_dir / "critic")
    finally:
        roles.shutdown()
    print("reward by step: " + " ".join(f"{h['reward_mean']:.2f}" for h in history))
    print(f"saved {run_dir / 'final'}; metrics in {run_dir / 'metrics.jsonl'}")
    return history


def check_run_dir(config: RecipeConfig, run_dir: Path) -> None:
    """Before any model loads, what would otherwise fail or destroy something only at the end: a
    model directory this run will save over (final/, critic/, step_N/, kept when the run resumes)
    that holds other files, and a model or critic this run trains from inside one of them or
    inside previous/. A run from step 0 moves the first into previous/ and previous/ to
    previous.N/; either way the directory is gone when the run resumes, and a LoRA adapter saved
    over its own base names itself."""
    if not run_dir.is_dir():
        return
    models = [run_dir / "final", run_dir / "critic", *(p for p in run_dir.iterdir() if STEP_MODEL.fullmatch(p.name))]
    for path in models:
        check_replaceable(path)
    for key, value in (("model.path", config.model.path), ("critic.path", config.critic.path)):
        if not value or not Path(value).exists():
            continue
        for place in [run_dir / "previous", *models]:
            if Path(value).resolve().is_relative_to(place.resolve()):
                raise ConfigError(f"{key}: '{value}' is inside {place}, which this run moves or replaces; "
                                  "copy it elsewhere, or use another output_dir")


# What a resumed run must share with the run that wrote its checkpoint: the models the checkpoint's
# weights belong to (policy, LoRA adapters, critic) and the tasks the data cursor (the step number)
# indexes.
RESUME_MUST_MATCH = ("model.path", "model.lora.", "critic.path", "data.", "trainer.tasks_per_step")
# Within those, a setting of how to train the same weights, not of their shape: warned of only.
RESUME_MAY_CHANGE = ("model.lora.dropout",)
# Settings that do not shape training, and trainer.steps, which a resume may raise (checked apart).
RESUME_IGNORED = ("name", "eval.", "sft.", "trainer.resume", "trainer.steps")


def check_resume(config: RecipeConfig, checkpoint: Path | None) -> None:
    """Before any model loads: a ConfigError when the checkpoint `trainer.resume=auto` would continue
    was written with another model, LoRA layout, critic or task pool, or at a step past trainer.steps; one
    warning listing any other setting that changed (a new trainer.lr is a usual reason to resume)."""
    if checkpoint is None or not (checkpoint / RECIPE).is_file():  # or written before checkpoints kept it
        return
    try:
        saved = _dotted(json.loads((checkpoint / RECIPE).read_text()))
    except (OSError, ValueError, AttributeError) as e:  # AttributeError: JSON that is no object
        raise unreadable(checkpoint / RECIPE, e) from None
    now = _dotted(config.model_dump(mode="json"))
    changed = [key for key in sorted(saved.keys() | now.keys())
               if not _same(key, saved, now) and not key.startswith(RESUME_IGNORED)]

    def show(key: str) -> str:
        return f"{key} {json.dumps(saved.get(key))} -> {json.dumps(now.get(key))}"

    refused = [show(key) for key in changed if key.startswith(RESUME_MUST_MATCH) and key not in RESUME_MAY_CHANGE]
    if refused:
        raise ConfigError(f"trainer.resume 'auto': {checkpoint} was written with other settings for the model or "
                          f"the tasks ({', '.join(refused)}); resume with the ones it was written with, or start "
                          "the new run in another output_dir")
    step = int(checkpoint.name.removeprefix("step_"))
    if config.trainer.steps < step:
        raise ConfigError(f"trainer.steps {config.trainer.steps}: {checkpoint} is at step {step} already; raise "
                          "trainer.steps to continue it")
    if changed:
        print(f"agentrl: warning: resuming {checkpoint} with settings changed since it was written: "
              f"{', '.join(show(key) for key in changed)}", file=sys.stderr)


def _same(key: str, saved: dict[str, object], now: dict[str, object]) -> bool:
    """Whether a dotted setting builds the same models in both recipes: LoRA alpha null is 2 × rank
    (trainer.lora); without adapters (rank 0 in both) the other LoRA settings shape nothing, and
    without a critic (advantage other than 'gae' in both) neither does critic.path."""
    def both(setting: str, test: Callable[[object], bool]) -> bool:
        return test(saved.get(setting)) and test(now.get(setting))

    if key.startswith("model.lora.") and key != "model.lora.rank" and both("model.lora.rank", lambda r: r == 0):
        return True
    if key == "critic.path" and both("algorithm.advantage", lambda a: a != "gae"):
        return True
    if key == "model.lora.alpha":
        def alpha(flat: dict[str, object]) -> object:
            rank = flat.get("model.lora.rank")
            return 2.0 * rank if flat.get(key) is None and isinstance(rank, int) else flat.get(key)
        return alpha(saved) == alpha(now)
    return same_paths(saved.get(key), now.get(key))


def same_paths(saved: object, now: object) -> bool:
    """Equal settings, where a text (or list of texts) naming a local file or directory in both
    equals another spelling of it: the run's own config.yaml names model.path absolute, and
    `./m` is `m`."""
    if isinstance(saved, list) and isinstance(now, list):
        return len(saved) == len(now) and all(same_paths(a, b) for a, b in zip(saved, now))
    if saved == now or not (isinstance(saved, str) and isinstance(now, str) and saved and now):
        return saved == now
    try:
        return Path(saved).exists() and Path(now).exists() and Path(saved).resolve() == Path(now).resolve()
    except (OSError, ValueError):  # a text no file system takes as a path (a NUL in it)
        return False


def _dotted(tree: dict, prefix: str = "") -> dict[str, object]:
    """A nested recipe as {dotted key: value}; lists stay whole."""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


STEP_MODEL = re.compile(r"step_\d+")  # a step_N/ model directory (trainer.save_every)
# What only a training run writes (workers.json: a Ray run's table, written just after its recipe).
TRAINING_EVIDENCE = ("checkpoints", "trajectories", "metrics.jsonl", "tensorboard", WANDB_RUN_ID, "final", "critic",
                     "workers.json")
# An earlier run's recipe is moved with its results; alone it is no earlier run: `agentrl eval` and
# `agentrl rollout` write one too, beside results made before any training run.
EARLIER_RUN = ("config.yaml", *TRAINING_EVIDENCE)
# What other commands wrote about an earlier run's models: moved with it, not alone (an evaluation
# of the base model made before the first run stays where it is).
# `agentrl eval`'s files of this run's final/ and step_N/ models (rollout/run.py eval_name).
STALE_EVAL = re.compile(r"eval_(?P<model>final|step_\d+)\.jsonl?")
EARLIER_RESULTS = re.compile(r"eval_.+\.jsonl?|rollout\.jsonl|rollout_summary\.json|view\.html|plots")


def set_aside_earlier_run(run_dir: Path, resuming: bool = False) -> None:
    """A run that starts from step 0 in a directory an earlier run used moves that run's recipe,
    checkpoints, trajectories, metrics and model directories (step_N/, final/, critic/), and the
    evaluations, rollouts, views and plots made of it, into previous/. Left in place, the earlier
    run's newer checkpoints would outrank this run's (pruning would delete this run's own, and
    resume=auto would continue the other run), its later trajectory files and step_N/ models would
    show as this run's steps, its final/ and eval_final.json as this run's results. A directory
    holding only what `agentrl eval` or `agentrl rollout` wrote (their config.yaml and results,
    made before any training run) held no earlier run: that stays, this run's recipe replacing
    their config.yaml as it does when they write beside a training run.

    Nothing is deleted: a previous/ already there (an even earlier run, or the run a first restart
    set aside before it failed) becomes previous.1/, previous.2/, ... in the order they were set
    aside, so a second restart cannot lose the run the first one moved."""
    found = [name for name in EARLIER_RUN if (run_dir / name).exists()]
    steps = [p.name for p in run_dir.iterdir() if STEP_MODEL.fullmatch(p.name) and p.is_dir()]
    if not steps and not any(name in TRAINING_EVIDENCE for name in found):  # nothing, or an eval's or rollout's
        return
    results = sorted(p.name for p in run_dir.iterdir() if EARLIER_RESULTS.fullmatch(p.name))
    previous, older = fresh_previous(run_dir)
    for name in found + steps + results:
        os.replace(run_dir / name, previous / name)
    listed = ", ".join(found + ([f"{len(steps)} step_N/"] if steps else []) + results)
    hint = "it had no checkpoint to resume" if resuming else "trainer.resume=auto continues a run instead"
    kept = f"; the previous/ before it is now {older}" if older else ""
    print(f"agentrl: {run_dir} held an earlier run ({listed}); moved to {previous} ({hint}){kept}", file=sys.stderr)


def fresh_previous(run_dir: Path) -> tuple[Path, Path | None]:
    """An empty previous/ in `run_dir`, and where the one already there went (previous.N/), if any."""
    previous, older = run_dir / "previous", None
    if previous.exists() or previous.is_symlink():
        older = next(run_dir / f"previous.{n}" for n in itertools.count(1)
                     if not (run_dir / f"previous.{n}").exists() and not (run_dir / f"previous.{n}").is_symlink())
        os.replace(previous, older)
    previous.mkdir()
    return previous, older


def drop_steps_after(run_dir: Path, done: int) -> None:
    """Removes the trajectory files and step_N/ models that the interrupted run wrote for steps after
    `done`, the checkpoint the run resumes from: the resumed run writes its own as it reaches those
    steps, and a run that stops sooner would otherwise show the other run's as its own (as
    metrics.jsonl drops their lines and TensorBoard purges their events)."""
    for path in (run_dir / "trajectories").glob("step_*.jsonl"):
        number = path.stem.removeprefix("step_")
        if number.isdigit() and int(number) > done:
            path.unlink()
    for path in run_dir.iterdir():
        if STEP_MODEL.fullmatch(path.name) and path.is_dir() and int(path.name.removeprefix("step_")) > done:
            shutil.rmtree(path)  # check_run_dir made sure each holds a saved model and nothing else
    # The evaluations of those models, and of the final/ this run saves anew, read as this run's
    # results beside its models (a fresh run moves them with the rest of the earlier run).
    stale = sorted(path.name for path in run_dir.iterdir() if (match := STALE_EVAL.fullmatch(path.name))
                   and (match["model"] == "final" or int(match["model"].removeprefix("step_")) > done))
    if stale:
        previous, older = fresh_previous(run_dir)
        for name in stale:
            os.replace(run_dir / name, previous / name)
        kept = f"; the previous/ before it is now {older}" if older else ""
        print(f"agentrl: moved the evaluations of models this run replaces ({', '.join(stale)}) to {previous}{kept}",
              file=sys.stderr)


def run_steps(config: RecipeConfig, roles: Roles, pool: list[Task], run_dir: Path) -> list[dict[str, float]]:
    """The RL steps, from the newest checkpoint when resuming; returns the metrics of every step."""
    t, a, r = config.trainer, config.algorithm, config.rollout
    history: list[dict[str, float]] = []
    done = 0  # completed steps; the step number is also the data cursor
    checkpoint = latest_checkpoint(run_dir) if t.resume == "auto" else None
    if checkpoint is not None:
        done, history = roles.load_checkpoint(checkpoint)
        roles.sync_weights(version=done)
        drop_steps_after(run_dir, done)
        print(f"resumed from {checkpoint} after step {done}")
    else:
        set_aside_earlier_run(run_dir, resuming=t.resume == "auto")
    # Only now: an earlier run's recipe goes to previous/ with its results, and a run that failed to
    # start leaves the recipe of the results beside it alone.
    (run_dir / "config.yaml").write_text(run_config_yaml(config))
    # The Ray actors' table likewise: the roles started before an earlier run's files, its table
    # among them, went to previous/.
    workers = roles.worker_table()
    if workers:
        (run_dir / "workers.json").write_text(json.dumps(workers, indent=2))
    # The dtypes `auto` chose (the probe is cached per process; Ray actors probe the same machine).
    dtypes = {"engine_bf16": float(choose_dtype(config.model.dtype, config.engine.device).dtype == "bfloat16"),
              "trainer_bf16": float(choose_dtype(t.dtype, t.device).dtype == "bfloat16")}
    with RunLogger(run_dir, config.model_dump(mode="json"), t.steps, t.wandb_project, start_step=done,
                   history=history) as logger:
        for step in range(done + 1, t.steps + 1):
            tasks = [pool[i % len(pool)] for i in range((step - 1) * t.tasks_per_step, step * t.tasks_per_step)]
            clock = step_started = time.perf_counter()
            trajectories = roles.collect(tasks)
            rollout = summarize(trajectories, time.perf_counter() - clock)
            times = {"time_rollout_s": time.perf_counter() - clock}
            write_jsonl(trajectories, run_dir / "trajectories" / f"step_{step}.jsonl", step=step)
            check_failures(f"step {step}", trajectories, t.max_failed_fraction)

            roles.release_memory()
            update = learn(trajectories, r.group_size, a, roles.policy, roles.reference, roles.critic, times)

            clock = time.perf_counter()
            roles.resume_memory(("weights",))  # the weights first: the KV cache is not needed to load them
            roles.sync_weights(version=step)
            roles.resume_memory(("kv_cache",))
            times["time_sync_s"] = time.perf_counter() - clock
            times["time_step_s"] = time.perf_counter() - step_started  # the phases and what runs between them

            record = step_record(step, trajectories, rollout, update, times, roles.weight_version())
            record.update(dtypes)
            history.append(record)
            logger.log(step, record)
            if t.save_every and step % t.save_every == 0:
                roles.save_model(run_dir / f"step_{step}")
                roles.save_checkpoint(run_dir, step, history)
    return history
