"""Launching and stopping `python -m sglang.launch_server` for the server-mode engine
(sglang_server.py): a free loopback port, the CPU backend's environment, a log file, a health wait,
and the server's whole process group stopped at exit.

The server runs in a session of its own (so that its group, schedulers included, is stopped as
one), which no signal to the launcher's group reaches; and a launcher that dies without running
its exit code (SIGKILL, the OOM killer, `ray.kill` of a rollout actor) stops nothing. So the
server's process also watches a pipe from the launcher and stops its group when the pipe closes,
as it does whenever the launcher's process ends. (PR_SET_PDEATHSIG would fire when the launching
*thread* ends, and the launch may run on any thread: a Ray actor's method, a rollout's set-up.)

This module does not import sglang: the server is a subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx


def cli_flags(args: dict[str, Any]) -> list[str]:
    """ServerArgs fields → launch_server flags (`tp_size=2` → `--tp-size 2`, True → bare flag, a
    list → one value each as argparse's nargs reads them, a mapping → JSON)."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None and value is not False:
            flags += [flag, str(value)]
    return flags


# `python -m sglang.launch_server`, plus a thread that stops the server's group once the pipe whose
# read end is argv[1] reaches its end: SIGTERM, then SIGKILL for a group still there 30 s later.
WATCHED_SERVER = """\
import os, runpy, signal, sys, threading, time
def watch(fd):
    while os.read(fd, 1):
        pass
    os.killpg(0, signal.SIGTERM)
    time.sleep(30)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, args=(int(sys.argv.pop(1)),), name="agentrl-launcher-watch", daemon=True).start()
sys.argv[0] = "sglang.launch_server"
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""
_lifelines: dict[int, int] = {}  # a launched server's pid -> the pipe end it watches


def launch_server(args: dict[str, Any], timeout_s: float) -> tuple[subprocess.Popen, str, str]:
    """Start launch_server on a free loopback port; returns (process, url, log path) once healthy."""
    with socket.socket() as probe:  # the OS picks a free port; the server binds it right after
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ)
    if args.get("device") == "cpu":
        env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    log = tempfile.NamedTemporaryFile("w", prefix="sglang-server-", suffix=".log", delete=False)
    watched, held = os.pipe()  # the launcher holds the write end for the server's life and never writes
    cmd = [sys.executable, "-c", WATCHED_SERVER, str(watched), *cli_flags(args), "--host", "127.0.0.1",
           "--port", str(port)]
    try:
        with log:  # the server writes to its own copy of the descriptor; the log stays for whoever reads it
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                       pass_fds=(watched,))
    except BaseException:
        os.close(held)
        raise
    finally:
        os.close(watched)
    _lifelines[process.pid] = held
    atexit.register(stop_server, process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    # trust_env off: an HTTP_PROXY from the environment would take loopback requests to the proxy
    # (NO_PROXY=localhost does not cover 127.0.0.1), and the healthy server was never reached
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"SGLang server for {url} exited with code {process.returncode} while starting; "
                                   f"log {log.name}: {log_tail(log.name)}")
            try:
                if client.get(f"{url}/health_generate").status_code == 200:
                    return process, url, log.name
            except httpx.TransportError:
                pass
            time.sleep(1.0)
    stop_server(process)
    raise RuntimeError(f"SGLang server at {url} was not healthy within {timeout_s:.0f} s; log {log.name}: "
                       f"{log_tail(log.name)}")


def stop_server(process: subprocess.Popen) -> None:
    """Stop the server and the scheduler processes it started (its own process group)."""
    try:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
            except ProcessLookupError:  # it ended on its own meanwhile
                pass
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    finally:  # after the stop, or its watch would send a second SIGTERM into the shutdown
        held = _lifelines.pop(process.pid, None)
        if held is not None:
            os.close(held)


def log_tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:] if line.strip())
    except OSError as e:  # removed meanwhile (a temp-dir clean-up): the failure it was to explain stands
        return f"(the log cannot be read: {e.strerror})"
