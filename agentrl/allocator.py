"""The memory allocator CPU runs use: tcmalloc where it is installed, chosen before torch loads.

glibc's malloc hands every block above 32 MB straight back to the kernel when it is freed, and
trims freed memory past a threshold, so the large temporaries of a training step (activations,
chunks of logits, gradients) and of decoding (logits, sampling's cumulative sums) come back as
fresh pages that fault in one by one on first touch. On a 2-core machine a GRPO step of
bench/vs_trl.py spent about a fifth of its CPU time in the kernel that way (7.7 million page
faults over three steps). tcmalloc keeps freed memory for the next allocation: the same steps ran
1.5x faster, rollout and update alike (jemalloc: 1.2x). PyTorch's CPU tuning guide recommends
the same, and its own launcher (`torch.backends.xeon.run_cpu`) preloads it the same way.

tcmalloc itself hands free memory back to the kernel bit by bit as more is freed
(`TCMALLOC_RELEASE_RATE`, default 1), so the phases of a training step still refault each
other's memory: a GRPO update of bench/vs_trl.py's shape right after a rollout took up to 1.1
million page faults and 20 s against 10 s with none. agentrl sets the rate to 0 (a user's own
setting wins): the process keeps its peak heap and reuses it, rollout and update alike.

An allocator is chosen when a process starts (`LD_PRELOAD`), so `use_tcmalloc` executes the
running command again, once, with tcmalloc preloaded; the agentrl CLI and the benchmarks call it
first thing. Child processes (Ray workers) inherit it; the Python tool's sandbox does not (it
starts with a clean environment). `AGENTRL_ALLOCATOR=system` keeps the system allocator (any value
but it and `tcmalloc` is an error). The library is Debian's `libtcmalloc-minimal4` (`make
system-packages` installs it); without it nothing changes. Linux only.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

OPT_OUT = "AGENTRL_ALLOCATOR"  # 'system': keep glibc's malloc
_RELAUNCHED = "AGENTRL_ALLOCATOR_RELAUNCHED"  # set in the re-executed process: never loop


def find_tcmalloc() -> str | None:
    """The tcmalloc library's file name as the dynamic loader finds it, or None."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def active_allocator() -> str:
    """'tcmalloc', 'jemalloc' or 'system': which allocator this process has loaded."""
    try:
        with open("/proc/self/maps") as maps:
            loaded = maps.read()
    except OSError:
        return "system"
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in loaded), "system")


def use_tcmalloc() -> str:
    """Re-execute this process with tcmalloc preloaded where that helps and is possible (this
    call then does not return); otherwise return the allocator in use. Call it before any work."""
    choice = os.environ.get(OPT_OUT, "")
    if choice not in ("", "system", "tcmalloc"):  # 'glibc' or a typo went on to re-execute on tcmalloc
        from agentrl.errors import ConfigError

        raise ConfigError(f"{OPT_OUT}: {choice!r} is neither 'system' (glibc's malloc) nor 'tcmalloc' (the default)")
    current = active_allocator()
    if current != "system" or choice == "system" or os.environ.get(_RELAUNCHED):
        return current
    library = find_tcmalloc()
    argv = getattr(sys, "orig_argv", None)  # the command line as typed, `-m module` and all
    # A program read from stdin (`python -`, a heredoc) or typed at a prompt cannot run again: the
    # new process found stdin used up, and exited 0 having done nothing.
    from_stdin = sys.argv[:1] in ([""], ["-"]) or sys.flags.interactive
    if library is None or not argv or from_stdin:
        return current
    env = dict(os.environ, **{_RELAUNCHED: "1"})
    env.setdefault("TCMALLOC_RELEASE_RATE", "0")  # keep freed pages (module docstring)
    env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    return current  # not reached
