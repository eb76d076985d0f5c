"""dtype 'auto': bfloat16 only where the hardware computes it faster, with the reason printed once."""

from __future__ import annotations

import pytest
import torch

from agentrl import hardware
from agentrl.recipe import load_recipe
from agentrl.errors import ConfigError
from agentrl.hardware import choose_dtype


@pytest.fixture(autouse=True)
def fresh_choice():
    hardware._auto.cache_clear()
    yield
    hardware._auto.cache_clear()


def fake_probe(monkeypatch, flags: dict[str, bool], ms: dict[torch.dtype, float]) -> list[torch.dtype]:
    """The CPU's flags and the probe's timings as given; returns the dtypes the probe ran."""
    probed: list[torch.dtype] = []
    monkeypatch.setattr(hardware, "cpu_bf16_support", lambda: flags)

    def timing(dtype, device, repeats=5):
        probed.append(dtype)
        return ms[dtype]

    monkeypatch.setattr(hardware, "matmul_ms", timing)
    return probed


def test_a_cpu_without_bf16_units_stays_float32_without_probing(monkeypatch, capsys):
    probed = fake_probe(monkeypatch, {"amx": False, "avx512_bf16": False}, {})
    choice = choose_dtype("auto", "cpu")
    assert (choice.dtype, choice.float32_ms) == ("float32", None) and probed == []
    assert capsys.readouterr().err == ("agentrl: dtype auto on cpu: float32 (the CPU has neither AMX nor "
                                       "AVX512-BF16, so bf16 would be emulated)\n")


def test_the_probe_decides_on_a_cpu_with_avx512_bf16(monkeypatch, capsys):
    fake_probe(monkeypatch, {"amx": False, "avx512_bf16": True}, {torch.float32: 44.0, torch.bfloat16: 17.7})
    choice = choose_dtype("auto", "cpu")
    assert choice.dtype == "bfloat16" and choice.torch_dtype is torch.bfloat16
    assert choice.reason == "AVX512-BF16; probe matmul float32 44.0 ms, bfloat16 17.7 ms"
    assert choose_dtype("auto", "cpu") is choice  # probed and printed once per process and device
    assert capsys.readouterr().err.count("agentrl: dtype auto on cpu: bfloat16") == 1


def test_bf16_that_is_not_clearly_faster_is_not_chosen(monkeypatch):
    fake_probe(monkeypatch, {"amx": True, "avx512_bf16": True}, {torch.float32: 20.0, torch.bfloat16: 19.0})
    choice = choose_dtype("auto", "cpu")
    assert choice.dtype == "float32" and choice.reason.startswith("AMX and AVX512-BF16; probe matmul float32 20.0 ms")


def test_an_explicit_dtype_is_kept_and_a_bad_one_refused(monkeypatch):
    fake_probe(monkeypatch, {"amx": True, "avx512_bf16": True}, {})  # would fail if probed
    assert choose_dtype("float32", "cpu") == hardware.DtypeChoice("float32", "set in the recipe")
    assert choose_dtype("bfloat16", "cpu").torch_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto', 'float32' or 'bfloat16', got 'float16'"):
        choose_dtype("float16", "cpu")


def test_the_real_probe_times_both_dtypes():
    ms = hardware.matmul_ms(torch.float32, torch.device("cpu"), repeats=1)
    assert ms > 0 and hardware.matmul_ms(torch.bfloat16, torch.device("cpu"), repeats=1) > 0


def test_recipe_dtypes_default_to_auto_and_read_the_old_autocast_key():
    config = load_recipe(None)
    assert (config.model.dtype, config.trainer.dtype, config.sft.dtype) == ("auto", "auto", "auto")
    old = load_recipe(None, ["trainer.bf16_autocast=true", "sft.bf16_autocast=false"])
    assert (old.trainer.dtype, old.sft.dtype) == ("bfloat16", "float32")
    with pytest.raises(ConfigError, match="trainer.bf16_autocast and trainer.dtype are both set; keep only dtype"):
        load_recipe(None, ["trainer.bf16_autocast=true", "trainer.dtype=float32"])
    with pytest.raises(ConfigError, match="model.dtype: Input should be 'auto', 'float32' or 'bfloat16'"):
        load_recipe(None, ["model.dtype=float16"])


def test_a_gpu_that_only_emulates_bf16_stays_float32(monkeypatch, capsys):
    """No GPU here: torch's answers for a T4 (compute capability 7.5) are given. It "supports"
    bf16 by emulation (torch's default question), which is slower than float32, not faster."""
    import contextlib

    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert hardware.choose_dtype("auto", "cuda") == hardware.DtypeChoice("float32", "Tesla T4 lacks bf16 support")
    assert asked == [False] and "dtype auto on cuda: float32" in capsys.readouterr().err
