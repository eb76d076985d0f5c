"""Where a role's ranks meet (trainer/distributed.py): a file on one machine, TCP across nodes.

The ranks are real processes with real gloo groups. What they send is read with strace, from
outside the processes: torch's store does its name lookups in C++, which no Python hook sees.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from agentrl.trainer.distributed import Ranks, init_process_group, open_rendezvous, remove_rendezvous
from tests.loopback_guard import is_local

# One rank: joins at argv[1] as rank argv[2] of 2, adds its rank + 1 across the group, prints the sum.
RANK = """
import sys, torch, torch.distributed as dist
from agentrl.trainer.distributed import Ranks, init_process_group
rank = int(sys.argv[2])
init_process_group(Ranks(rank, 2), sys.argv[1], "cpu", timeout_s=30.0)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank}: {total.item()}")
dist.destroy_process_group()
"""


def rank_command(rendezvous: str, rank: int, trace: Path | None) -> list[str]:
    command = [sys.executable, "-c", RANK, rendezvous, str(rank)]
    if trace is None:
        return command
    return ["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg,sendmmsg", "-o", f"{trace}.{rank}", *command]


def run_two_ranks(rendezvous: str, trace: Path | None = None) -> list[str]:
    """Both ranks' output (rank 0's first), each rank a process of its own, under strace when
    `trace` is given (the logs go to trace.0 and trace.1)."""
    ranks = [subprocess.Popen(rank_command(rendezvous, rank, trace), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(2)]
    outputs = []
    for process in ranks:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
        outputs.append(out.strip())
    return outputs


def addresses_reached(trace_text: str) -> set[str]:
    """Every IPv4 and IPv6 address a connect or send in an strace log was aimed at."""
    return set(re.findall(r'inet_addr\("([^"]+)"\)', trace_text)) | set(
        re.findall(r'inet_pton\(AF_INET6, "([^"]+)"', trace_text))


def strace_works() -> bool:
    if not shutil.which("strace"):
        return False
    return subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], capture_output=True).returncode == 0


@pytest.mark.timeout(180)
def test_ranks_on_one_machine_meet_at_a_file_and_send_nothing_beyond_loopback(tmp_path):
    """torch's TCPStore client names the v4-mapped address it connects to with getnameinfo, a
    reverse-DNS query to the system's name server for every rank: the file store sends nothing."""
    if not strace_works():
        pytest.skip("strace is missing or cannot trace here: apt-get install -y strace")
    rendezvous, listener = open_rendezvous("127.0.0.1")
    assert listener is None
    url = urlsplit(rendezvous)
    store_file = Path(unquote(url.path))
    assert url.scheme == "file" and store_file.is_file() and store_file.stat().st_size == 0
    assert store_file.name.startswith("agentrl-rendezvous-")

    try:
        assert run_two_ranks(rendezvous, tmp_path / "trace") == ["rank 0: 3.0", "rank 1: 3.0"]
    finally:
        remove_rendezvous(rendezvous)
    assert not store_file.exists()

    traces = "".join(path.read_text() for path in tmp_path.glob("trace.*"))
    reached = addresses_reached(traces)
    assert "127.0.0.1" in reached  # gloo's own connections, which the trace does show
    assert {address for address in reached if not is_local(address)} == set(), traces[-3000:]


# Both ranks, started inside a network namespace of their own; prints [[stdout, stderr, status], ...].
TWO_RANKS = """
import json, subprocess, sys
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(rank)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for rank in range(2)]
try:
    print(json.dumps([[*rank.communicate(timeout=120), rank.returncode] for rank in ranks]))
finally:  # a rank that hangs is not left behind
    for rank in ranks:
        rank.kill()
"""


def own_network() -> list[str] | None:
    """A command prefix that runs a command in a network namespace of its own with only loopback
    up, or None where user namespaces or iproute2 are missing."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not unshare or not ip:
        return None
    prefix = [unshare, "-rn", "sh", "-c", f'{ip} link set lo up && exec "$0" "$@"']
    return prefix if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0 else None


def test_the_same_ranks_meet_over_tcp_when_given_a_tcp_rendezvous():
    """The multi-node path: rank 0 binds the port itself when no listener is handed over. In a
    network namespace where only loopback is up: the TCP store's client asks DNS for the name of
    the address it connects to, and there no name server can be reached."""
    prefix = own_network()
    if prefix is None:
        pytest.skip("needs a network namespace of its own (unshare, and ip from iproute2): torch's TCP store "
                    "would ask the system's name server for the name of 127.0.0.1")
    done = subprocess.run([*prefix, sys.executable, "-c", TWO_RANKS, RANK, "tcp://127.0.0.1:29500"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(done.stdout)
    assert [status for _, _, status in ranks] == [0, 0], [err[-2000:] for _, err, _ in ranks]
    assert [out.strip() for out, _, _ in ranks] == ["rank 0: 3.0", "rank 1: 3.0"]


def test_a_rendezvous_for_ranks_on_several_nodes_is_rank_0s_address_and_a_port_bound_on_every_interface():
    """A node address that is not loopback (no connection is made to it: the socket only listens)."""
    for address, host in (("10.1.2.3", "10.1.2.3"), ("fd00::7", "[fd00::7]")):
        rendezvous, listener = open_rendezvous(address)
        assert listener is not None
        try:
            port = listener.getsockname()[1]
            assert rendezvous == f"tcp://{host}:{port}"
            assert listener.getsockname()[0] in ("0.0.0.0", "::")  # other nodes connect from outside
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # listening already, before any store takes the socket over
        finally:
            listener.close()


def test_a_rank_that_never_joins_fails_the_others_after_the_timeout():
    rendezvous, _ = open_rendezvous("127.0.0.1")
    started = time.monotonic()
    try:
        alone = subprocess.run([sys.executable, "-c", RANK.replace("timeout_s=30.0", "timeout_s=2.0"), rendezvous, "0"],
                               capture_output=True, text=True, timeout=60)
    finally:
        remove_rendezvous(rendezvous)
    assert alone.returncode != 0 and "timeout" in alone.stderr.lower(), alone.stderr[-2000:]
    assert time.monotonic() - started < 30


def test_a_rendezvous_that_is_neither_a_file_nor_tcp_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"rendezvous '127\.0\.0\.1:29500': expected file:///path or tcp://host:port"):
        init_process_group(Ranks(0, 2), "127.0.0.1:29500", "cpu", timeout_s=1.0)
