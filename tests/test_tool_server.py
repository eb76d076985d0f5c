"""`agentrl tools serve` as a real subprocess on loopback, called through RemoteTools and raw HTTP."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.errors import ConfigError
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.base import FunctionTool
from agentrl.tools.loader import load_tools
from agentrl.tools.parsers import ParsedTurn, parse_hermes
from agentrl.tools.remote import RemoteTool, RemoteToolError, RemoteTools
from agentrl.tools.server import ServerSettings, create_app
from agentrl.types import Task, ToolCall
from tests.conftest import JSONHandler, ScriptedEngine, free_port, stop_process

TOKEN = "test-token-5f1c"
TOOLS_YAML = """\
tools:
  - class: calculator
  - class: agentrl.tools.builtin.gsm8k:CheckAnswer
  - class: tests.served_tools:explode
  - class: tests.served_tools:nap
"""


def start_server(tmp_path: Path, *options: str, env_token: str | None = TOKEN, tools_yaml: str = TOOLS_YAML,
                 launcher: tuple[str, ...] = ("-m", "agentrl.cli")) -> tuple[subprocess.Popen, str]:
    tools = tmp_path / "served.yaml"
    tools.write_text(tools_yaml)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("AGENTRL_TOOL_TOKEN", None)
    if env_token:
        env["AGENTRL_TOOL_TOKEN"] = env_token
    proc = subprocess.Popen([sys.executable, *launcher, "tools", "serve", str(tools), "--host", "127.0.0.1",
                             "--port", str(port), *options], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server did not start: {proc.communicate()[1]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    proc, url = start_server(tmp_path_factory.mktemp("server"))
    yield url
    stop_process(proc)


def remote_file(tmp_path: Path, url: str, **config) -> Path:
    path = tmp_path / "remote.yaml"
    entry = {"class": "agentrl.tools.remote:RemoteTools", "config": {"url": url, "token_env": "AGENTRL_TEST_TOKEN", **config}}
    path.write_text(json.dumps({"tools": [entry]}))  # JSON is YAML
    return path


def api(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)


def test_remote_tools_behave_like_local_ones(server, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_TOKEN", TOKEN)
    every = load_tools(remote_file(tmp_path, server))
    assert [t.schema["function"]["name"] for t in every] == ["calculator", "check_answer", "explode", "nap"]
    (check,) = load_tools(remote_file(tmp_path, server, tools=["check_answer"]))
    assert isinstance(check, RemoteTool) and check.schema["function"]["parameters"]["required"] == ["answer"]

    async def lifecycle():
        for episode in ("ep1", "ep2"):  # one submission per episode is checked
            await check.create(f"{episode}/check_answer", ground_truth="#### 72")
        wrong = await check.execute("ep1/check_answer", {"answer": "71"})
        right = await check.execute("ep2/check_answer", {"answer": "72"})
        final = await check.reward("ep2/check_answer")
        for episode in ("ep1", "ep2"):
            await check.release(f"{episode}/check_answer")
        await every[2].create("ep1/explode")
        with pytest.raises(RemoteToolError, match=r"^RuntimeError: boom: why$"):
            await every[2].execute("ep1/explode", {"reason": "why"})
        await every[2].release("ep1/explode")
        return wrong, right, final

    wrong, right, final = asyncio.run(lifecycle())
    assert (wrong.text, wrong.reward, right.text, right.reward, final) == (
        "Incorrect. No more answers will be checked.", 0.0, "Correct.", 1.0, 1.0)
    assert right.metrics == {"answer_correct": 1.0}
    stats = api(server).get("/stats").json()["tools"]
    assert stats["explode"]["execute"]["calls"] >= 1 and stats["explode"]["execute"]["errors"] >= 1
    assert stats["check_answer"]["reward"]["calls"] >= 1 and stats["check_answer"]["reward"]["errors"] == 0


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    client, before = api(server), api(server).get("/stats").json()["responses"]

    def still_serving() -> None:
        created = client.post("/instances", json={"tool": "calculator"}).json()
        reply = client.post(f"/instances/{created['instance_id']}/execute", json={"arguments": {"expression": "6*7"}})
        assert reply.json() == {"text": "42", "reward": None, "metrics": {}, "error": None}
        assert client.delete(f"/instances/{created['instance_id']}").json() == {"error": None}

    refusals = [
        (httpx.get(f"{server}/tools"), 401, "missing or wrong bearer token"),
        (httpx.get(f"{server}/tools", headers={"Authorization": "Bearer wrong"}), 401, "missing or wrong bearer token"),
        # the token before the body: no JSON of an unknown client is parsed
        (httpx.post(f"{server}/instances", content=b'{"tool": ', headers={"Content-Type": "application/json"}), 401,
         "missing or wrong bearer token"),
        (httpx.get(f"{server}/no/such/route"), 401, "missing or wrong bearer token"),
        (client.post("/instances", content=b'{"tool": ', headers={"Content-Type": "application/json"}), 422,
         "invalid request: body.9: JSON decode error"),
        (client.post("/instances", content=b"x" * 10_000_000), 413, "request body over 1000000 bytes"),
        (client.post("/instances/0123abc/execute", json={"arguments": {}}), 404,
         "unknown instance '0123abc' (never created, released or expired)"),
        (client.post("/instances", json={"tool": "calculator", "extra": 1}), 422,
         "invalid request: body.extra: Extra inputs are not permitted"),
        (client.post("/instances", json={"tool": "search"}), 404,
         "unknown tool 'search'; available: calculator, check_answer, explode, nap"),
    ]
    for response, status, detail in refusals:
        assert (response.status_code, response.json()) == (status, {"detail": detail})
        still_serving()
    after = client.get("/stats").json()["responses"]
    delta = {code: after.get(code, 0) - before.get(code, 0) for code in ("401", "404", "413", "422")}
    assert delta == {"401": 4, "404": 2, "413": 1, "422": 2}
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # the one route without the token


def test_wrong_token_in_the_tool_file_is_a_config_error(server, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_TOKEN", "not-the-token")
    path = remote_file(tmp_path, server)
    with pytest.raises(ConfigError) as e:
        load_tools(path)
    assert str(e.value) == (
        f"{path}: tool #1 (class 'agentrl.tools.remote:RemoteTools'): listing its tools failed: RemoteToolError: "
        f"{server}/tools: HTTP 401: missing or wrong bearer token")


@pytest.mark.parametrize("config,problem", [
    ("{url: 'http://127.0.0.1:9', token: hunter2, retries: 0}",
     "listing its tools failed: RemoteToolError: http://127.0.0.1:9/tools: ConnectError: "
     "All connection attempts failed (after 1 attempts)"),
    ("{url: 'http://127.0.0.1:9', token: [hunter2]}",
     "config.token = '***': expected str | None (Input should be a valid string)"),
    ("{url: 'http://127.0.0.1:9', token: hunter2, tools: nope}",
     "config.tools = 'nope': expected list[str] | None (Input should be a valid list)"),
])
def test_a_literal_token_never_appears_in_errors(tmp_path, config, problem):
    path = tmp_path / "remote.yaml"
    path.write_text(f"tools:\n  - class: agentrl.tools.remote:RemoteTools\n    config: {config}\n")
    with pytest.raises(ConfigError) as e:
        load_tools(path)
    assert str(e.value) == f"{path}: tool #1 (class 'agentrl.tools.remote:RemoteTools'): {problem}"


def test_episode_through_the_remote_tools(server, tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("AGENTRL_TEST_TOKEN", TOKEN)
    tools = load_tools(remote_file(tmp_path, server, tools=["calculator", "check_answer"]))
    live_before = api(server).get("/stats").json()["live_instances"]
    calls = [{"name": "calculator", "arguments": {"expression": "1234 * 5678"}},
             {"name": "check_answer", "arguments": {"answer": "7006652"}}]
    turn = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    engine = ScriptedEngine(tokenizer, [turn, "The answer is 7006652."])
    runner = EpisodeRunner(engine, tokenizer, tools, parse_hermes,
                           EpisodeSettings(tool_step_rewards=True, tool_final_rewards=True))
    traj = asyncio.run(runner.run(Task(id="t", prompt="1234 * 5678?", answer="#### 7006652"), group_id="g"))
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["7006652", "Correct."]
    assert traj.reward == 2.0 and traj.metrics["tool_errors"] == 0 and traj.finish == "stop"
    assert api(server).get("/stats").json()["live_instances"] == live_before  # the episode released both


def test_limits_on_instances_concurrency_and_call_time(tmp_path):
    proc, url = start_server(tmp_path, "--max-instances", "2", "--instance-ttl", "2", "--max-concurrency", "1",
                             "--call-timeout", "2")
    try:
        client = api(url)
        first, second = [client.post("/instances", json={"tool": "nap"}).json()["instance_id"] for _ in range(2)]
        third = client.post("/instances", json={"tool": "nap"})
        assert (third.status_code, third.json()) == (429, {"detail": "2 instances are live; release some first"})

        async def two_naps() -> list[str]:
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                replies = await asyncio.gather(*(c.post(f"/instances/{i}/execute", json={"arguments": {"seconds": 0.5}})
                                                 for i in (first, second)))
            return [r.json()["text"] for r in replies]

        started = time.perf_counter()
        assert asyncio.run(two_naps()) == ["slept 0.5 s", "slept 0.5 s"]
        assert time.perf_counter() - started >= 1.0  # one at a time
        slow = client.post(f"/instances/{first}/execute", json={"arguments": {"seconds": 5}}).json()
        assert slow["error"] == "TimeoutError: nap did not finish within 2 s"
        assert client.get("/stats").json()["abandoned_calls"] == 0  # the nap ended when cancelled
        deadline = time.monotonic() + 10  # unused for the 2 s TTL: both are released by the server
        while client.get("/stats").json()["live_instances"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("/stats").json()["expired_instances"] == 2
        assert client.post("/instances", json={"tool": "nap"}).status_code == 200
    finally:
        stop_process(proc)


SLOW_TOOLS = "tools:\n  - class: tests.served_tools:SlowStart\n  - class: tests.served_tools:nap\n"


def settled(client: httpx.Client, creates: int, releases: int) -> dict:
    """/stats once the server has finished `creates` creates and `releases` releases of slow_start."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = client.get("/stats").json()
        ops = stats["tools"].get("slow_start", {})
        if (ops.get("create", {}).get("calls", 0), ops.get("release", {}).get("calls", 0)) == (creates, releases):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"the server did not finish {creates} creates and {releases} releases: {stats}")


