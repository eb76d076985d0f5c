"""What training writes to disk, each directory written beside its target and renamed into place,
so a killed run never leaves a half-written one: model directories (`save_pretrained`, with the
tokenizer) and resumable training state (one `state.pt`).

A checkpoint holds what the next step needs and a `save_pretrained` directory cannot carry: the
policy's weights with its optimizer and learning-rate schedule, the critic's (when there is one),
the batch-order RNG, the step, the weight version and the metrics so far. Tasks are picked by step
number, so the step is the data cursor. The engine's sampling RNG is not saved: a resumed run draws
other (equally distributed) samples than an uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.trainer.critic import CriticWorker
    from agentrl.trainer.policy import PolicyWorker

STATE_FILE = "state.pt"


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yields a staging directory; on success it replaces `path`."""
    path = Path(path)
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    yield staging
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)


def save_model(model: torch.nn.Module, tokenizer, path: str | Path) -> None:
    """A save_pretrained directory with the tokenizer: loads in transformers or SGLang as it is."""
    with atomic_directory(path) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def save_checkpoint(path: Path, step: int, policy: "PolicyWorker", critic: "CriticWorker | None",
                    history: list[dict[str, Any]]) -> None:
    state = {"step": step, "history": history, "torch_rng": torch.get_rng_state(),
             "policy": {"model": policy.model.state_dict(), "optimizer": policy.optimizer.state_dict(),
                        "scheduler": policy.scheduler.state_dict(), "rng": policy.rng.getstate()}}
    if critic is not None:
        state["critic"] = {"model": critic.model.state_dict(), "optimizer": critic.optimizer.state_dict(),
                           "rng": critic.rng.getstate()}
    with atomic_directory(path) as staging:
        torch.save(state, staging / STATE_FILE)


def load_checkpoint(path: Path, policy: "PolicyWorker", critic: "CriticWorker | None") -> tuple[int, list[dict]]:
    """Restore the workers in place; returns (last completed step, metrics history)."""
    state = torch.load(path / STATE_FILE, weights_only=False)
    if ("critic" in state) != (critic is not None):
        raise ConfigError(f"{path}: the checkpoint was written {'with' if 'critic' in state else 'without'} a "
                         "critic; algorithm.advantage must match the run that wrote it")
    policy.model.load_state_dict(state["policy"]["model"])
    policy.optimizer.load_state_dict(state["policy"]["optimizer"])
    policy.scheduler.load_state_dict(state["policy"]["scheduler"])
    policy.rng.setstate(state["policy"]["rng"])
    if critic is not None:
        critic.model.load_state_dict(state["critic"]["model"])
        critic.optimizer.load_state_dict(state["critic"]["optimizer"])
        critic.rng.setstate(state["critic"]["rng"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["history"]
