"""What a benchmark ran on: the machine line the bench scripts print, and the CPU time the
hypervisor took (steal) while a side was measured.

Only what /proc and torch report; nothing here changes how a benchmark runs. The machines this
project runs on differ in their bf16 support (AMX, AVX512-BF16, or neither) and are shared, so a
figure is quoted with both.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def bf16_flags() -> str:
    """Which of the CPU flags that decide bf16 speed are present ('amx_bf16 no, avx512_bf16 yes')."""
    flags: set[str] = set()
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("amx_bf16", "avx512_bf16"))


def machine_line(threads: str, dtype: str) -> str:
    from agentrl.allocator import active_allocator  # here, not at the top: vs_trl's TRL side imports this module

    return (f"machine: {cpu_model()}, {os.cpu_count()} cores, {bf16_flags()}, torch {torch.__version__}, "
            f"threads {threads}, dtype {dtype}, memory allocator {active_allocator()}")


class Steal:
    """Share of CPU time taken by the hypervisor (steal) and by everything (busy) between start()
    and stop(), from /proc/stat, and the 1-minute load average at stop(): how shared the machine
    was while a side ran."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._begin = _cpu_times()

    def stop(self) -> str:
        end = _cpu_times()
        delta = [b - a for a, b in zip(self._begin, end)]
        total = max(sum(delta), 1)
        idle = delta[3] + delta[4]  # idle, iowait
        steal = delta[7] if len(delta) > 7 else 0
        load = (_read("/proc/loadavg").split() or ["?"])[0]
        return f"cpu busy {1 - idle / total:.0%}, steal {steal / total:.0%}, load average {load}"


def _cpu_times() -> list[int]:
    first = _read("/proc/stat").splitlines()[0].split()
    return [int(v) for v in first[1:]] if first and first[0] == "cpu" else [0] * 8


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
