"""What training writes to disk, each directory written beside its target and renamed into place,
so a killed run never leaves a half-written one.

- Model directories (`save_pretrained` with the tokenizer): `step_N/`, `final/`. Under FSDP the
  full weights are gathered to rank 0, which writes them.
- Resumable checkpoints, `checkpoints/step_N/`: the policy's (and critic's) model and optimizer
  state saved sharded with torch.distributed.checkpoint (each rank writes its own shard; a run can
  resume at another world size), and `trainer_state.pt` with what the driver keeps: the step (which
  is also the data cursor), the metrics so far, the learning-rate schedules, the batch-order RNGs,
  every engine replica's sampling RNG and torch's global RNG; beside each sharded state, every
  rank's own torch RNGs (`torch_rng_rank<N>.pt`); and `recipe.json`, the run's settings, which a
  resumed run is compared with (train.check_resume). The newest complete one is found by
  `latest_checkpoint`; older ones are pruned to `trainer.keep_checkpoints`.

A checkpoint directory is complete exactly when it has its final name.

A model directory is saved by replacing whatever is at its path, so a save refuses a path that holds
anything a model save would not have written (`check_replaceable`): a user's own files are never
deleted to make room for a model. `agentrl sft` checks `sft.output` this way before it loads a model.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.trainer.distributed import Ranks

TRAINER_STATE = "trainer_state.pt"
RECIPE = "recipe.json"  # the settings of the run that wrote a checkpoint, readable without torch
RNG_PREFIX = "torch_rng_rank"  # + rank + .pt, beside each sharded state
_STEP_DIR = re.compile(r"^step_(\d+)$")


# What a model save writes: save_pretrained's config, weights and index, the tokenizer's files and
# chat template, peft's adapter files and model card; a critic's value_head.pt beside its decoder/.
_MODEL_MARKERS = ("config.json", "adapter_config.json", "value_head.pt")
_SAVED_FILE = re.compile(r".+\.(json|safetensors|bin|jinja|model)|merges\.txt|vocab\.txt|README\.md|value_head\.pt")


def foreign_entries(path: Path) -> list[str]:
    """The entries of directory `path` that no model save writes: none for an empty directory or a
    saved model; every entry where no model marker (config.json, adapter_config.json, a critic's
    value_head.pt) says it holds one."""
    entries = sorted(path.iterdir())
    if entries and not any((path / marker).is_file() for marker in _MODEL_MARKERS):
        return [entry.name + "/" * entry.is_dir() for entry in entries]
    critic = (path / "value_head.pt").is_file()
    return [entry.name + "/" * entry.is_dir() for entry in entries
            if not (entry.is_file() and _SAVED_FILE.fullmatch(entry.name))
            and not (critic and entry.name == "decoder" and entry.is_dir() and (entry / "config.json").is_file()
                     and not foreign_entries(entry))
            # a tokenizer with several chat templates saves the others here
            and not (entry.name == "additional_chat_templates" and entry.is_dir()
                     and all(f.is_file() and f.suffix == ".jinja" for f in entry.iterdir()))]


def check_replaceable(path: str | Path, key: str | None = None) -> None:
    """A model save may replace `path`: it does not exist, or is a directory that is empty or holds a
    saved model and nothing else (foreign_entries). Otherwise a ConfigError naming `key` (the recipe
    key that chose the path, when there is one) and the path."""
    path = Path(path)
    where = f"{key}: {path}" if key else str(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"{where} is a file; a model is saved as a directory, so choose another path")
    foreign = foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(f"{where} holds files that are not a saved model ({shown}); saving a model replaces the "
                          "whole directory, so choose another path or move them")


# A model save's own directories beside its target: `.<name>.agentrl-<12 hex digits>`, a name no user
# folder has by chance. A fixed name (`final.old`, `sft.tmp`) may be a user's own folder, which
# clearing an interrupted save's leftovers would delete.
_SAVE_TAG = ".agentrl-"


def _is_save_leftover(entry: Path, name: str) -> bool:
    """`entry` is a staging or set-aside directory of an interrupted save of `name`."""
    return (entry.is_dir() and not entry.is_symlink()
            and re.fullmatch(re.escape(f".{name}{_SAVE_TAG}") + r"[0-9a-f]{12}", entry.name) is not None)


def _save_directory(path: Path) -> Path:
    """A new, empty directory beside `path` with a name of a save's own (_SAVE_TAG); made with the
    process's umask, so the model directory it becomes has the permissions of any other."""
    while True:
        candidate = _save_name(path)
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:  # drawn twice: draw again
            continue


