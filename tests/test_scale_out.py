"""The Ray backend with FSDP2 ranks, exact resume after a SIGKILL, and what a dead worker does to a run.

Everything runs for real through the `agentrl` command: a local Ray on 127.0.0.1, two FSDP2 ranks
over gloo, an engine replica in its own actor, the tiny model from conftest.py.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

REWARDS = '''
import time


def length_parity(task, messages):
    """Mixed rewards from random replies (the last as sampled, cut off or not); slow enough that a
    step can be interrupted mid-rollout."""
    time.sleep(0.05)
    return float(len(messages[-1]["content"]) % 2 == 0)
'''


def train_command(tiny_model_dir: Path, out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml", f"model.path={tiny_model_dir}",
            "model.dtype=float32", f"output_dir={out}", "reward.function=scale_rewards:length_parity",
            "rollout.group_size=4", "rollout.max_turns=1", "rollout.max_new_tokens_per_turn=8",
            "trainer.tasks_per_step=2", "trainer.lr=1e-3", "trainer.dtype=float32", "model.dtype=float32", *overrides]


@pytest.fixture
def env(tmp_path):
    (tmp_path / "scale_rewards.py").write_text(REWARDS)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture
def ray_tmp():
    """A temporary directory for Ray (RAY_TMPDIR), removed after the test; short, because Ray's
    socket paths under it must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def trajectories(run: Path, step: int) -> list[tuple[str, list[int]]]:
    rows = [json.loads(line) for line in (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
    return [(r["task_id"], r["token_ids"]) for r in rows]


def test_two_fsdp_ranks_under_ray_take_the_same_first_step_as_one_process(tmp_path, tiny_model_dir, env, ray_tmp):
    """Same seed, same samples, same update: the first step's loss and gradient norm agree.

    Tolerance 1e-5 relative: both sides compute in float32 and normalise every rank's loss by the
    mini-batch's global token count; what differs is only the order of floating-point sums (each
    rank sums its own share, then FSDP's reduce-scatter adds the two), which moves the ~7th digit.
    """
    runs = {}
    # A cluster that `ray start` once recorded on this machine, long gone: the run's own Ray must
    # not try to join it (ray.init() would, and refuse the run's CPU count).
    (Path(ray_tmp) / "ray").mkdir()
    (Path(ray_tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    # An earlier run in the Ray run's directory: its table goes to previous/ with it, and the new
    # run's own table (written as its roles start) must not go with it.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "config.yaml").write_text("name: earlier\n")
    (tmp_path / "ray" / "workers.json").write_text('{"policy rank 0": 1}')
    (tmp_path / "tmp").mkdir()  # where rank 0 of each role leaves its rendezvous file
    for backend, extra in (("local", []), ("ray", ["trainer.world_size=2"])):
        out = tmp_path / backend
        done = subprocess.run(train_command(tiny_model_dir, out, "trainer.steps=1", "algorithm.kl_coef=0.01",
                                            "algorithm.entropy_coef=0.01",
                                            f"trainer.backend={backend}", *extra),
                              capture_output=True, text=True, timeout=600,
                              env={**env, "RAY_TMPDIR": ray_tmp, "TMPDIR": str(tmp_path / "tmp")})
        assert done.returncode == 0, done.stderr[-3000:]
        runs[backend] = out
    assert list((tmp_path / "tmp").glob("agentrl-rendezvous-*")) == []  # the run removed what it made
    local, ray = metrics(runs["local"])[0], metrics(runs["ray"])[0]
    assert trajectories(runs["ray"], 1) == trajectories(runs["local"], 1)  # one engine replica, same seed
    assert local["loss"] != 0 and local["grad_norm"] > 0
    assert ray["loss"] == pytest.approx(local["loss"], rel=1e-5, abs=1e-9)
    assert ray["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-5)
    assert ray["kl_ref"] == pytest.approx(local["kl_ref"], abs=1e-9)  # the sharded reference agrees too
    assert ray["rollout_logprob_diff"] < 1e-5 and ray["synced_version"] == 1
    workers = json.loads((runs["ray"] / "workers.json").read_text())
    assert sorted(workers) == ["policy rank 0", "policy rank 1", "reference rank 0", "reference rank 1",
                               "rollout replica 0"]
    assert json.loads((runs["ray"] / "previous" / "workers.json").read_text()) == {"policy rank 0": 1}
    # The sharded policy was gathered into a loadable model directory.
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(runs["ray"] / "final").config.architectures == ["LlamaForCausalLM"]
    # with the tensors of the unsharded save: the tied head was gathered, and saved, a second time
    from safetensors import safe_open

    def shapes(run):
        with safe_open(str(run / "final" / "model.safetensors"), "pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}

    assert shapes(runs["ray"]) == shapes(runs["local"]) and "lm_head.weight" not in shapes(runs["ray"])


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_run_killed_mid_step_resumes_exactly(tmp_path, tiny_model_dir, env, backend):
    extra = [f"trainer.backend={backend}", "trainer.save_every=1", "trainer.steps=3"]
    # Under Ray each rank is its own process, with its own torch RNG: LoRA's dropout draws from it,
    # and it has to come back with the checkpoint for the resumed run to drop the same inputs.
    extra += ["trainer.world_size=2", "model.lora.rank=4", "model.lora.dropout=0.5"] if backend == "ray" else []
    whole = tmp_path / "whole"
    done = subprocess.run(train_command(tiny_model_dir, whole, *extra), capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = tmp_path / "killed"
    process = subprocess.Popen(train_command(tiny_model_dir, killed, *extra), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (killed / "checkpoints" / "step_1").is_dir():  # step 1 is done and saved ...
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # ... and step 2's rollout is under way (each reward takes 50 ms)
        assert not (killed / "checkpoints" / "step_2").exists()
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the driver and whatever it started
        process.wait()
    resumed = subprocess.run(train_command(tiny_model_dir, killed, *extra, "trainer.resume=auto"),
                             capture_output=True, text=True, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed / 'checkpoints' / 'step_1'} after step 1" in resumed.stdout
    rows = metrics(killed)
    assert [r["step"] for r in rows] == [1, 2, 3]  # each step exactly once
    for step in (2, 3):  # the same tasks and the same sampled tokens as the uninterrupted run
        assert trajectories(killed, step) == trajectories(whole, step)
    for mine, theirs in zip(rows, metrics(whole)):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


def socket_inodes(pid: int) -> set[str]:
    """The socket inodes process `pid` holds open (from /proc/PID/fd)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(FileNotFoundError):  # closed while we looked
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    except (FileNotFoundError, PermissionError):
        pass
    return inodes


def tcp_sockets(pids: list[int]) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address,
                                              ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """(state, local address, remote address) of the TCP sockets the given processes hold, from
    each one's /proc/PID/net/tcp and tcp6 (its own network namespace); an IPv4 address mapped into
    IPv6 reads as the IPv4 one. States as the kernel writes them: 01 established, 0A listening."""
    def address(field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        raw = bytes.fromhex(field.split(":")[0])  # 32-bit words, each in host (little-endian) order
        if len(raw) == 4:
            return ipaddress.IPv4Address(raw[::-1])
        v6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        return v6.ipv4_mapped or v6

    found = []
    for pid in pids:
        inodes = socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except (FileNotFoundError, PermissionError):  # ended while we looked
                continue
            found += [(f[3], address(f[1]), address(f[2])) for f in map(str.split, lines) if f[9] in inodes]
    return found


def tcp_peers(pids: list[int]) -> set[str]:
    """Remote addresses of the TCP connections the given processes hold."""
    return {str(remote) for state, _, remote in tcp_sockets(pids) if state == "01"}


def listening_beyond_loopback(pids: list[int]) -> set[str]:
    """Addresses other than loopback (0.0.0.0 and :: among them) the given processes listen at."""
    return {str(local) for state, local, _ in tcp_sockets(pids) if state == "0A" and not local.is_loopback}


def test_a_killed_worker_stops_the_run_within_a_minute_naming_it(tmp_path, tiny_model_dir, env, ray_tmp):
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    process = subprocess.Popen(train_command(tiny_model_dir, out, "trainer.backend=ray", "trainer.world_size=2",
                                             "trainer.steps=1000"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**env, "RAY_TMPDIR": ray_tmp, "TMPDIR": str(tmp)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # The policy's two ranks met at a file (a TCP store asks DNS for the name of 127.0.0.1).
        assert len(list(tmp.glob("agentrl-rendezvous-*"))) == 1
        workers = json.loads((out / "workers.json").read_text())
        # Ray and the process groups talk over loopback only, and nothing of the run (Ray's own
        # processes, the ranks, the rendezvous store of each role's rank 0) listens anywhere else.
        assert tcp_peers([process.pid, *workers.values()]) <= {"127.0.0.1"}
        assert not listening_beyond_loopback(session_processes(process.pid))
        victim = workers["policy rank 1"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        stopped_after = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("agentrl: error: policy rank 1 failed during ") and "died" in last, last
    assert list(tmp.glob("agentrl-rendezvous-*")) == []  # the driver removed it as it tore the run down
    assert stopped_after < 60, stopped_after


def test_a_ray_address_where_nothing_answers_stops_the_run_naming_the_key(tmp_path, tiny_model_dir, env):
    """`ray.init` retries an address nobody listens at forever, printing warnings: a typo in
    trainer.ray_address, or a cluster that is down, used to hang the run."""
    import socket

    with socket.socket() as probe:  # a loopback port nothing listens at once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run(train_command(tiny_model_dir, tmp_path / "run", "trainer.backend=ray", "trainer.world_size=2",
                                        f"trainer.ray_address=127.0.0.1:{port}"),
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"agentrl: error: trainer.ray_address: no Ray cluster answers at '127.0.0.1:{port}' (ConnectionRefusedError")


def checked(address: str, env: dict[str, str]) -> str:
    """What check_ray_address says about `address` in a process of its own: Ray reads its auth
    settings from the environment once per process."""
    probe = ("import sys; from agentrl.errors import RunFailed\n"
             "from agentrl.trainer.ray_cluster import check_ray_address\n"
             "try:\n    check_ray_address(sys.argv[1], timeout_s=5)\nexcept RunFailed as e:\n    print(e)\n"
             "else:\n    print('ok')")
    return subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True, env=env,
                          timeout=60).stdout.strip()


def test_a_ray_address_where_something_else_listens_fails_at_once_and_a_real_head_passes(env, ray_tmp):
    """`ray.init` retried a port where an HTTP server (say) answers for about 14 minutes; the check
    asks the GCS the first question Ray's start-up asks, with a time limit. A real head started with
    `ray start` on loopback passes it, and one that wants another auth token is named as such."""
    import http.server
    import secrets
    import socket
    import threading

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        assert checked(f"127.0.0.1:{web.server_port}", env).startswith(
            f"trainer.ray_address: no Ray cluster answers at '127.0.0.1:{web.server_port}': something else listens "
            "there (UNAVAILABLE")
    finally:
        web.shutdown()

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The head's own token, so that no token of the machine's (~/.ray/auth_token) is involved, and
    # its own temporary directory: `ray start` records its cluster there, for later ray.init()s.
    env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_TMPDIR": ray_tmp}
    head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}",
                             "--num-cpus=1", "--include-dashboard=false", "--node-ip-address=127.0.0.1", "--block",
                             "--disable-usage-stats"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while (said := checked(f"127.0.0.1:{port}", env)) != "ok":  # the head takes a few seconds to listen
            assert head.poll() is None and time.monotonic() < deadline, said
            time.sleep(0.5)
        assert checked(f"127.0.0.1:{port}", {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}).startswith(
            f"trainer.ray_address: the Ray cluster at '127.0.0.1:{port}' refused this process's auth token")
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # `ray start --block` and the head processes it started
        head.wait()


def session_processes(sid: int) -> list[int]:
    """Processes of session `sid` (field 6 of /proc/PID/stat), zombies left out."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # ended while we looked
            pass
    return found


@pytest.mark.parametrize("to", ["driver", "process group"])
def test_sigterm_to_a_ray_run_stops_it_like_ctrl_c(tmp_path, tiny_model_dir, env, ray_tmp, to):
    """ray.init put a C++ handler of its own on SIGTERM in the driver: a supervisor's SIGTERM (a
    container's stop) ended the run at once with a stack dump and status 134, closing nothing. Sent
    to the whole process group (`kill -- -PGID`, a closed terminal), it ends the run's own Ray too:
    the driver then waited 60 s on the dead GCS to remove the placement group, and ended with
    status 1."""
    out = tmp_path / "run"
    process = subprocess.Popen(train_command(tiny_model_dir, out, "trainer.backend=ray", "trainer.steps=50"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**env, "RAY_TMPDIR": ray_tmp}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():  # a step done
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        if to == "driver":
            process.send_signal(signal.SIGTERM)  # as `docker stop` sends it
        else:
            os.killpg(process.pid, signal.SIGTERM)  # the driver and every Ray process it started
        _, stderr = process.communicate(timeout=180)
        assert process.returncode == 143, stderr[-3000:]
        assert stderr.splitlines()[-1] == "agentrl: terminated by SIGTERM"
        deadline = time.monotonic() + 30  # the run's own Ray went down with it
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not session_processes(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


SIGNAL_IN_RAY_WAIT = '''
import os, signal, sys, threading, time
from pathlib import Path
import ray
from agentrl import cli
from agentrl.trainer.ray_cluster import restore_signal_handlers, start_local_ray
from agentrl.trainer.ray_groups import Supervisor

started = Path(sys.argv[1])

@ray.remote
def step():
    started.write_text("1")
    time.sleep(120)

def send_sigterm_once_waiting():
    while not started.exists():
        time.sleep(0.05)
    time.sleep(1.0)  # the driver is blocked in ray.wait, which checks for signals every few milliseconds
    os.kill(os.getpid(), signal.SIGTERM)

def command(args):
    handlers = {signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    start_local_ray([{"CPU": 1.0}])
    restore_signal_handlers(handlers)
    try:
        threading.Thread(target=send_sigterm_once_waiting, daemon=True).start()
        Supervisor(600).wait([step.remote()], ["trainer rank 0"], "the update")
    finally:
        ray.shutdown()
    return 0

cli._recipe_command = command
sys.exit(cli.main(["train", "recipes/quickstart.yaml"]))
'''


def test_sigterm_while_the_driver_waits_on_ray_is_reported_as_sigterm(tmp_path, env, ray_tmp):
    """ray.wait and ray.get run the signal handlers while they block and raise a plain
    KeyboardInterrupt in place of what the handler raised: a SIGTERM that landed there (where a Ray
    run's driver spends most of its time) ended the run as a Ctrl-C, status 130 and "interrupted".
    Here the SIGTERM lands in the real Supervisor's ray.wait every time."""
    process = subprocess.run([sys.executable, "-c", SIGNAL_IN_RAY_WAIT, str(tmp_path / "started")],
                             capture_output=True, text=True, env={**env, "RAY_TMPDIR": ray_tmp}, timeout=300)
    assert (tmp_path / "started").exists()
    assert process.returncode == 143, process.stderr[-3000:]
    assert process.stderr.splitlines()[-1] == "agentrl: terminated by SIGTERM"


def test_a_recipe_error_found_inside_a_ray_worker_exits_as_a_recipe_error(tmp_path, tiny_model_dir, env):
    # Found only when the policy builds its adapters: exit 2 naming the key, as on the local backend,
    # not a worker failure (exit 1).
    done = subprocess.run(train_command(tiny_model_dir, tmp_path / "run", "trainer.backend=ray", "trainer.steps=1",
                                        "model.lora.rank=4", "model.lora.target_modules=[nope_proj]"),
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("agentrl: error: policy rank 0: model.lora.target_modules") and "nope_proj" in last


# The run's own Ray as the driver starts it (ray_environment before ray is imported), one
# task through it, and a wait in which the dashboard process runs its usage module.
PRIVATE_RAY = '''
import time
from agentrl.trainer.ray_settings import ray_environment
ray_environment(private=True)
import ray
from agentrl.trainer.ray_cluster import start_local_ray
start_local_ray([{"CPU": 1.0}])
print(ray.get(ray.remote(lambda: 41 + 1).remote()))
time.sleep(3)
ray.shutdown()
'''


def test_the_runs_own_ray_sends_nothing_beyond_loopback(env, ray_tmp, tmp_path):
    """Ray's dashboard process asked 169.254.169.254 twice which cloud it runs on, and the system's
    name server for metadata.google.internal, on every run, usage reporting off or not. The suite
    gives every process it starts a refusing proxy (tests/loopback_guard.py); this run goes
    without, as a user's does, and is read from outside with strace."""
    from tests.loopback_guard import is_local
    from tests.test_rendezvous import addresses_reached, strace_works

    if not strace_works():
        pytest.skip("strace is missing or cannot trace here: apt-get install -y strace")
    plain = {key: value for key, value in env.items() if not key.lower().endswith("_proxy")}
    trace = tmp_path / "trace"
    done = subprocess.run(["strace", "--seccomp-bpf", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg",
                           "-o", str(trace), sys.executable, "-c", PRIVATE_RAY],
                          capture_output=True, text=True, env={**plain, "RAY_TMPDIR": ray_tmp}, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["42"], done.stderr[-3000:]
    reached = addresses_reached(trace.read_text())
    assert "127.0.0.1" in reached  # the trace saw Ray's own connections
    assert {address for address in reached if not is_local(address)} == set()


CLOSE_WHILE_COLLECTING = '''
import sys, time
from pathlib import Path
import ray
from agentrl.trainer.distributed import Ranks
from agentrl.trainer.launch import RoleActor
from agentrl.trainer.ray_cluster import start_local_ray

closed, result = Path(sys.argv[1]), Path(sys.argv[2])

class Collecting:
    def collect(self):
        time.sleep(120)

    def close(self):
        closed.write_text("closed")

def make(config, pad_id, ranks):
    return Collecting()

start_local_ray([{"CPU": 1.0}])
actor = RoleActor.options(max_concurrency=2).remote(1)  # as RayRoles starts them: a slot for the sentinel
sentinel = actor.sentinel.remote()
ray.get(actor.setup.remote(make, None, 0, Ranks(0, 1), "", False))
collecting = actor.call.remote("collect")
time.sleep(1.0)
started = time.monotonic()
ready, _ = ray.wait([actor.close.remote()], timeout=30)
state = "closed" if ready and closed.exists() else "still waiting"
result.write_text(f"{state} after {time.monotonic() - started:.0f} s")
ray.kill(actor)
ray.shutdown()
'''


def test_a_rollout_worker_closes_while_a_collect_still_runs(tmp_path, env, ray_tmp):
    """A run stopped mid-rollout (a SIGTERM, another worker's failure) closes its rollout workers:
    `close` queued behind the running `collect` until shutdown's 60 s ran out and it killed the
    actor, so a launched SGLang server and the last sync's weight files were never removed."""
    process = subprocess.run([sys.executable, "-c", CLOSE_WHILE_COLLECTING, str(tmp_path / "closed"),
                              str(tmp_path / "result")],
                             capture_output=True, text=True, env={**env, "RAY_TMPDIR": ray_tmp}, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    result = (tmp_path / "result").read_text()
    assert re.fullmatch(r"closed after \d+ s", result), result
    assert (tmp_path / "closed").read_text() == "closed"


RAISE_IN_A_WORKER = '''
import sys, ray
from agentrl.errors import RunFailed
from agentrl.trainer.ray_cluster import start_local_ray
from agentrl.trainer.ray_groups import Supervisor

@ray.remote
def update_on_rank_1():
    rows = {"loss": 1.0}
    return rows["advantages"]

@ray.remote
def validate():
    raise ValueError("2 problems in the batch\\n  advantages: missing\\n  For more, see the docs")

@ray.remote
def time_out_in_the_collective():  # its peer hangs outside it
    raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")

@ray.remote
def hang():
    import time
    time.sleep(120)

start_local_ray([{"CPU": 1.0}])
errors = []
for task, what in ((update_on_rank_1, "update"), (validate, "validation")):
    try:
        Supervisor(600).wait([task.remote()], ["policy rank 1"], what)
    except RunFailed as e:
        errors.append(str(e))
try:
    Supervisor(600).wait([time_out_in_the_collective.remote(), hang.remote()], ["policy rank 0", "policy rank 1"],
                         "update")
except RunFailed as e:
    errors.append(str(e))
open(sys.argv[1], "w").write("\\n".join(errors))
ray.shutdown()
'''


def test_a_worker_exception_is_reported_whole_with_its_traceback(tmp_path, env, ray_tmp):
    """The run's error kept only the last line of the worker's message (a multi-line message read
    'For more, see the docs'), and the worker's frames were printed nowhere, so nothing said where
    in the worker it failed."""
    process = subprocess.run([sys.executable, "-c", RAISE_IN_A_WORKER, str(tmp_path / "errors")], capture_output=True,
                             text=True, env={**env, "RAY_TMPDIR": ray_tmp}, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    assert (tmp_path / "errors").read_text().splitlines() == [
        "policy rank 1 failed during update: KeyError: 'advantages'",
        "policy rank 1 failed during validation: ValueError: 2 problems in the batch advantages: missing For more, "
        "see the docs",
        # a rank that hung: its peer timed out first, and only being still running named the hung one
        "policy rank 0 failed during update: RuntimeError: [gloo] Timed out waiting 5000ms for recv operation to "
        "complete; still running then: policy rank 1"]
    assert "agentrl: policy rank 1 raised during update:\n" in process.stderr
    assert re.search(r'File "<string>", line 10, in update_on_rank_1\nKeyError', process.stderr), process.stderr


PEER_DIES_IN_A_COLLECTIVE = '''
import os, socket, sys, time
import ray
from agentrl.errors import RunFailed
from agentrl.trainer.ray_cluster import start_local_ray
from agentrl.trainer.ray_groups import Supervisor

@ray.remote(max_concurrency=2)
class Rank:
    def sentinel(self):
        while True:
            time.sleep(60)

    def listen(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        return self.listener.getsockname()[1]

    def update(self, port):
        if port is not None:  # the rank that is OOM-killed mid-collective
            peer = socket.create_connection(("127.0.0.1", port))
            time.sleep(0.5)
            os._exit(137)
        connection, _ = self.listener.accept()
        connection.recv(1)  # returns as the kernel closes the dead peer's socket, before Ray notices
        raise RuntimeError("[gloo] Connection closed by peer")

start_local_ray([{"CPU": 2.0}])
ranks = [Rank.remote(), Rank.remote()]
supervisor = Supervisor(600)
for i, rank in enumerate(ranks):
    supervisor.watch(rank, f"policy rank {i}")
port = ray.get(ranks[0].listen.remote())
try:
    supervisor.wait([ranks[0].update.remote(None), ranks[1].update.remote(port)],
                    ["policy rank 0", "policy rank 1"], "update")
except RunFailed as e:
    open(sys.argv[1], "w").write(str(e))
ray.shutdown()
'''


def test_a_rank_that_dies_in_a_collective_is_named_not_the_peer_that_lost_it(tmp_path, env, ray_tmp):
    """Rank 0's collective fails the moment rank 1's process dies, before Ray notices the death:
    the run reported 'policy rank 0 failed during update: RuntimeError: ... Connection closed by
    peer', sending the user after the healthy rank."""
    process = subprocess.run([sys.executable, "-c", PEER_DIES_IN_A_COLLECTIVE, str(tmp_path / "error")],
                             capture_output=True, text=True, env={**env, "RAY_TMPDIR": ray_tmp}, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    last = (tmp_path / "error").read_text()
    assert last.startswith("policy rank 1 failed during update: the process died"), last
