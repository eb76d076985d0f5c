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
print(use_tcmalloc(), sys.argv[1:], os.environ.get("LD_PRELOAD") or "-", os.environ.get("MARK"),
      os.environ.get("TCMALLOC_RELEASE_RATE", "-"))
"""


def run(env: dict[str, str], base: dict[str, str] | None = None) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, "a b", "--flag=1"], capture_output=True, text=True,
                          timeout=60, env={**(os.environ if base is None else base), "MARK": "kept", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_command_runs_again_on_tcmalloc_with_the_same_arguments_and_environment():
    library = find_tcmalloc()
    if library is None:
        pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4, `make system-packages`)")
    env = {key: value for key, value in os.environ.items() if key != "TCMALLOC_RELEASE_RATE"}
    lines = run({"LD_PRELOAD": ""}, env)
    # tcmalloc keeps freed pages (release rate 0) unless the user set a rate
    assert lines == ["start", "start", f"tcmalloc ['a b', '--flag=1'] {library} kept 0"]
    lines = run({"LD_PRELOAD": "", "TCMALLOC_RELEASE_RATE": "2"}, env)
    assert lines == ["start", "start", f"tcmalloc ['a b', '--flag=1'] {library} kept 2"]


def test_the_system_allocator_when_asked_for_it():
    env = {key: value for key, value in os.environ.items() if key != "TCMALLOC_RELEASE_RATE"}
    assert run({"AGENTRL_ALLOCATOR": "system", "LD_PRELOAD": ""}, env) == ["start", "system ['a b', '--flag=1'] - kept -"]


def test_main_called_from_a_program_never_re_executes_that_program(tmp_path):
    """`agentrl.cli.main([...])` from a script or a notebook: re-executing sys.orig_argv would run
    the caller's program again from its start (a notebook's kernel replaced)."""
    if find_tcmalloc() is None:
        pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4, `make system-packages`)")
    script = ("print('start', flush=True)\n"
              "from agentrl.cli import main\n"
              f"print(main(['rollout', 'recipes/rollout_cpu.yaml', 'model.path={tmp_path}/no-model', "
              f"'output_dir={tmp_path}/out']), flush=True)\n")
    env = {key: value for key, value in os.environ.items() if key not in ("AGENTRL_ALLOCATOR", "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.splitlines() == ["start", "2"], done.stderr  # the missing model: a ConfigError, once
    assert "agentrl: memory allocator system" in done.stderr


def test_a_program_read_from_stdin_is_not_executed_again():
    """Re-executed, `python -` found its stdin used up: the program did nothing and exited 0."""
    if find_tcmalloc() is None:
        pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4, `make system-packages`)")
    env = {key: value for key, value in os.environ.items()
           if key not in ("LD_PRELOAD", "AGENTRL_ALLOCATOR", "TCMALLOC_RELEASE_RATE")}
    done = subprocess.run([sys.executable, "-", "a b"], input=SCRIPT + 'print("done")\n', capture_output=True,
                          text=True, timeout=60, env={**env, "MARK": "kept"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["start", "system ['a b'] - kept -", "done"]


def test_an_allocator_choice_other_than_system_or_tcmalloc_is_refused(tmp_path):
    """`AGENTRL_ALLOCATOR=glibc` was ignored: the command re-executed on tcmalloc all the same."""
    env = {**os.environ, "AGENTRL_ALLOCATOR": "glibc"}
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "recipes/rollout_cpu.yaml",
                           f"model.path={tmp_path}/no-model", f"output_dir={tmp_path}/out"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2, "agentrl: error: AGENTRL_ALLOCATOR: 'glibc' is neither 'system' (glibc's malloc) nor 'tcmalloc' (the "
           "default)"), done.stderr
