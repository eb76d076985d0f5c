"""The torch-memory-saver saver's CUDA calls, on a machine without CUDA.

torch-memory-saver and CUDA cannot run here, so both are replaced at the process boundary: a fake
`torch_memory_saver` module records regions, pauses and resumes, and the few `torch.cuda` calls the
saver makes keep a current device per thread (as CUDA does), the driver's free memory and the
bytes PyTorch's cache holds. What is checked is the order and the device of the calls: cuBLAS
warmed outside any region, the engine's device current in every region, pause and resume, PyTorch's
cache emptied before a resume, and a resume refused with an error when the memory is not there.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import types
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode

from agentrl.rollout import memory_saver
from agentrl.rollout.hf_engine import HFEngine
from agentrl.rollout.memory_saver import memory_saver_for
from agentrl.types import SamplingParams

MiB, GiB = 2**20, 2**30
PROMPT = [1, 504, 3459, 30, 2, 198]
SIZES = {"weights": 2 * GiB, "kv_cache": 3 * GiB}  # what pausing each tag gives back to the driver


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


class FakeCuda:
    """CUDA as the saver sees it: a current device per thread (0 in a new thread), the driver's free
    memory, and PyTorch's cache of freed blocks; every call is logged with the device current then."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.free = 10 * GiB
        self.cached = 0
        self._local = threading.local()

    def current(self) -> int:
        return getattr(self._local, "index", 0)

    @contextmanager
    def device(self, device):
        before, self._local.index = self.current(), torch.device(device).index
        try:
            yield
        finally:
            self._local.index = before

    def set_device(self, device) -> None:
        self._local.index = torch.device(device).index

    def empty_cache(self) -> None:
        self.log.append(("empty_cache", self.current()))
        self.free, self.cached = self.free + self.cached, 0


