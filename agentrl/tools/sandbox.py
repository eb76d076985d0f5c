"""Run untrusted Python in a fresh subprocess with resource limits, in a sandbox where one exists.

Every run gets its own temporary directory (created before, removed after) and a fresh interpreter
started through a small launcher that sets the rlimits (CPU seconds, address space, file size,
process count, no core files) on the program and reports how it ended through a pipe the program
cannot reach, so "exit code 152" and "killed by SIGXCPU" are never confused. The wall-time and
output limits are enforced from outside: past either, the whole process group is killed.

Isolation, chosen once per process by probing what works on the machine:

- `bwrap` (bubblewrap, Debian/Ubuntu package `bubblewrap`): new user, PID, network, IPC and UTS
  namespaces. The host's `/` is mounted read-only; `/run`, `/tmp`, `/dev/shm` and the run's
  directory (the working directory, holding the program read-only) are private writable tmpfs
  mounts of at most `disk_mb` each. The network namespace has only its own loopback, so nothing
  on the host or beyond is reachable. When agentrl runs as root the sandbox
  runs as `nobody`, so the process limit applies (the kernel exempts root from it) and root's files
  stay unreadable; the PID namespace ends every process the program started when it exits.
- `none` (no working bubblewrap): the same limits and temporary directory, run as `nobody` when
  agentrl is root, otherwise as the current user (then without a process limit, since the kernel
  counts that limit over all of the user's processes). Files writable by that user, the network
  and other processes' sockets are all reachable. A warning says so when the tool is built.

Not isolated in either mode: world-readable host files can be read; Unix sockets outside `/tmp` and
`/run` that the sandbox user may write to stay reachable; there is no seccomp filter, so the kernel's
whole system-call surface is exposed; CPU is bounded in time, not in share. bubblewrap is used
rather than hand-made `unshare`/mount code because it is a small, audited setuid-free tool that
does exactly this set-up in one command.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOBODY = 65534
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs inside the sandbox as `python -I -S -c LAUNCHER limits.json program.py status_fd`: applies the
# rlimits to a child, execs the program there, and writes the child's raw wait status to the pipe.
LAUNCHER = """\
import json, os, resource, sys
limits, program, status_fd = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
pid = os.fork()
if pid == 0:
    os.close(status_fd)
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    os.execv(sys.executable, [sys.executable, "-I", "-B", program])
_, status = os.waitpid(pid, 0)
os.write(status_fd, str(status).encode())
"""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512  # address space (RLIMIT_AS) of each process
    file_mb: int = 16  # largest file it may write
    disk_mb: int = 64  # size of each writable tmpfs under bubblewrap
    processes: int = 32  # processes and threads, the launcher's included
    output_bytes: int = 65536  # stdout and stderr each


@dataclass
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the program did not exit by itself
    signal: int | None  # the signal that ended it, when one did
    limit: str | None  # "wall", "output" or "cpu": the limit that stopped it
    truncated: bool  # output went past the cap and was cut
    wall_s: float


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox here (None when it can): missing, or namespaces refused."""
    binary = shutil.which("bwrap")
    if binary is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install -y bubblewrap)"
    probe = [binary, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
             "--dev", "/dev", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=20, **_user_kwargs())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap cannot run ({e})"
    if done.returncode != 0:
        return f"bubblewrap cannot create namespaces here ({done.stderr.strip() or done.returncode})"
    return None


def resolve_python(python: str) -> str:
    """An interpreter the sandbox can run: absolute, or found on the system PATH (not a virtualenv's)."""
    found = python if os.path.isabs(python) else shutil.which(python, path=SAFE_PATH)
    if not found or not os.access(found, os.X_OK):
        raise ValueError(f"python interpreter '{python}' not found (looked on {SAFE_PATH})")
    return found