def _save_name(path: Path) -> Path:
    """An unused name of a save's own beside `path`, not created: the old target is renamed to it,
    and renaming a symlinked target (final -> /big/disk/final) onto a directory fails."""
    while True:
        candidate = path.with_name(f".{path.name}{_SAVE_TAG}{secrets.token_hex(6)}")
        if not os.path.lexists(candidate):
            return candidate


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yields a staging directory; on success it replaces `path`, which check_replaceable allows.

    The old directory is renamed aside before the new one is renamed in, and deleted only after:
    deleted in place, file by file, a signal in between (a scheduler's time limit) left a model
    directory without its config.json, which every later launch refused. The staging and set-aside
    directories have names of their own (_SAVE_TAG), and only directories so named are removed as
    an interrupted save's leftovers: whatever else is beside the target stays."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.iterdir():  # of a save interrupted before
        if _is_save_leftover(leftover, path.name):
            shutil.rmtree(leftover, ignore_errors=True)
    staging = _save_directory(path)
    yield staging
    sync_tree(staging)  # on disk before the old directory goes (see commit_checkpoint)
    old = None
    if os.path.lexists(path):
        old = _save_name(path)
        os.replace(path, old)  # a symlinked target: the link moves aside, what it points to stays
    os.replace(staging, path)
    _sync_directory(path.parent)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full weights of a sharded model on rank 0 (CPU), a collective; None when not sharded."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # One tensor per parameter, under its first name: a tied head (lm_head.weight, the embedding's
    # parameter) comes back as a copy of its own, which save_pretrained wrote twice (113 MB more
    # for SmolLM2-135M in fp32 than the unsharded save).
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    for tied in names.values():
        for name in tied[1:]:
            state.pop(name, None)
    return state


def unsharded_class(model: torch.nn.Module) -> type:
    """The model's own class (FSDP2 wraps it in a generated subclass named FSDP<Class>)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def save_model(model: torch.nn.Module, tokenizer: Any, path: str | Path, rank: int = 0) -> None:
    """A save_pretrained directory with the tokenizer: loads in transformers or SGLang as it is.
    Every rank calls it (gathering sharded weights is a collective); rank 0 writes."""
    state = full_state_dict(model)
    if rank != 0:
        return
    with atomic_directory(path) as staging:
        lora = hasattr(model, "peft_config")  # a LoRA model writes its adapters only
        # peft's default ("auto") looks the base model up on the hub when its name is not a
        # directory (a builtin's is not), to see whether the vocabulary was resized; training
        # never resizes it, and nothing here may reach the network.
        model.save_pretrained(staging, state_dict=state, **({"save_embedding_layers": False} if lora else {}))
        if state is not None and not lora:
            # save_pretrained records the FSDP wrapper's class name; record the model's own
            config = model.config.__class__.from_pretrained(staging)
            config.architectures = [unsharded_class(model).__name__]
            config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def _training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, Any]:
    """(model state, options) without frozen weights (a LoRA model's base is not training state).
    torch's ignore_frozen_params misses a tied head, so the model state keeps trainable names only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = any(not p.requires_grad for p in model.parameters())
    options = StateDictOptions(ignore_frozen_params=True, strict=not frozen)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if frozen:
        model_state = {name: value for name, value in model_state.items() if name in trainable}
    return {"model": model_state, "optim": optim_state}, options


def save_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: "Ranks") -> None:
    """Model and optimizer state with torch.distributed.checkpoint; all ranks call it."""
    import torch.distributed.checkpoint as dcp

    state, _ = _training_state(model, optimizer)
    with warnings.catch_warnings():  # one process is a valid case, not a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=not ranks.distributed)
    torch.save(_rng_state(), Path(path) / f"{RNG_PREFIX}{ranks.rank}.pt")


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: "Ranks",
                 shaped_by: str = "model.path and model.lora") -> None:
    """Model and optimizer state from `save_sharded`'s files. The optimizer's settings (lr,
    weight_decay, betas) stay those it was built with, the recipe's: a run resumed with a new
    trainer.lr uses it; only the state (moments, step counts) comes from the checkpoint. A
    checkpoint of another model or LoRA layout is a ConfigError naming it and the settings that
    shape the model (`shaped_by`); one that cannot be read, a ConfigError naming it too (unreadable)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    state, options = _training_state(model, optimizer)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=not ranks.distributed)
    except (Exception, CheckpointException) as e:  # its text holds tracebacks; the first missing key or size says it
        found = re.search(r"Missing key in checkpoint state_dict: [\w.]+|[Ss]ize mismatch[^\n]*", str(e))
        if found is None and damaged(e):  # a file missing, cut short or garbled
            raise unreadable(Path(path), e) from None
        if found is None:  # anything else (out of memory, a collective's failure): as it is
            raise
        raise ConfigError(f"{path}: the checkpoint does not fit this run's model ({found.group(0).rstrip('.')}); "
                          f"resume with the {shaped_by} settings of the run that wrote it") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    for group, configured in zip(optimizer.param_groups, settings):
        group.update(configured)
    rng = Path(path) / f"{RNG_PREFIX}{ranks.rank}.pt"
    if rng.is_file():  # absent where the checkpoint was written at a smaller world size
        _set_rng_state(read_checkpoint_file(rng))


def read_checkpoint_file(path: Path) -> Any:
    """A torch file of a checkpoint; one that cannot be read is a ConfigError saying what to do."""
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:
        if not damaged(e):  # a pickled class this code no longer has, out of memory: not the file's fault
            raise
        raise unreadable(path, e) from None


def _causes(error: BaseException) -> list[BaseException]:
    """The errors behind a failed read: each rank's for dcp's CheckpointException, else the error."""
    failures = getattr(error, "failures", None)  # {rank: (error, traceback)}
    causes = [f[0] for f in failures.values() if isinstance(f, tuple)] if isinstance(failures, dict) else []
    return causes or [error]


def damaged(error: BaseException) -> bool:
    """Whether reading a checkpoint failed on the file itself: missing, cut short or garbled (for
    dcp, any rank's failure was)."""
    return any(isinstance(cause, (OSError, EOFError, pickle.UnpicklingError))
               or isinstance(cause, RuntimeError) and "PytorchStreamReader" in str(cause)  # not a zip archive
               or isinstance(cause, AssertionError) and "metadata" in str(cause)  # dcp's .metadata missing
               for cause in _causes(error))


def unreadable(path: Path, error: BaseException) -> ConfigError:
    """The error for a checkpoint file (or directory) that cannot be read: named, with its reason
    on one line and the way on. A run killed while saving leaves no such checkpoint (it is renamed
    into place only once complete); a disk fault or a partial copy does, and every resume would
    meet it, as trainer.resume 'auto' takes the newest checkpoint."""
    step = next((p for p in (path, *path.parents) if _STEP_DIR.match(p.name)), path)
    error = _causes(error)[0]
    reason = (str(error).strip().splitlines() or [""])[0][:300]
    return ConfigError(f"{path}: cannot read this checkpoint ({type(error).__name__}{': ' + reason if reason else ''})"
                       f"; if it is damaged, delete {step} to resume from the checkpoint before it")


def _rng_state() -> dict[str, Any]:
    """This process's torch RNGs: the dropout of a rank's forward passes (LoRA's) draws from them,
    and under Ray a rank is its own process, which the driver's saved RNG does not cover."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_checkpoint(run_dir: str | Path, step: int) -> Path:
    """An empty staging directory for step `step`'s checkpoint (a leftover one is removed)."""
    staging = checkpoint_root(run_dir) / f"step_{step}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_checkpoint(staging: Path, keep: int) -> Path:
    """Rename the staging directory into place, then prune to the newest `keep` checkpoints. Its
    files reach the disk before the rename and the rename before any pruning: after a power cut
    or an OS crash, a checkpoint under its final name has its contents, and the older ones it
    replaces are gone only once it is there."""
    final = staging.with_name(staging.name.removesuffix(".tmp"))
    shutil.rmtree(final, ignore_errors=True)
    sync_tree(staging)
    os.replace(staging, final)
    _sync_directory(final.parent)
    for old in complete_checkpoints(staging.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def sync_tree(path: Path) -> None:
    """fsync every file and directory under `path` (a process crash loses nothing written; a power
    cut loses what the OS had not written yet)."""
    for directory, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())
        _sync_directory(Path(directory))


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
             and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoint_root(run_dir))
    return found[-1] if found else None