def test_a_create_the_client_gave_up_on_is_released_once_it_exists(tmp_path):
    proc, url = start_server(tmp_path, tools_yaml=SLOW_TOOLS)
    source = RemoteTools(url, token=TOKEN, timeout_s=0.5, tools=["slow_start"])
    (slow,) = source.tools()
    client = api(url)
    try:
        with pytest.raises(RemoteToolError, match=r"^POST /instances: no answer \(ReadTimeout\)$"):
            asyncio.run(slow.create("e1/slow_start", seconds=1.5))  # the client stops waiting after 0.5 s
        assert settled(client, 1, 1)["live_instances"] == 0
        with pytest.raises(TimeoutError):  # cancelled by the caller (ToolEnv's timeout) instead
            asyncio.run(asyncio.wait_for(slow.create("e2/slow_start", seconds=1.0), 0.2))
        assert settled(client, 2, 2)["live_instances"] == 0
        assert asyncio.run(slow.create("e3/slow_start")) == "e3/slow_start"  # in time: it stays
        assert settled(client, 3, 2)["live_instances"] == 1
        asyncio.run(slow.release("e3/slow_start"))
        # A release that comes while the create runs: the create's answer says so.
        replies: list[dict] = []
        body = {"tool": "slow_start", "kwargs": {"seconds": 1.0}, "instance_id": "episode-0002"}
        creating = threading.Thread(target=lambda: replies.append(client.post("/instances", json=body).json()))
        creating.start()
        time.sleep(0.3)
        assert api(url).delete("/instances/episode-0002").json() == {"error": None}
        creating.join()
        assert replies == [{"instance_id": None, "error": "released while it was being created"}]
        assert settled(client, 4, 4)["live_instances"] == 0
    finally:
        source.close()
        stop_process(proc)