def _user_kwargs() -> dict[str, Any]:
    """Popen arguments that drop root to `nobody`; nothing for an unprivileged user."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


def _rlimits(limits: Limits, with_nproc: bool) -> dict[str, tuple[int, int]]:
    mb = 1024 * 1024
    cpu = max(1, round(limits.cpu_s))
    values = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (limits.memory_mb * mb,) * 2,
              "RLIMIT_FSIZE": (limits.file_mb * mb,) * 2, "RLIMIT_CORE": (0, 0)}
    if with_nproc:
        values["RLIMIT_NPROC"] = (limits.processes,) * 2
    return values


def _command(isolation: str, python: str, workdir: Path, limits: Limits, status_fd: int) -> list[str]:
    program = str(workdir / "main.py")
    # Inside a user namespace the process count is per sandbox; outside it only a root-started run
    # has a uid (`nobody`) whose count is not the caller's whole session.
    nproc = isolation == "bwrap" or os.geteuid() == 0
    launch = [python, "-I", "-S", "-c", LAUNCHER, json.dumps(_rlimits(limits, nproc)), program, str(status_fd)]
    if isolation != "bwrap":
        return launch
    size = str(limits.disk_mb * 1024 * 1024)
    private = [arg for path in ("/run", "/tmp", "/dev/shm", str(workdir)) for arg in ("--size", size, "--tmpfs", path)]
    return [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *private,
            "--ro-bind", program, program, "--chdir", str(workdir), *launch]


def _environment(workdir: Path) -> dict[str, str]:
    # A clean environment: nothing of the trainer's (tokens, paths) reaches the program.
    return {"PATH": SAFE_PATH, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


async def run_python(code: str, limits: Limits, isolation: str, python: str) -> RunResult:
    """Run `code` as a fresh program under `limits`; the temporary directory is gone on return."""
    workdir = Path(tempfile.mkdtemp(prefix="agentrl-python-"))
    status_r, status_w = os.pipe()
    try:
        (workdir / "main.py").write_text(code)
        os.chmod(workdir / "main.py", 0o644)
        os.chmod(workdir, 0o755)
        if isolation != "bwrap" and os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)  # without a tmpfs over it, `nobody` writes here itself
        loop = asyncio.get_running_loop()
        started = loop.time()
        proc = await asyncio.create_subprocess_exec(
            *_command(isolation, python, workdir, limits, status_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,), cwd=workdir,
            env=_environment(workdir), start_new_session=True, **_user_kwargs())
        os.close(status_w)
        status_w = -1
        stdout, stderr, limit, truncated = await _supervise(proc, limits)
        status = _read_status(status_r)
        wall_s = loop.time() - started
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    exit_code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
    if limit is None and sig == signal.SIGXCPU:
        limit = "cpu"
    text_err = _text(stderr)
    if status is None and limit is None:  # the launcher never reported: the sandbox itself failed
        exit_code, text_err = proc.returncode, f"sandbox error (exit code {proc.returncode}): {text_err}"
    return RunResult(_text(stdout), text_err, exit_code, sig, limit, truncated, wall_s)


async def _supervise(proc: asyncio.subprocess.Process, limits: Limits) -> tuple[bytes, bytes, str | None, bool]:
    """Wait for the program within the wall time, collecting output up to its cap; kill leftovers."""
    overflow = asyncio.Event()
    out, err = bytearray(), bytearray()
    readers = [asyncio.create_task(_drain(proc.stdout, out, limits.output_bytes, overflow)),
               asyncio.create_task(_drain(proc.stderr, err, limits.output_bytes, overflow))]
    waiter, flooded = asyncio.create_task(proc.wait()), asyncio.create_task(overflow.wait())
    limit = None
    try:
        done, _ = await asyncio.wait({waiter, flooded}, timeout=limits.wall_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            limit = "output" if overflow.is_set() else "wall"
    finally:
        _kill_group(proc.pid)  # also whatever the program left running (the no-sandbox mode)
        flooded.cancel()
        await waiter
        # Pipes close once every process holding them is gone; one escaped process cannot stall us.
        _, pending = await asyncio.wait(readers, timeout=1.0)
        for task in pending:
            task.cancel()
    return bytes(out), bytes(err), limit, overflow.is_set()


async def _drain(stream: asyncio.StreamReader | None, buffer: bytearray, cap: int, overflow: asyncio.Event) -> None:
    # Reads to the end even past the cap (discarding), so the pipe closes and the process can be reaped.
    while stream is not None and (chunk := await stream.read(65536)):
        room = cap - len(buffer)
        if room > 0:
            buffer += chunk[:room]
        if len(chunk) > room:
            overflow.set()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_status(fd: int) -> int | None:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 64)
    except BlockingIOError:
        return None
    return int(data) if data.strip().isdigit() else None


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")

