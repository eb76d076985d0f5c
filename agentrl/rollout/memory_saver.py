"""GPU memory an engine in the trainer's process hands back while the trainer runs, and takes again.

On CUDA, tensors allocated inside `region(tag)` come from torch-memory-saver's allocator; `pause(tag)`
unmaps their physical memory (the virtual addresses stay valid, so no tensor is rebuilt) and
`resume(tag)` maps new memory behind them. The "weights" region keeps a CPU copy across a pause, so
buffers that a weight sync does not overwrite (rotary tables) survive; the "kv_cache" region does not,
because whatever it held is scratch by the time the engine resumes. On any other device every call
is a no-op. This is the only module that imports torch_memory_saver; it does not decide when to
release (the training loop does) and does not apply to SGLang, which manages its own regions.

torch-memory-saver runs in its "torch" hook mode (a pluggable allocator behind a torch MemPool),
which needs no LD_PRELOAD, so it works inside an already-running trainer process. Inside a region
every CUDA allocation of the calling thread goes to the region's pool, whatever allocates it, and
torch-memory-saver picks the pool by the current CUDA device: so regions, pauses and resumes run
with the engine's device current, and each thread warms cuBLAS before its first region (below).
"""

from __future__ import annotations

import sys
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

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


def warm_cublas(device: torch.device) -> None:
    """Matrix products in float32 and bfloat16 (with a bias: cuBLASLt's path) on `device`.

    PyTorch allocates the cuBLAS/cuBLASLt workspace of a (handle, stream) through its caching
    allocator on the first product and keeps it for the life of the process; handles belong to a
    thread until it ends, then go to the next thread that asks. A workspace first allocated inside
    a region would be unmapped by its pause, and whichever thread gets that handle next (the
    trainer, after a decode thread ended) would multiply into unmapped memory: an illegal memory
    access. Warmed here, outside any region, the workspace lives in ordinary memory.
    """
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(8, 8, device=device, dtype=dtype)
        torch.nn.functional.linear(a @ a, a, a[0])


class TorchMemorySaver(MemorySaver):
    """torch-memory-saver regions on the engine's CUDA device; pause/resume are idempotent per tag."""

    enabled = True

    def __init__(self, device: str | torch.device) -> None:
        from torch_memory_saver import torch_memory_saver

        try:
            torch_memory_saver.hook_mode = "torch"
        except (AssertionError, AttributeError):  # already initialised in this process: keep its mode
            pass
        self._saver = torch_memory_saver
        device = torch.device(device)
        # "cuda" means the device current now; a thread started later would take device 0 for it.
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self._paused: dict[str, int] = {}  # tag → bytes its pause gave back to the driver
        self._warm = threading.local()  # whether this thread's cuBLAS workspace is allocated yet

    @contextmanager
    def region(self, tag: str) -> Iterator[None]:
        _check_tag(tag)
        with torch.cuda.device(self.device):
            if not getattr(self._warm, "done", False):  # the thread's first region: warm it outside
                warm_cublas(self.device)
                self._warm.done = True
            with self._saver.region(tag=tag, enable_cpu_backup=tag == "weights"):
                yield

    def pause(self, tag: str) -> None:
        _check_tag(tag)
        if tag not in self._paused:
            with torch.cuda.device(self.device):
                torch.cuda.synchronize()  # no kernel may still be using the memory
                free_before = torch.cuda.mem_get_info()[0]
                self._saver.pause(tag)
                # torch-memory-saver (0.0.10) does not report the size of a tag's allocations on
                # CUDA, so the driver's free memory measures what the resume will map again.
                self._paused[tag] = max(0, torch.cuda.mem_get_info()[0] - free_before)

    def resume(self, tag: str) -> None:
        _check_tag(tag)
        if tag in self._paused:
            with torch.cuda.device(self.device):
                # The trainer's freed activations and gradients stay in PyTorch's cache, which the
                # resume's own allocations (outside that cache) cannot use: give them back first.
                torch.cuda.empty_cache()
                needed, free = self._paused[tag], torch.cuda.mem_get_info()[0]
                if free < needed:  # torch-memory-saver would exit the process, with no traceback
                    raise torch.cuda.OutOfMemoryError(
                        f"resuming the engine's {tag} memory needs {_mib(needed)} on {self.device}, but "
                        f"{_mib(free)} is free there after emptying PyTorch's cache: tensors still alive "
                        f"(the trainer's) or another process hold the rest; the {tag} memory stays released")
                self._saver.resume(tag)
            del self._paused[tag]


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _check_tag(tag: str) -> None:
    if tag not in TAGS:
        raise ValueError(f"memory tag '{tag}': expected one of {', '.join(TAGS)}")


def memory_saver_for(device: str | torch.device) -> MemorySaver:
    """The saver for an engine on `device`: torch-memory-saver on CUDA when installed, else no-op."""
    if torch.device(device).type != "cuda":
        return MemorySaver()
    try:
        return TorchMemorySaver(device)
    except ImportError:
        print("agentrl: torch-memory-saver is not installed, so the engine keeps its GPU memory while "
              "the trainer runs (pip install \"agentrl[sglang]\" installs it)", file=sys.stderr)
        return MemorySaver()
