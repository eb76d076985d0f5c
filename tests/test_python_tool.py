"""The `python` tool runs real programs in a real bubblewrap sandbox: each escape attempt is contained
and reported to the model, and nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.builtin.python_exec import PythonTool
from agentrl.tools.loader import load_tools
from agentrl.tools.parsers import parse_hermes
from agentrl.tools import sandbox
from agentrl.tools.sandbox import bwrap_problem
from agentrl.types import Task
from tests.conftest import ScriptedEngine

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"{bwrap_problem()}")


def run(code: str, **config) -> tuple[str, dict[str, float], float]:
    config.setdefault("isolation", "bwrap")
    tool = PythonTool(**{"timeout_s": 2, "cpu_s": 1, "memory_mb": 256, "max_processes": 16, **config})
    started = time.perf_counter()
    result = asyncio.run(tool.execute("episode/python", {"code": textwrap.dedent(code)}))
    return result.text, result.metrics, time.perf_counter() - started


def sandbox_processes(marker: str) -> list[int]:
    """Host pids whose command line mentions `marker` (the program's path)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # the process ended while we looked
            pass
    return found


def survivors(marker: str, wait_s: float = 5.0) -> list[int]:
    """Processes still matching `marker` after up to `wait_s` (SIGKILLed ones take a moment to go)."""
    deadline = time.monotonic() + wait_s
    while sandbox_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sandbox_processes(marker)


@needs_bwrap
def test_normal_computation_and_its_directory_is_removed():
    text, metrics, _ = run("""
        import os
        open("data.txt", "w").write("6 7")
        a, b = map(int, open("data.txt").read().split())
        print(a * b, sum(i * i for i in range(1000)))
        print(os.getcwd())
        """)
    head, cwd = text.rsplit("\n", 2)[:2]
    assert head == "exit: exit code 0\n--- stdout ---\n42 332833500"
    assert Path(cwd).name.startswith("agentrl-python-") and str(Path(cwd).parent) == tempfile.gettempdir()
    assert not Path(cwd).exists()  # created for the run, gone afterwards
    assert metrics == {"python_runs": 1.0, "python_failed": 0.0, "python_limit_kills": 0.0,
                       "python_unsandboxed": 0.0}


@needs_bwrap
def test_writing_outside_its_directory_is_refused(tmp_path):
    # A world-writable host directory: only the read-only mount stops `nobody` from writing here.
    outside = Path(tempfile.mkdtemp(prefix="agentrl-outside-", dir="/var/tmp"))
    outside.chmod(0o777)
    try:
        text, _, _ = run(f"""
            for path in ["{outside}/escape.txt", "{tmp_path}/escape.txt", "/etc/escape.txt", "/dev/fill"]:
                try:
                    open(path, "w").write("escaped")
                    print("wrote", path)
                except OSError as e:
                    print(type(e).__name__, e.strerror)
            """)
        assert text == ("exit: exit code 0\n--- stdout ---\n"
                        "OSError Read-only file system\n"  # /var/tmp: visible, read-only
                        "FileNotFoundError No such file or directory\n"  # the host's /tmp is not visible
                        "OSError Read-only file system\n"
                        "OSError Read-only file system\n")  # /dev: a tmpfs of half the host's memory, not disk_mb
        assert list(outside.iterdir()) == [] and list(tmp_path.iterdir()) == []
        assert not Path("/etc/escape.txt").exists()
    finally:
        os.rmdir(outside)


@needs_bwrap
def test_connecting_to_a_listener_on_the_host_loopback_fails():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        text, _, _ = run(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1)
                print("connected")
            except OSError as e:
                print(type(e).__name__)
            """)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nobody knocked
            listener.accept()
    # The sandbox has a loopback of its own, with nothing listening on it.
    assert text == "exit: exit code 0\n--- stdout ---\nConnectionRefusedError\n"


@needs_bwrap
def test_fork_bomb_is_capped_and_cleaned_up():
    text, metrics, elapsed = run("""
        import os, time
        main, started = os.getpid(), time.time()
        while time.time() - started < 1.0:  # every process forks for a second
            try:
                os.fork()
            except OSError:
                pass
        if os.getpid() == main:
            print(len([p for p in os.listdir("/proc") if p.isdigit()]), os.path.abspath(__file__))
        else:
            time.sleep(30)
        """, timeout_s=4)
    head, count_and_path = text.split("\n--- stdout ---\n")
    count, program = count_and_path.split()
    assert head == "exit: exit code 0"
    # Sandbox init, launcher, program and its children: never more than max_processes.
    assert 8 <= int(count) <= 16
    assert elapsed < 4 and survivors(program) == []  # the sleeping children died with it


@needs_bwrap
def test_allocating_10_gb_hits_the_memory_limit():
    text, metrics, _ = run("x = bytearray(10 * 1024 ** 3)")
    assert text.startswith("exit: exit code 1 (MemoryError: the memory limit is 256 MB)\n--- stderr ---\n")
    assert text.endswith("\nMemoryError\n") and metrics["python_failed"] == 1.0


@needs_bwrap
def test_infinite_loop_hits_the_cpu_limit_and_sleeping_hits_the_wall_limit():
    text, metrics, elapsed = run("while True:\n    pass\n", timeout_s=10)
    assert text == "exit: killed: CPU-time limit of 1 s\n(no output)" and elapsed < 10
    assert metrics["python_limit_kills"] == 1.0
    text, _, elapsed = run("import time\nprint('start', flush=True)\ntime.sleep(60)\n", timeout_s=1)
    assert text == "exit: killed: wall-time limit of 1 s\n--- stdout ---\nstart\n" and elapsed < 5


@needs_bwrap
def test_printing_100_mb_is_cut_and_killed():
    text, metrics, elapsed = run("""
        import sys
        for _ in range(100):
            sys.stdout.write("x" * 1_000_000)
        """, max_output_bytes=5000)
    assert text == "exit: killed: output limit of 5000 bytes (output cut)\n--- stdout ---\n" + "x" * 5000
    assert elapsed < 5 and metrics["python_limit_kills"] == 1.0


@needs_bwrap
def test_a_caller_timeout_kills_the_program_and_removes_its_directory():
    tool = PythonTool(timeout_s=30, isolation="bwrap")
    before = set(Path(tempfile.gettempdir()).glob("agentrl-python-*"))
    code = "import time\ntime.sleep(60)\n"

    async def abandoned() -> None:
        await asyncio.wait_for(tool.execute("e/python", {"code": code}), 1.0)  # as ToolEnv does

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(abandoned())
    assert set(Path(tempfile.gettempdir()).glob("agentrl-python-*")) == before
    assert survivors("agentrl-python-") == []  # cancellation returns at once; SIGKILL needs a moment


def test_no_sandbox_mode_warns_and_still_limits(capsys):
    text, metrics, _ = run("x = bytearray(10 * 1024 ** 3)", isolation="none")
    assert "agentrl: warning: the python tool runs WITHOUT a sandbox (isolation: none was configured)" in \
        capsys.readouterr().err
    assert text.startswith("exit: exit code 1 (MemoryError: the memory limit is 256 MB)")
    assert metrics["python_unsandboxed"] == 1.0


def test_a_program_ended_by_a_realtime_signal_is_reported_with_its_output():
    # Python's signal.Signals has no member for 40 (SIGRTMIN+6 on Linux).
    text, metrics, _ = run("import os\nprint('before', flush=True)\nos.kill(os.getpid(), 40)", isolation="none")
    assert text == "exit: killed by signal 40\n--- stdout ---\nbefore\n"
    assert metrics["python_failed"] == 1.0 and metrics["python_limit_kills"] == 0.0


def test_no_sandbox_mode_does_not_hang_on_a_detached_process():
    # Without a PID namespace a detached child outlives the call (as documented), but the call returns.
    text, _, elapsed = run("""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            print(os.getpid(), flush=True)
            time.sleep(30)
        time.sleep(0.3)
        """, isolation="none", timeout_s=5)
    detached = int(text.split("--- stdout ---\n")[1])
    try:
        assert text.startswith("exit: exit code 0\n") and elapsed < 5
    finally:
        os.kill(detached, 9)


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_the_program_cannot_reach_its_launcher_to_forge_how_it_ended(isolation):
    # The launcher runs as the program's user; its status pipe and memory must stay out of reach,
    # or a program could report "exit code 0" for a run the CPU limit killed.
    text, metrics, _ = run("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        status_fd = int(open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")[-2])
        pidfd = os.pidfd_open(os.getppid())
        print("pidfd_getfd", libc.syscall(438, pidfd, status_fd, 0), os.strerror(ctypes.get_errno()))
        for path in (f"/proc/{os.getppid()}/fd/{status_fd}", f"/proc/{os.getppid()}/mem"):
            try:
                open(path, "r+b")
            except OSError as e:
                print(path.split("/")[-2 if path.endswith(str(status_fd)) else -1], e.strerror)
        print("spinning", flush=True)
        while True:
            pass
        """, isolation=isolation)
    assert text == ("exit: killed: CPU-time limit of 1 s\n--- stdout ---\npidfd_getfd -1 Operation not permitted\n"
                    "fd Permission denied\nmem Permission denied\nspinning\n")
    assert metrics["python_limit_kills"] == 1.0