class FakeTorchMemorySaver:
    """torch_memory_saver.torch_memory_saver: records what it is asked, on which device."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.hook_mode = None

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool):
        self.cuda.log.append(("enter", tag, enable_cpu_backup, self.cuda.current()))
        yield
        self.cuda.log.append(("exit", tag))

    def pause(self, tag: str) -> None:
        self.cuda.log.append(("pause", tag, self.cuda.current()))
        self.cuda.free += SIZES[tag]

    def resume(self, tag: str) -> None:
        self.cuda.log.append(("resume", tag, self.cuda.current()))
        self.cuda.free -= SIZES[tag]


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = FakeTorchMemorySaver(fake)
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.log.append(("synchronize", fake.current())))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (fake.free, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    monkeypatch.setattr(memory_saver, "warm_cublas", raising=False, value=lambda device: fake.log.append(
        ("warm", str(device), fake.current(), threading.current_thread().name)))
    return fake


def test_every_thread_warms_cublas_on_the_engine_device_before_its_first_region(cuda, tiny_model):
    """cuBLAS's workspace is allocated on a thread's first matrix product and kept with its handle;
    inside a region it was unmapped by the release, and the trainer, handed the decode thread's
    handle once that thread ended, multiplied into it (an illegal memory access)."""
    saver = memory_saver_for("cuda:1")
    with saver.region("weights"):  # build_engine loads the model here
        pass
    engine = HFEngine(tiny_model, pad_token_id=2, memory_saver=saver)
    asyncio.run(engine.generate(PROMPT, greedy(2)))  # in the decode thread
    assert engine.wait_idle()
    engine.generate_batch([PROMPT], [greedy(2)])  # in this thread again: warmed already
    main = threading.current_thread().name
    assert cuda.log == [("warm", "cuda:1", 1, main), ("enter", "weights", True, 1), ("exit", "weights"),
                        ("warm", "cuda:1", 1, "agentrl-decode"), ("enter", "kv_cache", False, 1), ("exit", "kv_cache"),
                        ("enter", "kv_cache", False, 1), ("exit", "kv_cache")]


def test_the_warm_up_multiplies_in_float32_and_bfloat16_on_the_given_device():
    products: list[tuple[str, torch.dtype, str]] = []

    class Products(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("matmul", "__matmul__", "linear", "mm", "addmm"):
                products.append((name, args[0].dtype, args[0].device.type))
            return func(*args, **(kwargs or {}))

    with Products():
        memory_saver.warm_cublas(torch.device("cpu"))
    assert products == [("matmul", torch.float32, "cpu"), ("linear", torch.float32, "cpu"),
                        ("matmul", torch.bfloat16, "cpu"), ("linear", torch.bfloat16, "cpu")]


def test_regions_pauses_and_resumes_run_on_the_engine_device(cuda):
    """torch-memory-saver picks its pool by the current device and a new thread's is device 0: with
    the engine on cuda:1 nothing landed in a region, and the pause synchronized the wrong GPU."""
    cuda.set_device("cuda:1")
    saver = memory_saver_for("cuda")  # the device current at construction, not at each call
    cuda.set_device("cuda:0")
    seen: list[int] = []

    def use() -> None:  # a thread of its own, as the decode thread is: device 0 current
        with saver.region("kv_cache"):
            seen.append(cuda.current())
        saver.pause("kv_cache")
        saver.resume("kv_cache")

    thread = threading.Thread(target=use)
    thread.start()
    thread.join()
    assert seen == [1] and cuda.current() == 0
    assert [e for e in cuda.log if e[0] in ("enter", "synchronize", "pause", "resume")] == [
        ("enter", "kv_cache", False, 1), ("synchronize", 1), ("pause", "kv_cache", 1), ("resume", "kv_cache", 1)]
    assert saver.device == torch.device("cuda", 1)


def test_the_decode_thread_makes_the_engine_device_current(tiny_model, monkeypatch):
    engine = HFEngine(tiny_model, pad_token_id=2)
    engine.device = torch.device("cuda", 1)  # only the thread's start reads it here
    seen: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", str(d),
                                                                          threading.current_thread().name)))
    monkeypatch.setattr(engine, "_serve_one",
                        lambda: seen.append(("decode", threading.current_thread().name)) and False)
    thread = threading.Thread(target=engine._serve, name="agentrl-decode")
    thread.start()
    thread.join()
    assert seen == [("set_device", "cuda:1", "agentrl-decode"), ("decode", "agentrl-decode")]


def test_resume_empties_torchs_cache_first_and_refuses_when_the_memory_is_not_there(cuda, tiny_model):
    """The trainer's freed tensors stayed in PyTorch's cache, and a resume that found no memory made
    torch-memory-saver exit the process, with no traceback and no checkpoint."""
    engine = HFEngine(tiny_model, pad_token_id=2, memory_saver=memory_saver_for("cuda:1"))
    engine.release_memory()  # 3 GiB of KV cache, then 2 GiB of weights, back to the driver
    cuda.free, cuda.cached = 1 * GiB, 512 * MiB  # the trainer holds the rest; 512 MiB it freed is cached
    cuda.log.clear()
    message = ("resuming the engine's weights memory needs 2048 MiB on cuda:1, but 1536 MiB is free there after "
               "emptying PyTorch's cache: tensors still alive (the trainer's) or another process hold the rest; "
               "the weights memory stays released")
    with pytest.raises(torch.cuda.OutOfMemoryError, match=f"^{re.escape(message)}$"):
        engine.resume_memory(("weights",))
    assert cuda.log == [("empty_cache", 1)]  # torch-memory-saver was never asked
    with pytest.raises(RuntimeError, match=r"^HFEngine.update_weights: the engine's weights memory is released"):
        engine.update_weights([], version=1)
    cuda.free += 4 * GiB  # the trainer's tensors are gone
    engine.resume_memory()
    assert cuda.log[1:] == [("empty_cache", 1), ("resume", "weights", 1), ("empty_cache", 1), ("resume", "kv_cache", 1)]
    assert cuda.free == 512 * MiB  # 5.5 GiB free, less the 5 GiB mapped again
    engine.update_weights([], version=1)  # resident again
