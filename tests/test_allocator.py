"""The CPU memory allocator: a command re-executes itself once on tcmalloc, arguments intact."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentrl.allocator import find_tcmalloc

# Prints what the re-executed process sees; "start" shows how many times the script began.
SCRIPT = """
import os, sys
print("start", flush=True)
from agentrl.allocator import use_tcmalloc
print(use_tcmalloc(), sys.argv[1:], os.environ.get("LD_PRELOAD") or "-", os.environ.get("MARK"))
"""


def run(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, "a b", "--flag=1"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MARK": "kept", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_command_runs_again_on_tcmalloc_with_the_same_arguments_and_environment():
    library = find_tcmalloc()
    if library is None:
        pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4, `make system-packages`)")
    lines = run({"LD_PRELOAD": ""})
    assert lines == ["start", "start", f"tcmalloc ['a b', '--flag=1'] {library} kept"]


def test_the_system_allocator_when_asked_for_it():
    assert run({"AGENTRL_ALLOCATOR": "system", "LD_PRELOAD": ""}) == ["start", "system ['a b', '--flag=1'] - kept"]
