"""Which floating-point type runs faster on this machine: the `auto` of `model.dtype`,
`trainer.dtype` and `sft.dtype`.

bfloat16 halves memory traffic, but it is only faster where the hardware computes in it: a CUDA
device that supports it, or a CPU with AMX or AVX512-BF16. Elsewhere bf16 is emulated and runs
several times slower than float32 (FACTS.md measured 3.6× on an AVX-512 CPU without either). On a
CPU that has one of them a short matmul probe (float32 against bfloat16, the shape of a small
model's MLP, about 0.1–0.5 s) decides, because the flags alone do not say how much faster it is.
The choice and its reason are printed to stderr once per process and device, and returned, so a
run can record them. This module chooses a type; it does not convert models or set autocast.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from dataclasses import dataclass

import torch

DTYPES = ("float32", "bfloat16")
PROBE_SHAPE = (512, 576, 1536)  # rows × hidden × MLP width of SmolLM2-135M
MIN_SPEEDUP = 1.1  # bf16 must beat float32 by this factor: a tie is not worth its rounding


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # 'float32' or 'bfloat16'
    reason: str
    float32_ms: float | None = None  # the probe's medians, when it ran
    bfloat16_ms: float | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def cpu_bf16_support() -> dict[str, bool]:
    """The CPU features that make bf16 matmuls native rather than emulated."""
    return {"amx": bool(torch.cpu._is_amx_tile_supported()),
            "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported())}


def matmul_ms(dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """Median milliseconds of one PROBE_SHAPE matmul, after one untimed warm-up."""
    rows, hidden, width = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, hidden, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(hidden, width, generator=generator).to(device=device, dtype=dtype)
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def choose_dtype(requested: str, device: str | torch.device) -> DtypeChoice:
    """The dtype for `requested` ('auto', 'float32' or 'bfloat16') on `device`, and why."""
    if requested not in ("auto", *DTYPES):
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {requested!r}")
    if requested != "auto":
        return DtypeChoice(requested, "set in the recipe")
    return _auto(str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _auto(device_name: str) -> DtypeChoice:
    """Probed once per device and process; printed when chosen."""
    device = torch.device(device_name)
    if device.type == "cuda":
        # Not by emulation: a T4 or V100 (compute capability 7) "supports" bf16 tensors without
        # computing in bf16; and for this device, not the current one.
        with torch.cuda.device(device):
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        if native:
            choice = DtypeChoice("bfloat16", f"{torch.cuda.get_device_name(device)} computes in bf16")
        else:
            choice = DtypeChoice("float32", f"{torch.cuda.get_device_name(device)} lacks bf16 support")
    elif device.type == "cpu":
        choice = _cpu_choice(device)
    else:
        choice = DtypeChoice("float32", f"no bf16 check for device type '{device.type}'")
    print(f"agentrl: dtype auto on {device_name}: {choice.dtype} ({choice.reason})", file=sys.stderr)
    return choice


def _cpu_choice(device: torch.device) -> DtypeChoice:
    flags = cpu_bf16_support()
    if not any(flags.values()):
        return DtypeChoice("float32", "the CPU has neither AMX nor AVX512-BF16, so bf16 would be emulated")
    have = " and ".join(name.upper().replace("_", "-") for name, present in flags.items() if present)
    fp32_ms, bf16_ms = matmul_ms(torch.float32, device), matmul_ms(torch.bfloat16, device)
    measured = f"{have}; probe matmul float32 {fp32_ms:.1f} ms, bfloat16 {bf16_ms:.1f} ms"
    dtype = "bfloat16" if bf16_ms * MIN_SPEEDUP <= fp32_ms else "float32"
    return DtypeChoice(dtype, measured, fp32_ms, bf16_ms)