def test_a_program_ignoring_sigxcpu_is_reported_as_stopped_by_the_cpu_limit():
    # It dies of SIGKILL at the hard limit a second later: the CPU it used says which limit that was.
    text, metrics, _ = run("""
        import signal
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        while True:
            pass
        """, isolation="none", timeout_s=5)
    assert text == "exit: killed: CPU-time limit of 1 s\n(no output)" and metrics["python_limit_kills"] == 1.0


@needs_bwrap
def test_a_nested_user_namespace_is_refused_so_no_tmpfs_outside_disk_mb_can_be_mounted():
    text, _, _ = run("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))  # CLONE_NEWUSER
        """)
    assert text == "exit: exit code 0\n--- stdout ---\n-1 No space left on device\n"


def test_a_bubblewrap_that_cannot_run_the_sandbox_falls_back_with_its_reason(monkeypatch, capsys):
    # Ubuntu 22.04's bubblewrap (0.6) has no --size: the probe runs the real command, so `auto`
    # falls back instead of failing every call.
    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("bubblewrap is not installed")
    bin_dir = Path(tempfile.mkdtemp(dir=sandbox.run_root()))  # `nobody` runs it when this is root
    bin_dir.chmod(0o755)
    fake = bin_dir / "bwrap"
    fake.write_text("#!/bin/sh\n"
                    "for a in \"$@\"; do [ \"$a\" = --size ] && { echo 'bwrap: Unknown option --size' >&2; exit 1; }; done\n"
                    f"exec {real} \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    bwrap_problem.cache_clear()
    try:
        tool = PythonTool(timeout_s=2, cpu_s=1)
        assert tool.isolation == "none"
        assert "WITHOUT a sandbox (bubblewrap cannot sandbox here (bwrap: Unknown option --size))" in \
            capsys.readouterr().err
        with pytest.raises(ValueError, match=r"isolation: bwrap is unavailable: bubblewrap cannot sandbox here"):
            PythonTool(isolation="bwrap")
    finally:
        monkeypatch.undo()
        bwrap_problem.cache_clear()
        shutil.rmtree(bin_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="the program runs as nobody only when agentrl runs as root")
@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_runs_work_when_the_temporary_directory_is_closed_to_nobody(tmp_path, monkeypatch, isolation):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    sandbox.run_root.cache_clear()
    try:
        text, _, _ = run("print('ran')", isolation=isolation)
        assert text == "exit: exit code 0\n--- stdout ---\nran\n" and list(private.iterdir()) == []
    finally:
        monkeypatch.undo()
        sandbox.run_root.cache_clear()


def test_a_run_directory_made_read_only_inside_is_still_removed(tmp_path):
    # Without root, rmtree cannot empty a directory of mode 0500; run as nobody when this is root.
    def attempt() -> bool:
        workdir = Path(tempfile.mkdtemp(prefix="agentrl-python-", dir=sandbox.run_root()))
        (workdir / "d" / "e").mkdir(parents=True)
        (workdir / "d" / "e" / "f").write_text("x")
        (workdir / "d" / "e").chmod(0o500)
        (workdir / "d").chmod(0o000)
        os.symlink("/usr", workdir / "link")  # a link is never followed by the chmod
        sandbox._remove(workdir)
        return not os.path.lexists(workdir)

    if os.geteuid() != 0:
        assert attempt()
        return
    usr_mode = os.stat("/usr").st_mode
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only reports through its exit status
        try:
            os.setgid(sandbox.NOBODY)
            os.setuid(sandbox.NOBODY)
            os._exit(0 if attempt() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and os.stat("/usr").st_mode == usr_mode


def test_bad_configuration_names_the_file_and_value(tmp_path):
    path = tmp_path / "python.yaml"
    path.write_text("tools:\n  - class: agentrl.tools.builtin.python_exec:PythonTool\n"
                    "    config: {isolation: docker}\n")
    with pytest.raises(ConfigError) as e:
        load_tools(path)
    assert str(e.value) == (f"{path}: tool #1 (class 'agentrl.tools.builtin.python_exec:PythonTool'): "
                            "config.isolation = 'docker': expected Literal['auto', 'bwrap', 'none'] "
                            "(Input should be 'auto', 'bwrap' or 'none')")


@needs_bwrap
def test_episode_with_the_repository_tool_file(tokenizer):
    (tool,) = load_tools("tool_configs/python.yaml")
    assert isinstance(tool, PythonTool) and tool.isolation == "bwrap"
    call = {"name": "python", "arguments": {"code": "print(2 ** 100)"}}
    engine = ScriptedEngine(tokenizer, [f"<tool_call>\n{json.dumps(call)}\n</tool_call>", "Done."])
    runner = EpisodeRunner(engine, tokenizer, [tool], parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner.run(Task(id="t", prompt="2**100?"), group_id="g"))
    assert traj.messages[2] == {"role": "tool", "name": "python",
                                "content": "exit: exit code 0\n--- stdout ---\n1267650600228229401496703205376\n"}
    assert traj.finish == "stop" and traj.metrics["python_runs"] == 1.0


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_the_launcher_ends_the_program_at_its_own_deadline_when_no_one_kills_it(isolation):
    """The caller enforces the wall time by killing bubblewrap's process group; a run cancelled
    as it started could kill bubblewrap in the moment after it forked the sandbox and before
    --die-with-parent took hold, and the program then ran on with no wall limit. The launcher's
    own deadline (wall time + LAUNCHER_GRACE_S) ends it, and in bubblewrap its PID namespace."""
    import subprocess

    limits = sandbox.Limits(wall_s=0.5)
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '60'])\nprint('started', flush=True)\ntime.sleep(60)\n"
    uid = sandbox.run_uid(isolation)
    workdir = sandbox._new_workdir(code, isolation, uid)
    status_r, status_w = os.pipe()
    try:
        started = time.monotonic()
        # capture_output waits for end-of-file too: for every process holding stdout to be gone
        done = subprocess.run(sandbox._command(isolation, sandbox.resolve_python("python3"), workdir, limits, status_w),
                              capture_output=True, text=True, timeout=20, pass_fds=(status_w,),
                              stdin=subprocess.DEVNULL, cwd=workdir, env=sandbox._environment(workdir),
                              start_new_session=True, **sandbox._user_kwargs(uid))
        elapsed = time.monotonic() - started
    finally:
        os.close(status_w)
        os.close(status_r)
        sandbox._remove(workdir)
    assert done.stdout == "started\n"
    assert 1 + sandbox.LAUNCHER_GRACE_S - 0.5 < elapsed < 1 + sandbox.LAUNCHER_GRACE_S + 5, elapsed


def test_a_run_that_cannot_make_its_pipes_leaves_no_directory_or_descriptor(monkeypatch):
    """Its directory and first pipes were made outside the try that removes them (EMFILE)."""
    import errno

    made, real_pipe = [], os.pipe

    def pipe() -> tuple[int, int]:
        if len(made) == 2:
            raise OSError(errno.EMFILE, "Too many open files")
        made.append(real_pipe())
        return made[-1]

    before = set(Path(sandbox.run_root()).glob("agentrl-python-*"))
    monkeypatch.setattr(os, "pipe", pipe)
    with pytest.raises(OSError, match="Too many open files"):
        asyncio.run(sandbox.run_python("print(1)", sandbox.Limits(), "none", sandbox.resolve_python("python3")))
    monkeypatch.undo()
    assert set(Path(sandbox.run_root()).glob("agentrl-python-*")) == before
    for fd in (fd for pair in made for fd in pair):
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)


def test_the_tool_promises_no_network_only_where_the_sandbox_takes_it_away(capsys):
    described = lambda tool: tool.schema["function"]["description"]  # noqa: E731
    assert "without network access" not in described(PythonTool(isolation="none"))
    if bwrap_problem() is None:
        assert "without network access" in described(PythonTool(isolation="bwrap"))


@pytest.mark.skipif(os.geteuid() != 0, reason="a run gets a user of its own only when agentrl runs as root")
def test_without_bubblewrap_concurrent_runs_as_root_each_have_a_user_and_a_process_limit_of_their_own():
    """Every run was `nobody`, whose process count the kernel keeps over all of them: with 17
    others in flight, a program could not start one thread."""
    code = ("import os, threading, time\nt = threading.Thread(target=time.sleep, args=(1.5,))\nt.start()\n"
            "print(os.getuid())\nt.join()\n")
    python = sandbox.resolve_python("python3")

    async def together() -> list[sandbox.RunResult]:
        return await asyncio.gather(*(sandbox.run_python(code, sandbox.Limits(wall_s=30), "none", python)
                                      for _ in range(18)))

    results = asyncio.run(together())
    assert [(r.exit_code, r.stderr) for r in results] == [(0, "")] * 18
    uids = [int(r.stdout) for r in results]
    assert len(set(uids)) == 18 and all(uid in sandbox.RUN_UIDS for uid in uids)


def test_a_user_namespace_that_maps_too_few_uids_keeps_runs_as_nobody(tmp_path, monkeypatch):
    """Rootless containers often map only 0..65535: a chown or setuid to a run's own uid failed
    there (EINVAL) on every call."""
    full, narrow = tmp_path / "full", tmp_path / "narrow"
    full.write_text("         0          0 4294967295\n")
    narrow.write_text("         0     100000      65536\n")
    assert sandbox.run_uids_mapped(str(full)) and not sandbox.run_uids_mapped(str(narrow))
    assert not sandbox.run_uids_mapped(str(tmp_path / "missing"))
    if os.geteuid() == 0:
        monkeypatch.setattr(sandbox, "run_uids_mapped", lambda: False)
        assert sandbox.run_uid("none") == sandbox.NOBODY
        text, _, _ = run("import os\nprint(os.getuid())", isolation="none")
        assert text == f"exit: exit code 0\n--- stdout ---\n{sandbox.NOBODY}\n"


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_a_program_the_launchers_deadline_ended_is_reported_at_the_wall_limit(isolation, monkeypatch):
    """Past its deadline the launcher kills the program itself (the caller's loop stalled): that
    read as "sandbox error (exit code -9)" or "killed by signal SIGKILL"."""
    monkeypatch.setattr(sandbox, "launcher_deadline_s", lambda limits: 1)  # before the caller's 10 s
    result = asyncio.run(sandbox.run_python("import time\ntime.sleep(60)\n", sandbox.Limits(wall_s=10), isolation,
                                            sandbox.resolve_python("python3")))
    assert result.limit == "wall" and result.wall_s < 5, result