def test_named_creates_run_once_and_creates_in_flight_count_against_the_cap(tmp_path):
    proc, url = start_server(tmp_path, "--max-instances", "2", tools_yaml=SLOW_TOOLS)
    client = api(url)

    def create(instance_id: str, tool: str = "slow_start", seconds: float = 0.0) -> httpx.Response:
        return api(url).post("/instances", json={"tool": tool, "kwargs": {"seconds": seconds} if seconds else {},
                                                 "instance_id": instance_id})

    try:
        first, again = create("episode-0001"), create("episode-0001")  # sent again: answered as before
        assert first.json() == again.json() == {"instance_id": "episode-0001", "error": None}
        assert settled(client, 1, 0)["live_instances"] == 1
        taken = create("episode-0001", tool="nap")
        assert (taken.status_code, taken.json()) == (
            409, {"detail": "instance 'episode-0001' exists or is being created"})
        bad = create("a/b")
        assert bad.status_code == 422 and bad.json()["detail"].startswith("invalid request: body.instance_id:")
        assert client.delete("/instances/episode-0001").json() == {"error": None}
        # Two slots, three creates of 2 s at once: the third is refused although none has finished yet.
        # They start 0.3 s apart, so that they reach the server in order on a loaded machine too.
        statuses: dict[int, int] = {}

        def create_slowly(i: int) -> None:
            statuses[i] = create(f"episode-100{i}", seconds=2.0).status_code

        threads = [threading.Thread(target=create_slowly, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
            time.sleep(0.3)
        other = create("episode-1000", tool="nap")  # still being created, by another tool
        assert (other.status_code, other.json()) == (409, {"detail": "instance 'episode-1000' exists or is being created"})
        for thread in threads:
            thread.join()
        assert statuses == {0: 200, 1: 200, 2: 429} and settled(client, 3, 1)["live_instances"] == 2
        # A refused create (429 on the first attempt) made nothing: the client sends no release.
        source = RemoteTools(url, token=TOKEN, tools=["slow_start"])
        (slow,) = source.tools()
        before = client.get("/stats").json()["responses"].get("404", 0)
        with pytest.raises(RemoteToolError, match=r"^HTTP 429: 2 instances are live; release some first$"):
            asyncio.run(slow.create("e1/slow_start"))
        time.sleep(0.5)  # time for the DELETE it would have sent in the background (answered 404)
        source.close()
        assert client.get("/stats").json()["responses"].get("404", 0) == before
    finally:
        stop_process(proc)


class FlakyHandler(JSONHandler):
    """A stand-in HTTP server answering 503 to every other create, to show the client's retry on 5xx.

    `agentrl tools serve` answers 5xx only when it fails itself (or a proxy in front of it does),
    which a test cannot provoke on purpose; everything else here is real HTTP on loopback.
    """

    creates = 0
    schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}

    def do_GET(self) -> None:
        self.reply(200, {"tools": [self.schema]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        FlakyHandler.creates += 1
        self.reply(503, {"detail": "busy"}) if FlakyHandler.creates % 2 else self.reply(
            200, {"instance_id": "abc", "error": None})


def test_client_retries_5xx_and_connection_failures_with_backoff():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    source = RemoteTools(url, token="t", retries=2, backoff_s=0.2)
    (echo,) = source.tools()
    assert asyncio.run(echo.create("e/echo")) == "e/echo" and FlakyHandler.creates == 2  # 503, then 200
    httpd.shutdown()
    httpd.server_close()
    started = time.perf_counter()
    with pytest.raises(RemoteToolError, match=r"/instances: ConnectError: .* \(after 3 attempts\)$"):
        asyncio.run(echo.create("e2/echo"))
    assert time.perf_counter() - started >= 0.6  # waited 0.2 s, then 0.4 s
    source.close()


class ProxyErrorHandler(FlakyHandler):
    """A stand-in for a proxy that answers 502 after the tool behind it ran (a test cannot make
    `agentrl tools serve` do that on purpose); everything else is real HTTP on loopback."""

    executes = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.endswith("/execute"):
            ProxyErrorHandler.executes += 1
            self.reply(502, {"detail": "bad gateway"})
        else:
            self.reply(200, {"instance_id": "abc", "error": None})


@contextmanager
def stand_in(handler: type[BaseHTTPRequestHandler], **config) -> Iterator[RemoteTool]:
    """The one tool of a stand-in server on loopback, through RemoteTools (2 retries, 10 ms backoff)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    source = RemoteTools(f"http://127.0.0.1:{httpd.server_address[1]}", token="t", retries=2, backoff_s=0.01,
                         **config)
    try:
        yield source.tools()[0]
    finally:
        source.close()
        httpd.shutdown()
        httpd.server_close()


def test_a_tool_call_is_not_sent_again_after_a_5xx_it_may_have_run_behind():
    with stand_in(ProxyErrorHandler) as echo:
        asyncio.run(echo.create("e/echo"))
        with pytest.raises(RemoteToolError, match=r"^HTTP 502: bad gateway$"):
            asyncio.run(echo.execute("e/echo", {}))
        assert ProxyErrorHandler.executes == 1


class GatewayThenConflictHandler(FlakyHandler):
    """A stand-in for a proxy that answers 502 to a create it passed on, so that the client's retry
    finds the instance being created (409); a test cannot make `agentrl tools serve` do that on
    purpose. Records the creates' ids and the releases; everything else is real HTTP on loopback."""

    created: list[str] = []
    deleted: list[str] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        GatewayThenConflictHandler.created.append(body["instance_id"])
        if len(self.created) == 1:
            self.reply(502, {"detail": "bad gateway"})
        else:
            self.reply(409, {"detail": f"instance '{body['instance_id']}' exists or is being created"})

    def do_DELETE(self) -> None:
        GatewayThenConflictHandler.deleted.append(self.path)
        self.reply(200, {"error": None})


def test_a_create_refused_after_an_attempt_that_may_have_landed_is_released():
    with stand_in(GatewayThenConflictHandler) as echo:
        with pytest.raises(RemoteToolError, match=r"^HTTP 409: instance '[0-9a-f]{32}' exists or is being created$"):
            asyncio.run(echo.create("e/echo"))
        created = GatewayThenConflictHandler.created
        assert len(created) == 2 and created[0] == created[1]  # the retry names the same instance
        deadline = time.monotonic() + 5
        while not GatewayThenConflictHandler.deleted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert GatewayThenConflictHandler.deleted == [f"/instances/{created[0]}"]


class DroppingHandler(FlakyHandler):
    """A stand-in for a server whose connection drops before it answers (a proxy's idle timeout, a
    worker restart): the first create is lost on its way in, every execute after the tool ran (its
    effect recorded in `ran`). `how`: 'close' ends the connection, 'reset' resets it (RST). A test
    cannot make `agentrl tools serve` do that on purpose; everything else is real HTTP on loopback."""

    how = "close"
    creates = 0
    ran: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/instances":
            DroppingHandler.creates += 1
            if DroppingHandler.creates > 1:
                return self.reply(200, {"instance_id": body["instance_id"], "error": None})
        elif self.path.endswith("/execute"):
            DroppingHandler.ran.append(body["arguments"])  # the tool's side effect, then no answer
        else:
            return self.reply(200, {"reward": None, "error": None})
        if DroppingHandler.how == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def do_DELETE(self) -> None:
        self.reply(200, {"error": None})


@pytest.mark.parametrize("how,error", [
    ("close", "RemoteProtocolError: Server disconnected without sending a response."),
    ("reset", "ReadError"),
], ids=["closed", "reset"])
def test_a_tool_call_is_not_sent_again_after_its_connection_broke(how, error):
    DroppingHandler.how, DroppingHandler.creates, DroppingHandler.ran = how, 0, []

    async def one_call(echo: RemoteTool) -> list[dict]:
        env = ToolEnv([echo], ToolLimits(timeout_s=10), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        messages = await env.run_turn(ParsedTurn(calls=[ToolCall("echo", {"amount": 100})]))
        await env.finish()
        return messages

    with stand_in(DroppingHandler) as echo:
        messages = asyncio.run(one_call(echo))
    assert DroppingHandler.creates == 2  # a create names its instance: sent again after the drop
    assert DroppingHandler.ran == [{"amount": 100}]  # the tool call was not: it ran exactly once
    assert messages[0]["content"] == (
        f"Error: echo failed: RemoteToolError: the connection broke before the answer came ({error}); "
        "the tool may have run, so the call was not sent again")


class ListRefusalHandler(FlakyHandler):
    """A stand-in for a proxy refusing every execute with a 4xx whose JSON body is no object;
    everything else is real HTTP on loopback."""

    body = b""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if not self.path.endswith("/execute"):
            return self.reply(200, {"instance_id": "abc", "error": None})
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


@pytest.mark.parametrize("body", [b'["bad", "request"]', b'"bad request"', b"null", b'{"error": "bad request"}'],
                         ids=["list", "string", "null", "object_without_detail"])
def test_a_4xx_with_a_json_body_that_is_no_object_is_reported_as_the_answer(body):
    ListRefusalHandler.body = body
    with stand_in(ListRefusalHandler) as echo:
        asyncio.run(echo.create("e/echo"))
        with pytest.raises(RemoteToolError) as e:
            asyncio.run(echo.execute("e/echo", {}))
    assert str(e.value) == f"HTTP 400: {body.decode()}" and e.value.refused


class OddAnswerHandler(FlakyHandler):
    """A stand-in for a server, or a proxy in front of it, answering every execute with 200 and a
    body that is not agentrl's answer (a test cannot make `agentrl tools serve` do that); everything
    else is real HTTP on loopback."""

    body = b""
    executes = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if not self.path.endswith("/execute"):
            return self.reply(200, {"instance_id": "abc", "error": None})
        OddAnswerHandler.executes += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        try:
            self.wfile.write(self.body)
        except OSError:  # the client stopped reading an answer over its cap
            pass


@pytest.mark.parametrize("body,problem", [
    (b"[1, 2]", "POST /instances/abc/execute: HTTP 200 with an answer that is no JSON object: [1, 2]"),
    (b"<html>upstream ok</html>",
     "POST /instances/abc/execute: HTTP 200 with an answer that is no JSON object: <html>upstream ok</html>"),
    (b'{"reward": 1.0, "error": null}', """the server's answer has no str 'text': {"reward": 1.0, "error": null}"""),
    (b'{"text": "' + b"x" * (2 * 2**20) + b'"}',
     "POST /instances/abc/execute: the answer is longer than 1 MB (max_response_mb); it was not read further"),
    (b"[" * 100_000 + b"]" * 100_000, "POST /instances/abc/execute: HTTP 200 with an answer that is no JSON object: "
                                      + "[" * 200 + "..."),
], ids=["json_list", "html", "no_text", "over_the_cap", "nested_past_the_json_limit"])
def test_an_answer_that_is_not_the_servers_json_is_a_tool_error_and_not_sent_again(body, problem):
    OddAnswerHandler.body, OddAnswerHandler.executes = body, 0
    with stand_in(OddAnswerHandler, max_response_mb=1) as echo:
        asyncio.run(echo.create("e/echo"))
        with pytest.raises(RemoteToolError) as e:
            asyncio.run(echo.execute("e/echo", {}))
    assert str(e.value) == problem and OddAnswerHandler.executes == 1


@pytest.mark.parametrize("entry,problem", [
    ("{class: agentrl.tools.remote:RemoteTools, config: {url: 'URL', token: hunter2, retries: -1}}",
     "tool #1 (class 'agentrl.tools.remote:RemoteTools'): constructing agentrl.tools.remote:RemoteTools with config "
     "{'url': 'URL', 'token': '***', 'retries': -1} failed: 'retries' must be 0 or more (0: one attempt, no retry), "
     "not -1"),
    ("{class: agentrl.tools.remote:RemoteTools, config: {url: 'URL', token: hunter2},"
     " schema: {type: function, function: {name: q, description: d}}}",
     "tool 'q' (#1): key 'schema' is for a single tool; this entry takes its tools' schemas from its source"),
    ("{class: agentrl.tools.remote:RemoteTools, config: {url: 'URL', token: hunter2, max_response_mb: 0}}",
     "tool #1 (class 'agentrl.tools.remote:RemoteTools'): constructing agentrl.tools.remote:RemoteTools with config "
     "{'url': 'URL', 'token': '***', 'max_response_mb': 0.0} failed: 'max_response_mb' must be more than 0, not 0.0"),
    ("{class: agentrl.tools.remote:RemoteTools, config: {url: 'URL', token: hunter2, timeout_s: 0}}",
     "tool #1 (class 'agentrl.tools.remote:RemoteTools'): constructing agentrl.tools.remote:RemoteTools with config "
     "{'url': 'URL', 'token': '***', 'timeout_s': 0.0} failed: 'timeout_s' must be a finite number of seconds above "
     "0 and at most 86400, not 0.0"),
    ("{class: agentrl.tools.remote:RemoteTools, config: {url: 'URL', token: hunter2, connect_timeout_s: .inf}}",
     "tool #1 (class 'agentrl.tools.remote:RemoteTools'): constructing agentrl.tools.remote:RemoteTools with config "
     "{'url': 'URL', 'token': '***', 'connect_timeout_s': inf} failed: 'connect_timeout_s' must be a finite number "
     "of seconds above 0 and at most 86400, not inf"),
    # past threading.TIMEOUT_MAX, a thread's wait for the connection raised OverflowError
    ("{class: agentrl.tools.remote:RemoteTools, config: {url: 'URL', token: hunter2, timeout_s: 1.0e+10}}",
     "tool #1 (class 'agentrl.tools.remote:RemoteTools'): constructing agentrl.tools.remote:RemoteTools with config "
     "{'url': 'URL', 'token': '***', 'timeout_s': 10000000000.0} failed: 'timeout_s' must be a finite number of "
     "seconds above 0 and at most 86400, not 10000000000.0"),
    ("{class: agentrl.tools.remote:RemoteTools, config: {url: 'URL', token: hunter2, backoff_s: -1}}",
     "tool #1 (class 'agentrl.tools.remote:RemoteTools'): constructing agentrl.tools.remote:RemoteTools with config "
     "{'url': 'URL', 'token': '***', 'backoff_s': -1.0} failed: 'backoff_s' must be a finite number of seconds "
     "(0 or more) and at most 86400, not -1.0"),
], ids=["negative_retries", "schema_key", "no_room_for_an_answer", "no_time", "endless_connect", "past_a_day",
         "negative_backoff"])
def test_a_mistake_in_a_remote_entry_is_reported_even_when_the_server_is_down(tmp_path, entry, problem):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    path = tmp_path / "remote.yaml"
    path.write_text(f"tools:\n  - {entry.replace('URL', url)}\n")
    with pytest.raises(ConfigError) as e:
        load_tools(path)
    assert str(e.value) == f"{path}: {problem.replace('URL', url)}"


def test_serve_refuses_to_start_without_a_token(tmp_path):
    (tmp_path / "t.yaml").write_text(TOOLS_YAML)
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_TOOL_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "tools", "serve", str(tmp_path / "t.yaml")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "agentrl: error: tools serve needs a bearer token: pass --token or set AGENTRL_TOOL_TOKEN\n"


def test_arguments_a_broken_schema_cannot_check_get_422_not_a_crash():
    async def lookup(key: str) -> str:
        return "never runs"

    # Hosted from code, so the loader's $ref check never saw it.
    broken = FunctionTool(lookup, schema={"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"$ref": "#/$defs/missing"}}}}})
    with TestClient(create_app([broken], ServerSettings(token=TOKEN)),
                    headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        instance = client.post("/instances", json={"tool": "lookup"}).json()["instance_id"]
        reply = client.post(f"/instances/{instance}/execute", json={"arguments": {"key": "k"}})
    assert (reply.status_code, reply.json()) == (422, {"detail": (
        "the arguments for lookup cannot be checked, its parameters schema is broken (_WrappedReferencingError: "
        "PointerToNowhere: '/$defs/missing' does not exist within "
        "{'type': 'object', 'properties': {'key': {'$ref': '#/$defs/missing'}}}).")})


def test_a_busy_instance_outlives_its_ttl_and_a_call_waits_for_its_slot_within_its_timeout(tmp_path):
    """The TTL released an instance while a call was running on it (the call then failed with a
    KeyError); the wait for a call slot had no limit; a call whose client had given up while it
    waited still ran, its side effects happening for an answer nobody read; and one whose client
    left while it ran held its slot to the end."""
    tools = ("tools:\n  - class: tests.served_tools:nap\n  - class: tests.served_tools:tally\n"
             "  - class: tests.served_tools:ramble\n")
    proc, url = start_server(tmp_path, "--instance-ttl", "1", "--max-concurrency", "1", "--call-timeout", "4",
                             "--max-output-chars", "100", tools_yaml=tools)
    try:
        client = api(url)

        def create(tool: str) -> str:
            return client.post("/instances", json={"tool": tool}).json()["instance_id"]

        def execute(instance: str, **arguments) -> dict:
            return client.post(f"/instances/{instance}/execute", json={"arguments": arguments}).json()

        napper = create("nap")
        assert execute(napper, seconds=2.5)["text"] == "slept 2.5 s"  # past the 1 s TTL, while busy
        assert execute(napper, seconds=0)["text"] == "slept 0 s"  # still live

        async def contended() -> tuple[dict, dict]:
            first, waiting, tallier = create("nap"), create("nap"), create("tally")
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                holder = asyncio.create_task(c.post(f"/instances/{first}/execute", json={"arguments": {"seconds": 2}}))
                await asyncio.sleep(0.2)
                with pytest.raises(httpx.ReadTimeout):  # gives up while queued for the one slot
                    await c.post(f"/instances/{tallier}/execute", json={"arguments": {}}, timeout=0.5)
                queued = await c.post(f"/instances/{waiting}/execute", json={"arguments": {"seconds": 3}})
                return (await holder).json(), queued.json()

        held, queued = asyncio.run(contended())
        assert held["text"] == "slept 2 s"
        waited = re.fullmatch(r"TimeoutError: nap did not finish within 4 s \((\d\.\d) s of it waiting for a call "
                              r"slot\)", queued["error"])
        assert waited and float(waited.group(1)) >= 1.0, queued  # queued from ~0.7 s until the first nap ended at 2 s
        assert execute(create("tally"))["text"] == "1"  # the abandoned call never ran
        assert execute(create("ramble"), characters=10_000)["text"] == (
            "x" * 100 + "\n[output cut to 100 characters by the tool server]")
        with pytest.raises(httpx.ReadTimeout):  # the client leaves during a 3.5 s call holding the one slot
            client.post(f"/instances/{create('nap')}/execute", json={"arguments": {"seconds": 3.5}}, timeout=0.5)
        started = time.monotonic()
        assert execute(create("nap"), seconds=0)["text"] == "slept 0 s"
        assert time.monotonic() - started < 2.5  # the abandoned call was cancelled, not run to its end
    finally:
        stop_process(proc)


def test_a_token_no_header_can_carry_is_refused_without_showing_it(tmp_path, monkeypatch):
    """httpx refused the header naming its value, so a secret made from a file (ending in a
    newline) was printed in the load error; the server accepted it, then answered 401 to all."""
    monkeypatch.setenv("AGENTRL_TEST_TOKEN", "s3cret-value\n")
    with pytest.raises(ConfigError) as e:
        load_tools(remote_file(tmp_path, "http://127.0.0.1:9"))
    assert "s3cret" not in str(e.value) and str(e.value).endswith(
        "the variable 'AGENTRL_TEST_TOKEN': the token has a newline at position 13 of 13, which a bearer token "
        "cannot hold (only printable ASCII; a secret made from a file often ends in a newline)")
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "tools", "serve", str(tmp_path / "none.yaml"),
                           "--token", "two words", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == (
        "agentrl: error: --token: the token has a space at position 4 of 9, which a bearer token cannot hold (only "
        "printable ASCII; a secret made from a file often ends in a newline)")
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "tools", "serve", str(tmp_path / "none.yaml"),
                           "--token", "t", "--call-timeout", "nan"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == (
        "agentrl: error: --call-timeout must be a positive number, got nan")


class Track:
    """Records what the server asks of it; `execute` sleeps as long as it is told."""

    schema = {"type": "function", "function": {"name": "track", "description": "Sleeps.", "parameters": {
        "type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}}}

    def __init__(self):
        self.created: list[str] = []
        self.released: list[str] = []

    async def create(self, instance_id: str, **kwargs) -> str:
        self.created.append(instance_id)
        return instance_id

    async def execute(self, instance_id: str, arguments: dict) -> str:
        await asyncio.sleep(arguments["seconds"])
        return "ok"

    async def reward(self, instance_id: str) -> None:
        return None

    async def release(self, instance_id: str) -> None:
        self.released.append(instance_id)


def test_releases_are_never_dropped_and_creates_that_never_started_are_not_released():
    """With every call slot busy past the call timeout, a release used to fail "did not start" after
    its instance had left the server's table, leaking what the tool held; a create that never got a
    slot was "released" all the same, for an id the tool never made; and a release that came while
    a call still ran on its instance made that call fail with a KeyError."""
    track = Track()
    app = create_app([track], ServerSettings(token=TOKEN, max_concurrency=1, call_timeout_s=1.0))

    async def scenario() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tools",
                                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
            async def create(name: str) -> dict:
                return (await c.post("/instances", json={"tool": "track", "instance_id": name})).json()

            def execute(name: str, seconds: float):
                return c.post(f"/instances/{name}/execute", json={"arguments": {"seconds": seconds}})

            await create("instance-a"), await create("instance-b")
            await app.state.host.gate.acquire()  # the one call slot held, as a stuck tool holds it
            starved = await create("instance-c")  # times out waiting for the slot
            release = asyncio.create_task(c.delete("/instances/instance-b"))  # waits for the slot, however long
            await asyncio.sleep(1.5)  # past the call timeout
            app.state.host.gate.release()
            release_b = await release
            running = asyncio.create_task(execute("instance-a", 0.3))
            await asyncio.sleep(0.05)
            release_a = await c.delete("/instances/instance-a")  # while its call runs
            return {"starved": starved, "release_b": release_b.json(), "running": (await running).json(),
                    "release_a": release_a.json()}

    outcome = asyncio.run(scenario())
    assert outcome["starved"] == {"instance_id": None, "error": "TimeoutError: track did not start within 1 s: all 1 "
                                                               "of the server's call slots stayed busy"}
    assert outcome["release_b"] == {"error": None}
    assert outcome["running"]["text"] == "ok" and outcome["release_a"] == {"error": None}
    assert track.created == ["instance-a", "instance-b"]  # instance-c never reached the tool
    assert track.released == ["instance-b", "instance-a"]  # a's once its call had ended


def test_a_server_trickling_its_answer_cannot_hold_the_load():
    """httpx's timeout is per read: a server that sent its answer a byte at a time held the load
    (and any call) forever, whatever timeout_s said. A test cannot make `agentrl tools serve` do
    that; the trickle is real HTTP on loopback."""
    listening = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        connection, _ = listening.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                               b"Transfer-Encoding: chunked\r\n\r\n")
            while not stop.wait(0.2):  # a byte well within every read timeout
                try:
                    connection.sendall(b"1\r\n \r\n")
                except OSError:  # the client gave up
                    return

    threading.Thread(target=trickle, daemon=True).start()
    url = f"http://127.0.0.1:{listening.getsockname()[1]}"
    outcome: list[str] = []

    def load() -> None:
        try:
            RemoteTools(url, token="t", timeout_s=0.5, connect_timeout_s=0.5, retries=0).tools()
        except RemoteToolError as e:
            outcome.append(str(e))

    loading = threading.Thread(target=load, daemon=True)
    started = time.monotonic()
    try:
        loading.start()
        loading.join(15)
    finally:
        stop.set()
        listening.close()
    assert not loading.is_alive() and time.monotonic() - started < 5
    assert outcome == [f"{url}/tools: GET /tools: no complete answer within 1 s (connect_timeout_s + timeout_s)"]


class SlowTrack(Track):
    """A Track whose create takes a while, and fails when told to."""

    async def create(self, instance_id: str, **kwargs) -> str:
        await asyncio.sleep(0.5)
        if kwargs.get("fail"):
            raise RuntimeError("no room")
        return await super().create(instance_id)


def test_a_create_sent_again_while_the_first_runs_gets_its_answer():
    """A client sends a create again after a proxy's 5xx or a dropped connection; while the first
    still ran, the second was refused with 409, so the client released the instance the first was
    making and the episode lost the tool."""
    track = SlowTrack()
    app = create_app([track], ServerSettings(token=TOKEN))

    async def scenario() -> list[list[httpx.Response]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tools",
                                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
            async def twice(name: str, **kwargs) -> list[httpx.Response]:
                body = {"tool": "track", "instance_id": name, "kwargs": kwargs}
                first = asyncio.create_task(c.post("/instances", json=body))
                await asyncio.sleep(0.1)
                return [await c.post("/instances", json=body), await first]

            return [await twice("instance-a"), await twice("instance-b", fail=True)]

    made, failed = asyncio.run(scenario())
    assert [(r.status_code, r.json()) for r in made] == [(200, {"instance_id": "instance-a", "error": None})] * 2
    assert [(r.status_code, r.json()) for r in failed] == [
        (200, {"instance_id": None, "error": "RuntimeError: no room"})] * 2
    assert track.created == ["instance-a"]  # made once
    assert track.released == ["instance-b"]  # what the failed create made, freed once
    assert app.state.host.stats["track"]["create"].calls == 2


def test_values_the_server_drops_are_counted_as_a_local_tools_are(tmp_path):
    """The server turned a NaN reward into null and left out metrics that are no numbers, saying
    nothing: the client's ToolEnv never counted them in tool_invalid_results, as it counts a local
    tool's."""
    from tests.served_tools import Scored

    async def episode(tool) -> dict:
        env = ToolEnv([tool], ToolLimits(timeout_s=10), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        [message] = await env.run_turn(ParsedTurn(calls=[ToolCall("scored", {})]))
        final = await env.finish()
        return {"content": message["content"], "final": final, "invalid": env.metrics["tool_invalid_results"],
                "score": env.metrics.get("score"), "step_rewards": env.step_rewards}

    local = asyncio.run(episode(Scored()))
    assert local == {"content": "scored", "final": 0.0, "invalid": 4, "score": 0.5, "step_rewards": []}
    proc, url = start_server(tmp_path, tools_yaml="tools:\n  - class: tests.served_tools:Scored\n")
    source = RemoteTools(url, token=TOKEN)
    try:
        with api(url) as client:
            client.post("/instances", json={"tool": "scored", "instance_id": "instance-1"})
            assert client.post("/instances/instance-1/execute", json={"arguments": {}}).json() == {
                "text": "scored", "reward": None, "metrics": {"score": 0.5}, "error": None, "invalid": 3}
            assert client.post("/instances/instance-1/reward").json() == {"reward": None, "error": None, "invalid": 1}
        (remote,) = source.tools()
        assert asyncio.run(episode(remote)) == local
    finally:
        source.close()
        stop_process(proc)


def test_a_url_with_a_password_or_a_query_shows_neither_in_errors():
    """Messages named self.url as given: at load, and in the tool message the model reads (and the
    trajectory keeps) once a call's retries ran out."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    source = RemoteTools(f"http://admin:hunter2@127.0.0.1:{port}/api?key=s3cr3t", token="t", retries=1,
                         backoff_s=0.01)
    (echo,) = source.tools()
    httpd.shutdown()
    httpd.server_close()
    with pytest.raises(RemoteToolError) as at_run:
        asyncio.run(echo.create("e/echo"))
    source.close()
    with pytest.raises(RemoteToolError) as at_load:
        RemoteTools(f"http://admin:hunter2@127.0.0.1:{free_port()}?key=s3cr3t", token="t", retries=0).tools()
    assert re.fullmatch(rf"http://127\.0\.0\.1:{port}/api/instances: ConnectError: .* \(after 2 attempts\)",
                        str(at_run.value))
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/tools: ConnectError: .* \(after 1 attempts\)", str(at_load.value))


class SlowExecuteHandler(FlakyHandler):
    """A stand-in server whose every execute takes 2 s, to meet more calls at once than httpx's
    default pool of 100 connections holds; everything else is real HTTP on loopback."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/execute"):
            time.sleep(2.0)
            return self.reply(200, {"text": "ok", "reward": None, "metrics": {}, "error": None})
        self.reply(200, {"instance_id": body["instance_id"], "error": None})


class ManyAtOnce(ThreadingHTTPServer):
    request_queue_size = 256  # socketserver's 5 would refuse connections before any wait of the client
    daemon_threads = True


def test_more_calls_at_once_than_a_connection_pool_holds_all_get_their_answers():
    """With httpx's 100 connections, the other calls waited for one within their attempt's limit
    and failed as timeouts after the tool had run (each answers in 2 s; the limit is 3.8 s)."""
    httpd = ManyAtOnce(("127.0.0.1", 0), SlowExecuteHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    source = RemoteTools(f"http://127.0.0.1:{httpd.server_address[1]}", token="t", timeout_s=3.3,
                         connect_timeout_s=0.5, retries=0)
    (echo,) = source.tools()

    async def calls(n: int) -> list[str]:
        for i in range(n):
            await echo.create(f"e{i}/echo")
        results = await asyncio.gather(*(echo.execute(f"e{i}/echo", {}) for i in range(n)), return_exceptions=True)
        return [r.text if not isinstance(r, BaseException) else str(r) for r in results]

    try:
        assert asyncio.run(calls(120)) == ["ok"] * 120
    finally:
        source.close()
        httpd.shutdown()
        httpd.server_close()


class ReleaseLostOnTheWayBackHandler(FlakyHandler):
    """A stand-in for a proxy that answers 502 to a release the server behind it did: the client's
    retry then meets the server's 404 for an instance it no longer has (a test cannot make
    `agentrl tools serve` do that on purpose); everything else is real HTTP on loopback."""

    deletes = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path.endswith("/reward"):
            return self.reply(200, {"reward": None, "error": None})
        self.reply(200, {"instance_id": body["instance_id"], "error": None})

    def do_DELETE(self) -> None:
        ReleaseLostOnTheWayBackHandler.deletes += 1
        if self.deletes == 1:
            return self.reply(502, {"detail": "bad gateway"})
        self.reply(404, {"detail": f"unknown instance '{self.path.rsplit('/', 1)[-1]}' (never created, released "
                                   "or expired)"})


def test_a_release_whose_retry_finds_the_instance_gone_has_succeeded():
    async def episode(echo: RemoteTool) -> tuple[float, float]:
        env = ToolEnv([echo], ToolLimits(timeout_s=10), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        await env.finish()
        return env.metrics["tool_lifecycle_errors"], ReleaseLostOnTheWayBackHandler.deletes

    with stand_in(ReleaseLostOnTheWayBackHandler) as echo:
        assert asyncio.run(episode(echo)) == (0.0, 2)
        instance = asyncio.run(echo.create("e2/echo"))  # a 404 to a first release is still an error
        ReleaseLostOnTheWayBackHandler.deletes = 1
        with pytest.raises(RemoteToolError, match=r"^HTTP 404: unknown instance '[0-9a-f]{32}'"):
            asyncio.run(echo.release(instance))


class RedirectHandler(FlakyHandler):
    """A stand-in for a proxy redirecting every execute elsewhere, with a JSON object as its body;
    everything else is real HTTP on loopback."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/execute"):
            return self.reply(307, {"detail": "moved to http://127.0.0.1:1/"})
        self.reply(200, {"instance_id": body["instance_id"], "error": None})


def test_a_redirect_is_an_error_not_an_answer():
    """A 3xx whose body was a JSON object counted as the answer: a release so answered never happened."""
    with stand_in(RedirectHandler) as echo:
        asyncio.run(echo.create("e/echo"))
        with pytest.raises(RemoteToolError) as e:
            asyncio.run(echo.execute("e/echo", {}))
    assert str(e.value) == "HTTP 307: moved to http://127.0.0.1:1/" and e.value.refused


class NamelessToolsHandler(FlakyHandler):
    """A stand-in server listing its tools by name alone, not as schemas; real HTTP on loopback."""

    def do_GET(self) -> None:
        self.reply(200, {"tools": [FlakyHandler.schema, "echo"]})


def test_a_tool_list_without_schemas_names_the_server_and_the_entry():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NamelessToolsHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(RemoteToolError) as e:
            RemoteTools(url, token="t").tools()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert str(e.value) == f'{url}/tools: the server\'s tool #2 is no schema with a function name: "echo"'


def test_instances_still_live_when_the_server_stops_are_released():
    """Shutdown only stopped the expiry sweep: what live instances held (a sandbox, a temp dir)
    was never freed."""
    track = Track()
    with TestClient(create_app([track], ServerSettings(token=TOKEN)),
                    headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        for name in ("kept-aaa", "kept-bbb", "gone-ccc"):
            assert client.post("/instances", json={"tool": "track", "instance_id": name}).json()["error"] is None
        assert client.delete("/instances/gone-ccc").json() == {"error": None}
        assert track.released == ["gone-ccc"]
    assert sorted(track.released) == ["gone-ccc", "kept-aaa", "kept-bbb"]  # each once


class ShapelessCreateHandler(FlakyHandler):
    """A stand-in for a server (or a proxy) answering a create with 200 and no instance id; it
    records the creates' ids and the releases. Everything else is real HTTP on loopback."""

    created: list[str] = []
    deleted: list[str] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ShapelessCreateHandler.created.append(body["instance_id"])
        self.reply(200, {"made": True})

    def do_DELETE(self) -> None:
        ShapelessCreateHandler.deleted.append(self.path)
        self.reply(200, {"error": None})


def test_a_create_answered_without_an_instance_id_is_released_all_the_same():
    ShapelessCreateHandler.created, ShapelessCreateHandler.deleted = [], []
    with stand_in(ShapelessCreateHandler) as echo:
        with pytest.raises(RemoteToolError, match=r"""^the server's answer has no str 'instance_id': {"made": true}$"""):
            asyncio.run(echo.create("e/echo"))
        deadline = time.monotonic() + 5
        while not ShapelessCreateHandler.deleted and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ShapelessCreateHandler.deleted == [f"/instances/{ShapelessCreateHandler.created[0]}"]


class EncodingHandler(FlakyHandler):
    """A stand-in server that compresses its answers when the client accepts it (as servers and
    proxies in front of them do), recording what each request accepted; real HTTP on loopback."""

    accepted: list[str] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        EncodingHandler.accepted.append(self.headers.get("Accept-Encoding", ""))
        if not self.path.endswith("/execute"):
            return self.reply(200, {"instance_id": body["instance_id"], "error": None})
        text = json.dumps({"text": "x" * (4 * 2**20), "error": None}).encode()
        data = gzip.compress(text) if "gzip" in self.headers.get("Accept-Encoding", "") else text
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        if data is not text:
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:  # the client stopped reading at its cap
            pass


def test_answers_are_asked_for_uncompressed_so_the_size_cap_holds_as_read():
    """httpx asked for gzip: a 4 MB answer came in 4 KB, each network chunk decoded whole before
    the 1 MB cap was checked."""
    EncodingHandler.accepted = []
    with stand_in(EncodingHandler, max_response_mb=1) as echo:
        asyncio.run(echo.create("e/echo"))
        with pytest.raises(RemoteToolError, match=r"the answer is longer than 1 MB \(max_response_mb\)"):
            asyncio.run(echo.execute("e/echo", {}))
    assert EncodingHandler.accepted == ["identity", "identity"]


def test_what_a_background_loop_started_is_finished_or_cancelled_before_it_closes():
    """close() stopped the loop under a release sent in the background: it was destroyed
    mid-request ("Task was destroyed but it is pending"), and the server kept the instance until
    its expiry."""
    from agentrl.tools.background_loop import BackgroundLoop

    ended: list[str] = []

    async def release(name: str, seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
            ended.append(f"{name} done")
        except asyncio.CancelledError:
            ended.append(f"{name} cancelled")
            raise

    loop = BackgroundLoop("test-loop")
    loop.submit(release("quick", 0.3))
    loop.submit(release("stuck", 60))
    started = time.monotonic()
    loop.close(timeout_s=2.0)
    assert sorted(ended) == ["quick done", "stuck cancelled"] and time.monotonic() - started < 5
