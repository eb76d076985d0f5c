"""`python`: the model writes a Python program, the tool runs it and returns what it printed.

Each call is a fresh program in a fresh directory under the limits of `agentrl.tools.sandbox`
(CPU and wall time, memory, file size, processes, output) and, where bubblewrap works, with no
network and no writable filesystem outside that directory; `agentrl.tools.sandbox` says exactly what
is and is not isolated in each mode. Nothing persists between calls: this is not a notebook kernel.

The reply tells the model how the program ended (`exit code 0`, `exit code 1 (MemoryError: ...)`,
`killed: CPU-time limit of 2 s`) and then its stdout and stderr.
"""

from __future__ import annotations

import math
import signal
import sys
from typing import Any, Literal

from agentrl.tools.base import ToolResult
from agentrl.tools.sandbox import Limits, RunResult, bwrap_problem, resolve_python, run_python, run_root


class PythonTool:
    """Runs model-written Python in a sandboxed subprocess; stateless between calls.

    `timeout_s` should stay below `rollout.tool_timeout_s` (10 s by default), so the model reads
    which limit stopped its program rather than the loop's generic timeout.
    """

    def __init__(self, timeout_s: float = 8.0, cpu_s: float = 5.0, memory_mb: int = 512, file_mb: int = 16,
                 disk_mb: int = 64, max_processes: int = 32, max_output_bytes: int = 65536,
                 isolation: Literal["auto", "bwrap", "none"] = "auto", python: str = "python3"):
        if isolation not in ("auto", "bwrap", "none"):
            raise ValueError(f"isolation must be auto, bwrap or none, not '{isolation}'")
        self.limits = Limits(timeout_s, cpu_s, memory_mb, file_mb, disk_mb, max_processes, max_output_bytes)
        for key, value in vars(self.limits).items():
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{key} must be a positive finite number, got {value}")
        self.python = resolve_python(python)
        run_root()  # where runs go, or a ValueError now rather than at every call
        problem = bwrap_problem(self.python) if isolation != "none" else "isolation: none was configured"
        if problem and isolation == "bwrap":
            raise ValueError(f"isolation: bwrap is unavailable: {problem}")
        self.isolation = "none" if problem else "bwrap"
        if problem:
            print(f"agentrl: warning: the python tool runs WITHOUT a sandbox ({problem}); only rlimits, "
                  "a temporary directory and a clean environment apply: the program can use the network "
                  "and write wherever its user may", file=sys.stderr)
        self.schema: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": "python",
                "description": (
                    "Run a Python 3 program and return its exit status, stdout and stderr. Print what you "
                    "need to see. Each call starts fresh (no state is kept), "
                    f"{'without network access, ' if self.isolation == 'bwrap' else ''}"
                    f"with at most {cpu_s:g} s of CPU time, {timeout_s:g} s of wall time, {memory_mb} MB "
                    f"of memory and {max_output_bytes} bytes of output."),
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "The complete program."}},
                    "required": ["code"],
                },
            },
        }

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        result = await run_python(arguments["code"], self.limits, self.isolation, self.python)
        metrics = {"python_runs": 1.0, "python_failed": float(result.exit_code != 0),
                   "python_limit_kills": float(result.limit is not None),
                   "python_unsandboxed": float(self.isolation == "none")}
        return ToolResult(self.format(result), metrics=metrics)

    async def reward(self, instance_id: str) -> float | None:
        return None

    async def release(self, instance_id: str) -> None:
        return None

    def format(self, result: RunResult) -> str:
        """The text the model reads: how it ended, then stdout and stderr (empty ones left out)."""
        parts = [f"exit: {self.describe_end(result)}"]
        if result.stdout:
            parts.append(f"--- stdout ---\n{result.stdout}")
        if result.stderr:
            parts.append(f"--- stderr ---\n{result.stderr}")
        if not result.stdout and not result.stderr:
            parts.append("(no output)")
        return "\n".join(parts)

    def describe_end(self, result: RunResult) -> str:
        limits = self.limits
        cut = f" (output cut at {limits.output_bytes} bytes)" if result.truncated else ""
        if result.limit == "wall":
            return f"killed: wall-time limit of {limits.wall_s:g} s{cut}"
        if result.limit == "output":
            return f"killed: output limit of {limits.output_bytes} bytes (output cut)"
        if result.limit == "cpu":
            return f"killed: CPU-time limit of {max(1, round(limits.cpu_s))} s{cut}"
        if result.signal is not None:
            return f"killed by signal {_signal_name(result.signal)}{cut}"
        return f"exit code {result.exit_code}{self._hint(result.stderr)}{cut}"

    def _hint(self, stderr: str) -> str:
        """Names the limit behind the exception a program died of, when its last line shows one."""
        lines = stderr.strip().splitlines()
        last = lines[-1] if lines else ""
        if last.startswith("MemoryError"):
            return f" (MemoryError: the memory limit is {self.limits.memory_mb} MB)"
        if last.startswith("BlockingIOError: [Errno 11]") and "fork" in stderr:
            return f" (fork failed: the process limit is {self.limits.processes})"
        if "File too large" in last:
            return f" (the file-size limit is {self.limits.file_mb} MB)"
        return ""


def _signal_name(number: int) -> str:
    """SIGKILL for 9; the bare number for one Python has no name for (the realtime signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
