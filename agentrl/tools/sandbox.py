"""Run untrusted Python in a fresh subprocess with resource limits, in a sandbox where one exists.

Every run gets its own temporary directory (created before, removed after) and a fresh interpreter
started through a small launcher that sets the rlimits (CPU seconds, address space, file size,
process count, open files, no core files) on the program and reports how it ended, and the CPU time
it used, through a pipe the program cannot reach (the launcher is not dumpable, so a program of the
same user can neither take its descriptors nor write its memory), so "exit code 152" and "killed by
SIGXCPU" are never confused. The wall-time and output limits are enforced from outside: past either,
the whole process group is killed.

Isolation, chosen once per process by probing what works on the machine:

- `bwrap` (bubblewrap 0.8 or later, Debian/Ubuntu package `bubblewrap`; the probe runs the real
  command on a real program, so an older or setuid bubblewrap falls back to `none`): new user, PID,
  network, IPC and UTS namespaces, and no further user namespaces inside (a nested one would let the
  program mount a tmpfs of its own, outside `disk_mb`). The host's `/` is mounted read-only;
  `/run`, `/tmp`, `/dev/shm` and the run's directory (the working directory, holding the program
  read-only) are private writable tmpfs mounts of at most `disk_mb` each. The network namespace
  has only its own loopback, so nothing on the host or beyond is reachable. When agentrl runs as
  root the sandbox runs as `nobody`, so the process limit applies (the kernel exempts root from it)
  and root's files stay unreadable; the PID namespace ends every process the program started when
  it exits.
- `none` (no working bubblewrap): the same limits and temporary directory, run as a user of its
  own (RUN_UIDS, no account's) when agentrl is root, otherwise as the current user (then without a
  process limit, since the kernel counts that limit over all of the user's processes). Files
  writable by every user (or by the current one), the network and other processes' sockets are
  all reachable, and a process that detached itself (`setsid`) outlives the call; the rest of its
  process group is killed. A warning says so when the tool is built.

Not isolated in either mode: world-readable host files can be read; memory is bounded per process
as address space, so memory no address space holds (memfd files and SysV shared memory, up to
`file_mb` per file and 256 open files, pipe buffers) is not counted, nor is the sum over processes
(a cgroup would bound both; none is created); Unix sockets outside `/tmp` and `/run` that the
sandbox user may write to stay reachable; there is no seccomp filter, so the kernel's
whole system-call surface is exposed; CPU is bounded in time, not in share. bubblewrap is used
rather than hand-made `unshare`/mount code because it is a small, audited setuid-free tool that
does exactly this set-up in one command.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOBODY = 65534
# Without bubblewrap, a root-started run gets a user of its own from this range, which no account
# uses: the process limit counts every process of a user, so under one shared `nobody` concurrent
# runs spent each other's (a program could not start a thread with 16 others running, and one that
# forked 31 children starved them all), and each could signal or trace the others' processes.
# Where the user namespace does not map the range (run_uids_mapped), runs are `nobody` as before.
RUN_UIDS = range(0x7F000000, 0x7FFF0000)
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs inside the sandbox as `python -I -S -c LAUNCHER limits.json program.py status_fd deadline_s`:
# applies the rlimits to a child, execs the program there, and writes the child's raw wait status to
# the pipe. At `deadline_s` (past the wall time, which the caller enforces) it kills its process
# group and exits, ending the PID namespace whose first process it is under bubblewrap: the caller
# kills bubblewrap, whose --die-with-parent misses a child it forked in the moment before it was
# killed (a run cancelled as it starts), and that child would otherwise run on with no wall limit.
# Not dumpable (PR_SET_DUMPABLE 0, before the fork; exec makes the program dumpable again): the
# program runs as the same user, and could otherwise write the pipe through /proc or pidfd_getfd, or
# the launcher's memory, which no rlimit bounds. It reports "STATUS CPU_SECONDS".
LAUNCHER = """\
import ctypes, json, os, resource, signal, sys
limits, program, status_fd = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
def deadline(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGALRM, deadline)
signal.alarm(int(sys.argv[4]))
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    os.close(status_fd)
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    os.execv(sys.executable, [sys.executable, "-I", "-B", program])
_, status, usage = os.wait4(pid, 0)
os.write(status_fd, f"{status} {usage.ru_utime + usage.ru_stime:.3f}".encode())
"""
STATUS = re.compile(rb"(\d{1,5}) (\d{1,9}\.\d{3})")
OPEN_FILES = 256
LAUNCHER_GRACE_S = 3  # the launcher's own deadline is this far past the wall time the caller enforces


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


BWRAP_VERSION = (0, 8, 0)  # --disable-userns (0.8), --size (0.7)


@functools.cache
def bwrap_problem(python: str | None = None) -> str | None:
    """Why bubblewrap cannot sandbox here (None when it can): missing, too old, or the real command
    (namespaces, mounts, the run directory, `python`) fails on a program that prints one line."""
    binary = shutil.which("bwrap")
    if binary is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install -y bubblewrap)"
    try:
        words = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20).stdout.split()
        version = tuple(int(part) for part in words[-1].split(".")[:3])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return f"bubblewrap's version cannot be read ({e})"
    if version < BWRAP_VERSION:
        return (f"bubblewrap {'.'.join(map(str, version))} is older than "
                f"{'.'.join(map(str, BWRAP_VERSION))}, which the sandbox needs (--disable-userns)")
    python = python or resolve_python("python3")
    workdir = _new_workdir("print('sandboxed')", "bwrap")
    status_r, status_w = os.pipe()
    try:
        done = subprocess.run(_command("bwrap", python, workdir, Limits(), status_w), capture_output=True,
                              text=True, timeout=20, pass_fds=(status_w,), stdin=subprocess.DEVNULL, cwd=workdir,
                              env=_environment(workdir), start_new_session=True, **_user_kwargs(run_uid("bwrap")))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap cannot run ({e})"
    finally:
        os.close(status_w)
        os.close(status_r)
        _remove(workdir)
    if done.returncode != 0 or done.stdout.strip() != "sandboxed":
        return f"bubblewrap cannot sandbox here ({done.stderr.strip() or f'exit code {done.returncode}'})"
    return None


@functools.cache
def run_root() -> str:
    """Where run directories are made: the temporary directory, unless agentrl runs as root (the
    program then runs as another user, run_uid) and other users cannot reach it, as with a TMPDIR
    of mode 0700."""
    base = tempfile.gettempdir()
    if os.geteuid() != 0:
        return base
    for candidate in (base, "/tmp"):
        path = os.path.realpath(candidate)
        ancestors = [path, *(str(parent) for parent in Path(path).parents)]
        if os.path.isdir(path) and all(os.stat(a).st_mode & stat.S_IXOTH for a in ancestors):
            return path
    raise ValueError(f"no directory for the program's runs: its user (not root) cannot enter the temporary directory "
                     f"{base} (TMPDIR) or /tmp")


_RUN_UIDS_IN_USE: set[int] = set()  # by this process's runs: a draw skips them


@functools.cache
def run_uids_mapped(uid_map: str = "/proc/self/uid_map") -> bool:
    """Whether this user namespace maps all of RUN_UIDS: a container with a user namespace of its
    own often maps only 0..65535, and a chown or setuid to an unmapped uid fails (EINVAL)."""
    try:
        ranges = [tuple(map(int, line.split())) for line in open(uid_map).read().splitlines() if line.strip()]
    except (OSError, ValueError):
        return False
    return any(inside <= RUN_UIDS.start and RUN_UIDS.stop <= inside + count for inside, _, count in ranges)


def run_uid(isolation: str) -> int | None:
    """The user a run executes as: None (the caller's) without root; `nobody` in bubblewrap (its
    own user namespace keeps runs apart) or where RUN_UIDS are not mapped; else one of RUN_UIDS
    that no other run of this process holds (release_run_uid gives it back)."""
    if os.geteuid() != 0:
        return None
    if isolation == "bwrap" or not run_uids_mapped():
        return NOBODY
    while (uid := RUN_UIDS[secrets.randbelow(len(RUN_UIDS))]) in _RUN_UIDS_IN_USE:
        pass
    _RUN_UIDS_IN_USE.add(uid)
    return uid


def release_run_uid(uid: int | None) -> None:
    _RUN_UIDS_IN_USE.discard(uid)  # (None and NOBODY were never held)


def _new_workdir(code: str, isolation: str, uid: int | None = None) -> Path:
    """A fresh directory holding the program as main.py, readable by whoever runs it (`uid`, who
    owns it without bubblewrap's tmpfs over it)."""
    workdir = Path(tempfile.mkdtemp(prefix="agentrl-python-", dir=run_root()))
    try:
        (workdir / "main.py").write_text(code, encoding="utf-8")
        os.chmod(workdir / "main.py", 0o644)
        os.chmod(workdir, 0o755)
        if isolation != "bwrap" and uid is not None:
            os.chown(workdir, uid, uid)  # without a tmpfs over it, the run's user writes here itself
    except BaseException:
        _remove(workdir)
        raise
    return workdir


def _remove(workdir: Path) -> None:
    """Remove a run's directory, also when the program made parts of it unwritable (without root,
    rmtree cannot empty a directory of mode 0500 or 0000). Each directory is opened as a path
    (O_PATH: no read permission needed) without following links and changed through its
    /proc/self/fd entry, so a link the program left cannot turn the chmod onto a file outside."""
    shutil.rmtree(workdir, ignore_errors=True)
    if not os.path.lexists(workdir):
        return
    for root, dirs, _ in os.walk(workdir):
        for name in dirs:  # made enterable before os.walk goes into it
            try:
                fd = os.open(os.path.join(root, name), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:  # a link
                continue
            try:
                os.chmod(f"/proc/self/fd/{fd}", 0o700)
            except OSError:
                pass
            finally:
                os.close(fd)
    shutil.rmtree(workdir, ignore_errors=True)


def resolve_python(python: str) -> str:
    """An interpreter the sandbox can run: absolute, or found on the system PATH (not a virtualenv's)."""
    found = python if os.path.isabs(python) else shutil.which(python, path=SAFE_PATH)
    if not found or not os.access(found, os.X_OK):
        raise ValueError(f"python interpreter '{python}' not found (looked on {SAFE_PATH})")
    return found


def _user_kwargs(uid: int | None) -> dict[str, Any]:
    """Popen arguments that drop root to `uid` (run_uid); nothing for an unprivileged user."""
    return {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}


def _rlimits(limits: Limits, with_nproc: bool) -> dict[str, tuple[int, int]]:
    mb = 1024 * 1024
    cpu = max(1, round(limits.cpu_s))
    values = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (limits.memory_mb * mb,) * 2,
              "RLIMIT_FSIZE": (limits.file_mb * mb,) * 2, "RLIMIT_CORE": (0, 0),
              "RLIMIT_NOFILE": (OPEN_FILES, OPEN_FILES)}
    if with_nproc:
        values["RLIMIT_NPROC"] = (limits.processes,) * 2
    return values


def launcher_deadline_s(limits: Limits) -> int:
    return math.ceil(limits.wall_s) + LAUNCHER_GRACE_S


def _command(isolation: str, python: str, workdir: Path, limits: Limits, status_fd: int) -> list[str]:
    program = str(workdir / "main.py")
    # Inside a user namespace the process count is per sandbox; outside it only a root-started run
    # has a uid (its own, run_uid) whose count is not the caller's whole session.
    nproc = isolation == "bwrap" or os.geteuid() == 0
    launch = [python, "-I", "-S", "-c", LAUNCHER, json.dumps(_rlimits(limits, nproc)), program, str(status_fd),
              str(launcher_deadline_s(limits))]
    if isolation != "bwrap":
        return launch
    size = str(limits.disk_mb * 1024 * 1024)
    private = [arg for path in ("/run", "/tmp", "/dev/shm", str(workdir)) for arg in ("--size", size, "--tmpfs", path)]
    # --as-pid-1: the launcher (not dumpable) is the namespace's first process, not a bwrap reaper
    # the program could write to; its exit still ends every process the program started.
    return [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1",
            "--die-with-parent", "--new-session",
            # /dev read-only: bwrap's /dev is a tmpfs the size of half the host's memory, not disk_mb
            "--ro-bind", "/", "/", "--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc", *private,
            "--ro-bind", program, program, "--chdir", str(workdir), *launch]


def _environment(workdir: Path) -> dict[str, str]:
    # A clean environment: nothing of the trainer's (tokens, paths) reaches the program.
    return {"PATH": SAFE_PATH, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


async def run_python(code: str, limits: Limits, isolation: str, python: str) -> RunResult:
    """Run `code` as a fresh program under `limits`; the temporary directory is gone on return."""
    uid = run_uid(isolation)
    try:
        workdir = _new_workdir(code, isolation, uid)
    except BaseException:
        release_run_uid(uid)
        raise
    pipes: list[tuple[int, int]] = []
    try:
        for _ in range(3):  # stdout, stderr, the launcher's status (made one by one: any may fail, EMFILE)
            pipes.append(os.pipe())
        started = time.monotonic()
        (out_r, out_w), (err_r, err_w), (status_r, status_w) = pipes
        proc = await asyncio.create_subprocess_exec(
            *_command(isolation, python, workdir, limits, status_w), stdin=subprocess.DEVNULL,
            stdout=out_w, stderr=err_w, pass_fds=(status_w,), cwd=workdir, env=_environment(workdir),
            start_new_session=True, **_user_kwargs(uid))
        for fd in (out_w, err_w, status_w):
            os.close(fd)
        pipes = []  # the write ends are closed; _supervise closes the read ends, whatever happens
        out, err, status, cpu_used, limit = await _supervise(proc, limits, out_r, err_r, status_r)
        wall_s = time.monotonic() - started
    finally:
        _remove(workdir)
        for fd in (fd for pair in pipes for fd in pair):
            os.close(fd)
        # its processes were killed with the launcher's group (one that detached itself outlives
        # the run, as said above; a later draw is unlikely to meet its uid)
        release_run_uid(uid)
    exit_code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
    # SIGXCPU at the soft limit; SIGKILL at the hard one (a second later) for a program ignoring it
    if limit is None and (sig == signal.SIGXCPU or sig == signal.SIGKILL and cpu_used >= max(1, round(limits.cpu_s))):
        limit = "cpu"
    # the launcher's own deadline (this loop stalled past the wall time): the wall limit all the same
    if limit is None and (status is None or sig == signal.SIGKILL) and wall_s >= launcher_deadline_s(limits) - 0.5:
        limit = "wall"
    text_err = _text(err.data)
    if status is None and limit is None:  # the launcher never reported: the sandbox itself failed
        exit_code, text_err = proc.returncode, f"sandbox error (exit code {proc.returncode}): {text_err}"
    return RunResult(_text(out.data), text_err, exit_code, sig, limit, out.cut or err.cut, wall_s)


async def _supervise(proc: asyncio.subprocess.Process, limits: Limits, out_r: int, err_r: int,
                     status_r: int) -> tuple[_Capture, _Capture, int | None, float, str | None]:
    """Wait for the launcher's report within the wall time, collecting output up to its cap.

    The status pipe reaches end-of-file when the launcher (and bubblewrap) are gone, so the wait
    does not depend on stdout closing: a process that detached itself (possible without a PID
    namespace) and still holds it cannot stall the call.
    """
    overflow = asyncio.Event()
    out, err = _Capture(out_r, limits.output_bytes, overflow), _Capture(err_r, limits.output_bytes, overflow)
    status = _Capture(status_r, 64, asyncio.Event())
    flooded = asyncio.ensure_future(overflow.wait())
    waiter = asyncio.ensure_future(proc.wait())
    limit = None
    try:
        await asyncio.wait({status.closed, flooded}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED)
        if not status.closed.done():
            limit = "output" if overflow.is_set() else "wall"
        else:  # the launcher is gone: bubblewrap's own exit code (why it failed) before the kill replaces it
            await asyncio.wait({waiter}, timeout=1.0)
        _kill_group(proc.pid)  # also whatever the program left running in its group
        await asyncio.wait({waiter, out.closed, err.closed}, timeout=2.0)  # the last output, the exit
    finally:
        _kill_group(proc.pid)
        for task in (flooded, waiter):
            task.cancel()
        for capture in (out, err, status):
            capture.close()
    report = STATUS.fullmatch(bytes(status.data))
    if report is None or int(report[1]) > 0xFFFF:
        return out, err, None, 0.0, limit
    return out, err, int(report[1]), float(report[2]), limit


class _Capture:
    """One pipe read into a capped buffer by the event loop; `closed` resolves at end-of-file.

    Plain fds with `add_reader` rather than asyncio's subprocess pipes, whose exit report waits
    for every pipe to close.
    """

    def __init__(self, fd: int, cap: int, overflow: asyncio.Event):
        self.fd, self.cap, self.overflow = fd, cap, overflow
        self.data, self.cut = bytearray(), False
        self.loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self.loop.create_future()
        os.set_blocking(fd, False)
        self.loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if len(chunk) > room:  # keep reading and discarding until the kill closes the pipe
            self.cut = True
            self.overflow.set()

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
        if not self.closed.done():
            self.closed.set_result(None)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")

