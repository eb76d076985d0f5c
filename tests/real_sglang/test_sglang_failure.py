"""A real SGLang scheduler that fails, under the in-process engine.

SGLang's scheduler sends its parent SIGQUIT when it fails, and SGLang's own handler then SIGKILLs
the parent and its children: a training run ended with status -9 and no line of its own. The engine
hands SGLang a handler that raises as Ctrl-C does instead. Here the scheduler really fails: a prompt
holding a token id past the model's vocabulary fails its forward pass. The engine runs in a child
process, since without the handler that process is killed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.real_sglang.episodes import REAL_SGLANG
from tests.real_sglang.test_sglang_train import processes_with

pytestmark = REAL_SGLANG

SCRIPT = '''
import asyncio
from agentrl.errors import Terminated
from agentrl.rollout.sglang_engine import SGLangEngine
from agentrl.types import SamplingParams
from tests.real_sglang.episodes import smollm2_args

engine = SGLangEngine(smollm2_args())
greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
print("generated", asyncio.run(engine.generate([1, 2, 3], greedy)).finish, flush=True)
try:
    asyncio.run(engine.generate([1, 49152 + 1000, 3], greedy))  # SmolLM2 has 49152 token ids
except Terminated as e:
    print("terminated", e.signum, e.cause, flush=True)
finally:
    engine.close()
print("closed", flush=True)
'''


def test_a_failed_scheduler_ends_the_engines_process_with_an_error_it_can_handle():
    run_tmp = tempfile.mkdtemp(prefix="t", dir="/tmp")  # short: SGLang's sockets live in TMPDIR
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "TMPDIR": run_tmp}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.splitlines() == [
        "generated length",
        "terminated 3 SGLang's scheduler processes send it when one of them fails; the log above says why",
        "closed"]
    assert not processes_with(f"TMPDIR={run_tmp}")  # close() stopped what was left of SGLang
    shutil.rmtree(run_tmp)
