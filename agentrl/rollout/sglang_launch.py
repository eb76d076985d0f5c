"""Launching and stopping `python -m sglang.launch_server` for the server-mode engine
(sglang_server.py): a free loopback port, the CPU backend's environment, a log file, a health wait,
and the server's whole process group stopped at exit.

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


def launch_server(args: dict[str, Any], timeout_s: float) -> tuple[subprocess.Popen, str, str]:
    """Start launch_server on a free loopback port; returns (process, url, log path) once healthy."""
    with socket.socket() as probe:  # the OS picks a free port; the server binds it right after
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ)
    if args.get("device") == "cpu":
        env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    log = tempfile.NamedTemporaryFile("w", prefix="sglang-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "sglang.launch_server", *cli_flags(args), "--host", "127.0.0.1", "--port", str(port)]
    with log:  # the server writes to its own copy of the descriptor; the log stays for whoever reads it
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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


def log_tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:] if line.strip())
    except OSError as e:  # removed meanwhile (a temp-dir clean-up): the failure it was to explain stands
        return f"(the log cannot be read: {e.strerror})"
