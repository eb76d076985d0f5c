"""GPU memory an engine in the trainer's process hands back while the trainer runs, and takes again.

On CUDA, tensors allocated inside `region(tag)` come from torch-memory-saver's allocator; `pause(tag)`
unmaps their physical memory (the virtual addresses stay valid, so no tensor is rebuilt) and
`resume(tag)` maps new memory behind them. The "weights" region keeps a CPU copy across a pause, so
buffers that a weight sync does not overwrite (rotary tables) survive; the "kv_cache" region does not,
because whatever it held is scratch by the time the engine resumes. On any other device every call
is a no-op. This is the only module that imports torch_memory_saver; it does not decide when to
release (the training loop does) and does not apply to SGLang, which manages its own regions.

torch-memory-saver runs in its "torch" hook mode (a pluggable allocator behind a torch MemPool),
which needs no LD_PRELOAD, so it works inside an already-running trainer process.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext

import torch

TAGS = ("weights", "kv_cache")  # what an engine can release, in the order it takes them back


class MemorySaver:
    """The no-op saver: CPU, or CUDA without torch-memory-saver installed."""

    enabled = False

    def region(self, tag: str) -> AbstractContextManager:
        return nullcontext()

    def pause(self, tag: str) -> None:
        return None

    def resume(self, tag: str) -> None:
        return None


class TorchMemorySaver(MemorySaver):
    """torch-memory-saver regions on the current CUDA device; pause/resume are idempotent per tag."""

    enabled = True

    def __init__(self) -> None:
        from torch_memory_saver import torch_memory_saver

        try:
            torch_memory_saver.hook_mode = "torch"
        except (AssertionError, AttributeError):  # already initialised in this process: keep its mode
            pass
        self._saver = torch_memory_saver
        self._paused: set[str] = set()

    def region(self, tag: str) -> AbstractContextManager:
        _check_tag(tag)
        return self._saver.region(tag=tag, enable_cpu_backup=tag == "weights")

    def pause(self, tag: str) -> None:
        _check_tag(tag)
        if tag not in self._paused:
            torch.cuda.synchronize()  # no kernel may still be using the memory
            self._saver.pause(tag)
            self._paused.add(tag)

    def resume(self, tag: str) -> None:
        _check_tag(tag)
        if tag in self._paused:
            self._saver.resume(tag)
            self._paused.discard(tag)


def _check_tag(tag: str) -> None:
    if tag not in TAGS:
        raise ValueError(f"memory tag '{tag}': expected one of {', '.join(TAGS)}")


def memory_saver_for(device: str | torch.device) -> MemorySaver:
    """The saver for an engine on `device`: torch-memory-saver on CUDA when installed, else no-op."""
    if torch.device(device).type != "cuda":
        return MemorySaver()
    try:
        return TorchMemorySaver()
    except ImportError:
        print("agentrl: torch-memory-saver is not installed, so the engine keeps its GPU memory while "
              "the trainer runs (pip install \"agentrl[sglang]\" installs it)", file=sys.stderr)
        return MemorySaver()
