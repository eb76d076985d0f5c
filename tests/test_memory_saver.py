"""The transformers engine's memory release: torch-memory-saver regions on CUDA, no-ops elsewhere.

torch-memory-saver needs CUDA, so on CPU the wiring is checked with a saver that records what the
engine asks of it; the GPU test (skipped without CUDA) checks that release really frees the
engine's memory and that resume gives the same greedy output.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from importlib.util import find_spec

import pytest
import torch

from agentrl.recipe import load_recipe
from agentrl.models import load_model
from agentrl.rollout import run as run_module
from agentrl.rollout.hf_engine import HFEngine
from agentrl.rollout.memory_saver import MemorySaver, TorchMemorySaver, memory_saver_for
from agentrl.types import SamplingParams

PROMPT = [1, 504, 3459, 30, 2, 198]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


class RecordingSaver(MemorySaver):
    """Records the engine's requests; stands in for torch-memory-saver, which cannot run without CUDA."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    @contextmanager
    def region(self, tag: str):
        self.calls.append(("enter", tag))
        yield
        self.calls.append(("exit", tag))

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))


def test_cpu_saver_is_a_no_op_and_the_engine_output_is_unchanged(tiny_model):
    saver = memory_saver_for("cpu")
    assert type(saver) is MemorySaver and not saver.enabled
    engine = HFEngine(tiny_model, pad_token_id=2, memory_saver=saver)
    before = engine.generate_batch([PROMPT], [greedy(8)])[0]
    engine.release_memory()
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache",))
    assert engine.generate_batch([PROMPT], [greedy(8)])[0].token_ids == before.token_ids


def test_cuda_without_torch_memory_saver_says_so_and_keeps_memory(capsys):
    if find_spec("torch_memory_saver") is not None:
        pytest.skip("torch-memory-saver is installed here")
    saver = memory_saver_for("cuda")  # needs no GPU: the import fails first
    assert type(saver) is MemorySaver
    assert "torch-memory-saver is not installed, so the engine keeps its GPU memory" in capsys.readouterr().err


def test_engine_decodes_in_the_kv_region_releases_both_and_resumes_in_order(tiny_model):
    saver = RecordingSaver()
    engine = HFEngine(tiny_model, pad_token_id=2, memory_saver=saver)
    engine.generate_batch([PROMPT], [greedy(3)])
    assert saver.calls == [("enter", "kv_cache"), ("exit", "kv_cache")]
    saver.calls.clear()
    engine.release_memory()
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache",))
    engine.resume_memory(("kv_cache", "weights"))  # any order asked: weights come back first
    assert saver.calls == [("pause", "kv_cache"), ("pause", "weights"), ("resume", "weights"),
                           ("resume", "kv_cache"), ("resume", "weights"), ("resume", "kv_cache")]


def test_release_holds_the_decode_lock_and_released_memory_is_never_used(tiny_model):
    saver = RecordingSaver()
    engine = HFEngine(tiny_model, pad_token_id=2, memory_saver=saver)
    held: list[bool] = []
    saver.pause = saver.resume = lambda tag: held.append(engine._lock.locked())  # a decode could not run meanwhile
    engine.release_memory()
    with pytest.raises(RuntimeError, match=r"^HFEngine.generate: the engine's weights and kv_cache memory is "
                                           r"released; call resume_memory first$"):
        asyncio.run(engine.generate(PROMPT, greedy(3)))  # through the decode thread: the request fails, no crash
    with pytest.raises(RuntimeError, match=r"^HFEngine.update_weights: the engine's weights memory is released"):
        engine.update_weights([], version=1)
    engine.resume_memory(("weights",))
    engine.update_weights([], version=1)  # a sync needs the weights only
    assert engine.score(PROMPT, 1)
    with pytest.raises(RuntimeError, match=r"^HFEngine.generate: the engine's kv_cache memory is released"):
        engine.generate_batch([PROMPT], [greedy(3)])
    engine.resume_memory(("kv_cache",))
    assert len(engine.generate_batch([PROMPT], [greedy(3)])[0].token_ids) == 3
    assert held == [True] * 4


def test_build_engine_moves_the_weights_to_the_device_inside_the_weights_region(tiny_model_dir, monkeypatch):
    saver = RecordingSaver()
    monkeypatch.setattr(run_module, "memory_saver_for", lambda device: saver)
    moved: list[list[tuple[str, str]]] = []
    original_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(list(saver.calls)) or
                        original_to(self, *a, **k))
    engine = run_module.build_engine(load_recipe(None, [f"model.path={tiny_model_dir}"]), pad_token_id=2)
    assert engine.memory_saver is saver
    assert moved == [[("enter", "weights")]] and saver.calls == [("enter", "weights"), ("exit", "weights")]


def test_torch_saver_rejects_unknown_tags():
    saver = TorchMemorySaver.__new__(TorchMemorySaver)  # no CUDA needed to check the tag
    with pytest.raises(ValueError, match=r"memory tag 'kv': expected one of weights, kv_cache"):
        saver.pause("kv")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or find_spec("torch_memory_saver") is None,
                    reason="needs CUDA and torch-memory-saver (pip install \"agentrl[sglang]\")")
def test_release_frees_the_engines_gpu_memory_and_resume_gives_the_same_output(smollm2_dir):
    saver = memory_saver_for("cuda")
    assert saver.enabled
    torch.zeros(1, device="cuda")  # the CUDA context first; cuBLAS is the saver's to warm, outside its regions
    torch.cuda.synchronize()
    free_start = torch.cuda.mem_get_info()[0]
    with saver.region("weights"):
        model = load_model(str(smollm2_dir), "float32").to("cuda")
    engine = HFEngine(model, pad_token_id=2, memory_saver=saver)
    prompts = [PROMPT] * 8
    before = engine.generate_batch(prompts, [greedy(64)] * 8)
    torch.cuda.synchronize()
    engine_bytes = free_start - torch.cuda.mem_get_info()[0]  # weights plus the KV-cache pool
    weight_bytes = sum(t.nbytes for t in model.state_dict().values())
    assert engine_bytes >= weight_bytes
    asyncio.run(engine.generate(PROMPT, greedy(4)))  # in the decode thread, whose cuBLAS handle outlives it
    assert engine.wait_idle()
    # torch's memory_reserved() cannot see this: torch-memory-saver unmaps the pages behind the
    # allocator's back, so the driver's free memory is what measures the release.
    free_before = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    freed = torch.cuda.mem_get_info()[0] - free_before
    assert freed >= 0.9 * engine_bytes, (freed, engine_bytes)
    products: list[float] = []

    def train_step() -> None:  # the trainer's products meanwhile: a new thread takes the decode thread's handle
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(128, 128, device="cuda", dtype=dtype)  # 129 per entry: exact in bfloat16 too
            products.append(torch.nn.functional.linear(x, x, x[0]).float().sum().item())

    trainer = threading.Thread(target=train_step)
    trainer.start()
    trainer.join()
    assert products == [129.0 * 128 * 128] * 2
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache",))
    after = engine.generate_batch(prompts, [greedy(64)] * 8)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
