"""Tools from a real MCP server (tests/mcp_server.py, run as a stdio subprocess by the `mcp` SDK)."""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agentrl.env.tool_env import ToolEnv, ToolLimits
from agentrl.errors import ConfigError
from agentrl.rollout.collect import collect
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.tools.loader import load_tools
from agentrl.tools.mcp import MCPTool, MCPTools, MCPToolError
from agentrl.tools.parsers import ParsedTurn, parse_hermes
from agentrl.types import Completion, SamplingParams, Task, ToolCall
from tests.conftest import ScriptedEngine, free_port, stop_process


def mcp_file(tmp_path: Path, allow: list[str], marker: str) -> Path:
    path = tmp_path / "mcp.yaml"
    # The marker argument (ignored by the server) lets the test find the server process.
    command = [sys.executable, "tests/mcp_server.py", marker]
    path.write_text(json.dumps({"tools": [{"class": "agentrl.tools.mcp:MCPTools",
                                           "config": {"command": command, "allow": allow}}]}))
    return path


def server_running(marker: str) -> bool:
    """Whether a process with `marker` in its command line exists (read from /proc: no procps needed)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                return True
        except OSError:  # the process ended while we looked
            pass
    return False


def server_stopped(marker: str, timeout_s: float = 10.0) -> bool:
    """Whether the server with `marker` is gone within `timeout_s`: it exits a moment after its
    session closes."""
    deadline = time.monotonic() + timeout_s
    while server_running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not server_running(marker)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_episodes_call_an_mcp_tool_across_event_loops(tmp_path, tokenizer):
    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    tools = load_tools(mcp_file(tmp_path, ["multiply", "calls_so_far"], marker))
    multiply, calls_so_far = tools
    assert isinstance(multiply, MCPTool) and multiply.schema == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.\n\nArgs:\n    a: The first factor.\n    b: The second factor.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}

    # Step 1 (its own asyncio.run, as in training): four concurrent episodes call multiply, and one
    # tries the tool the allow-list hides.
    turns = [call("multiply", a=123, b=456 + i) for i in range(3)] + [call("delete_everything", confirm=True)]
    runner = EpisodeRunner(ByPrompt(tokenizer, turns), tokenizer, tools, parse_hermes, EpisodeSettings())
    tasks = [Task(id=str(i), prompt=f"episode-{i}") for i in range(4)]
    trajectories = asyncio.run(collect(runner, tasks, group_size=1, max_concurrent=4))
    replies = [next(m["content"] for m in t.messages if m["role"] == "tool") for t in trajectories]
    assert replies == ["56088", "56211", "56334",
                       "Error: unknown tool 'delete_everything'; available: calls_so_far, multiply."]
    prompt = tokenizer.decode(trajectories[0].token_ids)
    assert '"name": "multiply"' in prompt and "delete_everything" not in prompt

    # Step 2, a new event loop: the same session and server process answer, having seen 3 calls.
    engine2 = ScriptedEngine(tokenizer, [call("calls_so_far"), "Three."])
    runner2 = EpisodeRunner(engine2, tokenizer, tools, parse_hermes, EpisodeSettings())
    traj = asyncio.run(runner2.run(Task(id="t", prompt="How many?"), group_id="g"))
    assert traj.messages[2] == {"role": "tool", "name": "calls_so_far", "content": "3"}
    assert traj.finish == "stop" and traj.metrics["tool_errors"] == 0

    # A result the server flags as an error reaches the model as a tool error.
    engine3 = ScriptedEngine(tokenizer, [call("multiply", a=10**9, b=10**9), "Sorry."])
    traj = asyncio.run(EpisodeRunner(engine3, tokenizer, tools, parse_hermes, EpisodeSettings())
                       .run(Task(id="t", prompt="?"), group_id="g"))
    assert traj.messages[2]["content"] == ("Error: multiply failed: MCPToolError: "
                                           "Error executing tool multiply: 1000000000 * 1000000000 is too large")
    assert traj.metrics["tool_errors"] == 1

    assert server_running(marker)
    multiply.source.close()
    assert server_stopped(marker)  # closing the session stopped the server


def test_allow_list_name_the_server_lacks_is_a_config_error(tmp_path):
    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    path = mcp_file(tmp_path, ["multiply", "rm_rf"], marker)
    with pytest.raises(ConfigError) as e:
        load_tools(path)
    command = shlex.join([sys.executable, "tests/mcp_server.py", marker])
    assert str(e.value) == (
        f"{path}: tool #1 (class 'agentrl.tools.mcp:MCPTools'): constructing agentrl.tools.mcp:MCPTools with config "
        f"{{'command': {[sys.executable, 'tests/mcp_server.py', marker]}, 'allow': ['multiply', 'rm_rf']}} failed: "
        f"allow-list names 'rm_rf', which the MCP server {command} does not offer "
        "(it offers: authorization, calls_so_far, delete_everything, multiply, ramble)")
    time.sleep(0.5)
    assert not server_running(marker)  # the connection opened to check was closed again


@pytest.mark.parametrize("key,value", [("connect_timeout_s", 1e10), ("connect_timeout_s", math.inf),
                                       ("timeout_s", 0.0), ("timeout_s", math.nan)])
def test_a_timeout_that_is_no_usable_number_of_seconds_is_named_and_no_server_starts(key, value):
    """They were taken as given: past threading.TIMEOUT_MAX the wait for the connection raised
    OverflowError, blamed on the server, and the server it had started stayed up; 0 or NaN failed
    every call as the server's fault."""
    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    with pytest.raises(ValueError) as e:
        MCPTools(["multiply"], command=[sys.executable, "tests/mcp_server.py", marker], **{key: value})
    assert str(e.value) == f"'{key}' must be a finite number of seconds above 0 and at most 86400, not {value}"
    assert not server_running(marker)


def http_server(port: int) -> subprocess.Popen:
    """tests/mcp_server.py over Streamable HTTP on 127.0.0.1:port, once it accepts connections."""
    server = subprocess.Popen([sys.executable, "tests/mcp_server.py", "--http", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"the MCP test server did not listen on port {port}")


def six_times_seven(multiply: MCPTool) -> str:
    """The tool's answer under an event loop of its own, or the MCPToolError it raised, as text."""
    try:
        return asyncio.run(multiply.execute("e/multiply", {"a": 6, "b": 7})).text
    except MCPToolError as e:
        return f"MCPToolError: {e}"


def test_tools_from_an_mcp_server_over_http_with_headers_from_the_environment(monkeypatch):
    port = free_port()
    server = http_server(port)
    monkeypatch.setenv("AGENTRL_TEST_MCP_TOKEN", "s3cret")
    try:
        source = MCPTools(allow=["multiply", "authorization"], url=f"http://127.0.0.1:{port}/mcp",
                          headers={"Authorization": "Bearer ${AGENTRL_TEST_MCP_TOKEN}"})
        multiply, authorization = source.tools()
        for _ in range(2):  # two event loops, one session
            assert asyncio.run(multiply.execute("e/multiply", {"a": 12, "b": 34})).text == "408"
        assert asyncio.run(authorization.execute("e/auth", {})).text == "Bearer s3cret"
        source.close()
        plain = MCPTools(allow=["authorization"], url=f"http://127.0.0.1:{port}/mcp")
        assert asyncio.run(plain.tools()[0].execute("e/auth", {})).text == "none"  # no headers: none sent
        plain.close()
    finally:
        stop_process(server)


def test_an_unset_variable_or_a_secret_in_the_config_stops_loading_without_showing_the_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTRL_TEST_UNSET", raising=False)
    path = tmp_path / "mcp.yaml"
    config = {"url": "http://user:pw@127.0.0.1:9/mcp?key=abc", "allow": ["x"],
              "headers": {"Authorization": "Bearer literal-secret", "X-Key": "${AGENTRL_TEST_UNSET}"}}
    path.write_text(json.dumps({"tools": [{"class": "agentrl.tools.mcp:MCPTools", "config": config}]}))
    with pytest.raises(ConfigError) as e:
        load_tools(path)
    assert str(e.value) == (
        f"{path}: tool #1 (class 'agentrl.tools.mcp:MCPTools'): constructing agentrl.tools.mcp:MCPTools with config "
        "{'url': 'http://127.0.0.1:9/mcp', 'allow': ['x'], 'headers': {'Authorization': '***', "
        "'X-Key': '***'}} failed: headers.X-Key names the environment variable AGENTRL_TEST_UNSET, which is not set")
    monkeypatch.setenv("AGENTRL_TEST_UNSET", "set")
    with pytest.raises(ConfigError) as e:  # port 9 on loopback: nothing listens, the connection is refused
        load_tools(path)
    assert "literal-secret" not in str(e.value) and "pw" not in str(e.value) and "abc" not in str(e.value)
    assert "failed: cannot reach the MCP server http://127.0.0.1:9/mcp: " in str(e.value)  # no password, no query
    with pytest.raises(ValueError, match="'headers' go with an HTTP server"):
        MCPTools(allow=["echo"], command=EXITING_SERVER, headers={"A": "b"})
    with pytest.raises(ValueError, match="'env' sets a stdio server's environment"):
        MCPTools(allow=["echo"], url="http://127.0.0.1:9/mcp", env={"A": "b"})


def test_a_restarted_http_server_is_reconnected_and_a_down_one_is_retried_with_backoff(capfd):
    port = free_port()
    server = http_server(port)
    source = MCPTools(allow=["multiply"], url=f"http://127.0.0.1:{port}/mcp", timeout_s=10)
    (multiply,) = source.tools()
    label = f"http://127.0.0.1:{port}/mcp"

    try:
        assert six_times_seven(multiply) == "42"
        stop_process(server)
        gone = six_times_seven(multiply)  # the call in flight, or the first attempt to reconnect, fails and names the server
        assert gone.startswith(f"MCPToolError: the MCP server {label} ")
        if "reconnecting failed" not in gone:  # the session's end was seen first: this call reconnects at once
            gone = six_times_seven(multiply)
        assert "reconnecting failed (ConnectError" in gone and gone.endswith("the next attempt is in 1 s")
        assert six_times_seven(multiply).endswith("; the next attempt to reconnect is in 1 s")  # no attempt inside the backoff
        server = http_server(port)
        time.sleep(1.1)
        assert six_times_seven(multiply) == "42"
        assert f"agentrl: warning: reconnected to the MCP server {label}" in capfd.readouterr().err
    finally:
        source.close()
        stop_process(server)


EXITING_SERVER = [sys.executable, "tests/fixtures/mcp_exiting_server.py"]


def test_a_property_called_title_stays_in_every_map_keyed_by_property_name():
    source = MCPTools(allow=["lookup"], command=EXITING_SERVER)
    try:
        (lookup,) = source.tools()
        assert lookup.schema["function"]["parameters"] == {
            "type": "object", "properties": {"book": {"$ref": "#/$defs/Book"}}, "required": ["book"],
            "$defs": {"Book": {
                "type": "object", "description": "A book to look up (a title needs its author and a note).",
                "properties": {"title": {"default": "", "type": "string"}, "author": {"default": "", "type": "string"},
                               "note": {"default": "", "type": "string"}},
                "dependentRequired": {"title": ["author"]},  # the key names a property: kept
                "dependentSchemas": {"title": {"required": ["note"]}},  # the annotation inside: dropped
                "dependencies": {"title": {"required": ["author"]}}}}}  # the older keyword for both
    finally:
        source.close()


def test_a_server_that_restarted_between_calls_and_forgot_the_session_is_reconnected(monkeypatch, capfd):
    """A server on the initialize handshake (before MCP 2026) answers a restarted process's unknown
    session id with 404 "Session not found": every later call failed with it."""
    import functools

    import mcp

    monkeypatch.setattr(mcp, "Client", functools.partial(mcp.Client, mode="legacy"))
    port = free_port()
    server = http_server(port)
    source = MCPTools(allow=["multiply"], url=f"http://127.0.0.1:{port}/mcp", timeout_s=10)
    (multiply,) = source.tools()

    try:
        assert six_times_seven(multiply) == "42"
        stop_process(server)
        server = http_server(port)
        assert six_times_seven(multiply) == (f"MCPToolError: the MCP server http://127.0.0.1:{port}/mcp closed the connection: it exited "
                         "or dropped the session; the next call reconnects")
        assert six_times_seven(multiply) == "42"
        assert "agentrl: warning: reconnected to the MCP server" in capfd.readouterr().err
    finally:
        source.close()
        stop_process(server)


def test_a_reconnection_its_callers_gave_up_on_still_sets_the_backoff():
    """Calls cancelled by their own timeout (ToolEnv's) used to cancel the attempt with them, so no
    backoff was recorded and each later call started a new attempt and spent its whole timeout on
    it. Here the port accepts connections and never answers."""
    port = free_port()
    server = http_server(port)
    source = MCPTools(allow=["multiply"], url=f"http://127.0.0.1:{port}/mcp", timeout_s=10, connect_timeout_s=1)
    (multiply,) = source.tools()

    async def call(within_s: float) -> str:
        try:
            return (await asyncio.wait_for(multiply.execute("e/multiply", {"a": 6, "b": 7}), within_s)).text
        except asyncio.TimeoutError:
            return "timed out"
        except MCPToolError as e:
            return str(e)

    try:
        assert asyncio.run(call(10)) == "42"
        stop_process(server)
        outcomes = [asyncio.run(call(10))]  # the session ends; an attempt is refused at once: backoff 1 s
        if "reconnecting failed" not in outcomes[-1]:
            outcomes.append(asyncio.run(call(10)))
        time.sleep(1.1)
        with socket.create_server(("127.0.0.1", port)):  # listening, never answering: the next attempt hangs
            outcomes += [asyncio.run(call(0.3)), asyncio.run(call(0.3))]  # given up on: the attempt runs on
            time.sleep(1.0)  # past connect_timeout_s: the attempt failed, recording a backoff of 2 s
            started = time.monotonic()
            last = asyncio.run(call(5))
            waited_s = time.monotonic() - started
        assert outcomes[-2:] == ["timed out", "timed out"], outcomes
        assert "reconnecting failed (ConnectError" in outcomes[-3]
        assert "the next attempt to reconnect is in" in last and waited_s < 0.5, (outcomes, last)
    finally:
        source.close()


def exiting_server_turn(source: MCPTools, name: str, **arguments) -> str:
    """One tool call through ToolEnv, as an episode makes it, under an event loop of its own."""
    async def turn() -> str:
        env = ToolEnv(source.tools(), ToolLimits(timeout_s=10), lambda text: (text, False))
        await env.start("e", Task(id="t", prompt="Go."))
        messages = await env.run_turn(ParsedTurn(calls=[ToolCall(name, arguments)]))
        await env.finish()
        return messages[0]["content"]

    return asyncio.run(turn())


def test_a_stdio_server_that_exits_is_restarted_with_its_environment_by_the_next_call(monkeypatch, capfd):
    monkeypatch.setenv("AGENTRL_TEST_MCP_VALUE", "from-the-run")
    source = MCPTools(allow=["environment", "exit_server"], command=EXITING_SERVER,
                      env={"PROBE": "${AGENTRL_TEST_MCP_VALUE}/x"})
    try:
        value, first_pid = exiting_server_turn(source, "environment", variable="PROBE").split()
        assert value == "from-the-run/x"
        assert exiting_server_turn(source, "environment", variable="AGENTRL_TEST_MCP_VALUE").split()[0] == "unset"
        assert exiting_server_turn(source, "exit_server") == (
            f"Error: exit_server failed: MCPToolError: the MCP server {shlex.join(EXITING_SERVER)} closed the "
            "connection: it exited or dropped the session; the next call reconnects")
        value, second_pid = exiting_server_turn(source, "environment", variable="PROBE").split()
        assert value == "from-the-run/x" and second_pid != first_pid  # a new process, with the same environment
        assert (f"agentrl: warning: reconnected to the MCP server {shlex.join(EXITING_SERVER)} (it closed the "
                "connection); a restarted server has lost any state it kept") in capfd.readouterr().err
    finally:
        source.close()


def test_with_reconnect_off_every_call_after_the_server_exited_names_the_server():
    source = MCPTools(allow=["echo", "exit_server"], command=EXITING_SERVER, reconnect=False)
    try:
        assert exiting_server_turn(source, "echo", text="hi") == "hi"
        closed = (f"failed: MCPToolError: the MCP server {shlex.join(EXITING_SERVER)} closed the connection: "
                  "it exited or dropped the session, and it is not restarted")
        assert exiting_server_turn(source, "exit_server") == f"Error: exit_server {closed}"
        for _ in range(2):  # each later call, from a fresh event loop as in training
            assert exiting_server_turn(source, "echo", text="hi") == (
                f"Error: echo failed: MCPToolError: the MCP server {shlex.join(EXITING_SERVER)} is not connected "
                "(it closed the connection)")
    finally:
        source.close()


class ByPrompt:
    """Answers episode N ('episode-N' in its prompt) with turn N, and with 'Done.' once a tool replied.

    Concurrent episodes reach the engine in any order; keying the reply by prompt keeps each exact.
    """

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, turns
        self.weight_version = 0

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        text = self.tokenizer.decode(token_ids)
        reply = "Done." if "<|im_start|>tool" in text else self.turns[int(text.split("episode-")[1][0])]
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [2]
        return Completion(ids, [-0.01] * len(ids), "stop", 0)


def test_a_driver_that_only_checks_the_tool_files_leaves_no_server_running(tmp_path):
    from agentrl.recipe import load_recipe
    from agentrl.rollout.run import load_driver_parts
    from agentrl.tools.loader import close_tools

    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    path = mcp_file(tmp_path, ["multiply", "calls_so_far"], marker)
    tools = load_tools(path)
    assert server_running(marker)
    close_tools(tools)  # both tools share one server: closed once
    assert server_stopped(marker)

    config = load_recipe("recipes/quickstart.yaml",
                         [f"rollout.tool_configs=[{path}]", "model.path=smollm2-135m-instruct"])
    tasks, tokenizer = load_driver_parts(config)
    assert tasks and tokenizer is not None and server_stopped(marker)


def test_a_recipe_whose_reward_function_fails_to_load_leaves_no_server_running(tmp_path):
    from agentrl.recipe import load_recipe
    from agentrl.rollout.run import load_driver_parts

    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    config = load_recipe("recipes/quickstart.yaml", [f"rollout.tool_configs=[{mcp_file(tmp_path, ['multiply'], marker)}]",
                                                     "model.path=smollm2-135m-instruct",
                                                     "reward.function=no_such_module_here:reward"])
    with pytest.raises(ConfigError, match="no_such_module_here"):
        load_driver_parts(config)  # the tools load (the server starts) before the reward function
    assert server_stopped(marker)


def test_roles_that_fail_to_start_close_the_engine_and_the_tools_servers(tmp_path, tiny_model_dir, tokenizer):
    from agentrl.recipe import load_recipe
    from agentrl.trainer.roles import LocalRoles

    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    config = load_recipe("recipes/quickstart.yaml", [f"rollout.tool_configs=[{mcp_file(tmp_path, ['multiply'], marker)}]",
                                                     f"model.path={tiny_model_dir}", "model.dtype=float32",
                                                     "trainer.dtype=float32", "model.lora.rank=4",
                                                     "model.lora.target_modules=[nope_proj]"])
    with pytest.raises(ConfigError, match="nope_proj"):
        LocalRoles(config, tokenizer)  # the rollout worker (engine, tools) starts before the policy fails
    assert server_stopped(marker)


def test_a_tool_file_that_fails_after_an_mcp_entry_stops_its_server(tmp_path):
    """The server of an entry before the one that failed, or of a file before the one that failed,
    ran until the process exited."""
    from agentrl.tools.loader import load_tool_files

    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    path = mcp_file(tmp_path, ["multiply"], marker)
    entry = json.loads(path.read_text())["tools"][0]
    path.write_text(json.dumps({"tools": [entry, {"class": "tests.nowhere:tool"}]}))
    with pytest.raises(ConfigError, match=r"tool #2 \(class 'tests.nowhere:tool'\): cannot import module 'tests.nowhere'"):
        load_tools(path)
    assert server_stopped(marker)
    path.write_text(json.dumps({"tools": [entry]}))
    later = tmp_path / "later.yaml"
    later.write_text("tools:\n  - class: calculator\n  - class: calculator\n")
    with pytest.raises(ConfigError, match="duplicate name"):
        load_tool_files([path, later])
    assert server_stopped(marker)


def test_a_header_no_request_can_carry_is_refused_without_showing_it(tmp_path, monkeypatch):
    """A secret read from a file ends in a newline: the HTTP client refused the header, and the
    error it raised, with the value in it, was the load's message."""
    monkeypatch.setenv("AGENTRL_TEST_MCP_TOKEN", "s3cr3t-from-a-file\n")
    path = tmp_path / "mcp.yaml"
    with socket.create_server(("127.0.0.1", 0)) as listening:  # accepts, so that a request would be sent
        url = f"http://127.0.0.1:{listening.getsockname()[1]}/mcp"
        config = {"url": url, "allow": ["multiply"], "headers": {"Authorization": "Bearer ${AGENTRL_TEST_MCP_TOKEN}"},
                  "connect_timeout_s": 3}
        path.write_text(json.dumps({"tools": [{"class": "agentrl.tools.mcp:MCPTools", "config": config}]}))
        with pytest.raises(ConfigError) as e:
            load_tools(path)
    assert str(e.value) == (
        f"{path}: tool #1 (class 'agentrl.tools.mcp:MCPTools'): constructing agentrl.tools.mcp:MCPTools with config "
        f"{{'url': '{url}', 'allow': ['multiply'], 'headers': {{'Authorization': '***'}}, 'connect_timeout_s': 3.0}} "
        "failed: headers.Authorization: its value has a newline at position 26 of 26, which a header cannot hold "
        "(only printable ASCII, spaces only inside; a secret made from a file often ends in a newline)")


def test_an_error_that_quotes_a_header_shows_no_secret(monkeypatch):
    """Whatever the HTTP client or the SDK put in its message, a value taken from the environment
    or a header's value does not reach the error."""
    monkeypatch.setenv("AGENTRL_TEST_MCP_TOKEN", "s3cr3t-token")

    async def refusing(self, *args):
        raise RuntimeError(f"header {self._server[1]['Authorization']!r} refused, token s3cr3t-token")

    monkeypatch.setattr(MCPTools, "_transport", refusing)
    with pytest.raises(ValueError) as e:
        MCPTools(allow=["multiply"], url="http://127.0.0.1:9/mcp",
                 headers={"Authorization": "Bearer ${AGENTRL_TEST_MCP_TOKEN}"})
    assert str(e.value) == ("cannot reach the MCP server http://127.0.0.1:9/mcp: RuntimeError: header '***' refused, "
                            "token ***")


def test_a_stdio_message_over_the_cap_fails_its_call_at_once_and_the_next_call_reconnects(monkeypatch, capfd):
    """The SDK's reader joined and split its whole buffer again at every piece that came: 64 MB
    took half a minute, holding every other call to the server, and nothing bounded it."""
    import agentrl.tools.mcp as mcp_tools

    monkeypatch.setattr(mcp_tools, "MAX_MESSAGE_MB", 1.0, raising=False)
    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    source = MCPTools(allow=["ramble", "multiply"], command=[sys.executable, "tests/mcp_server.py", marker])
    ramble, multiply = source.tools()
    label = shlex.join([sys.executable, "tests/mcp_server.py", marker])

    async def call(tool: MCPTool, **arguments) -> str:
        try:
            return (await asyncio.wait_for(tool.execute("e", arguments), 20)).text
        except MCPToolError as e:
            return f"MCPToolError: {e}"

    try:
        # The server sends the text twice (as content and as structured content): 0.8 MB, in many pieces.
        assert asyncio.run(call(ramble, characters=400_000)) == "x" * 400_000
        started = time.monotonic()
        assert asyncio.run(call(ramble, characters=2**20)) == (
            f"MCPToolError: the MCP server {label} sent a message of more than 1 MB (the most read from a stdio "
            "server), so its session was ended; the next call reconnects")
        assert time.monotonic() - started < 10  # not the call's timeout (30 s)
        assert asyncio.run(call(multiply, a=6, b=7)) == "42"
        assert (f"agentrl: warning: reconnected to the MCP server {label} (it sent a message of more than 1 MB)"
                in capfd.readouterr().err)
    finally:
        source.close()
    assert server_stopped(marker)


def test_a_server_that_never_answers_at_startup_is_named_within_the_connect_timeout():
    """The load waited connect_timeout_s + 5 s and said only "TimeoutError: "."""
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):  # listening, never answering
        started = time.monotonic()
        with pytest.raises(ValueError) as refused:
            MCPTools(allow=["multiply"], url=f"http://127.0.0.1:{port}/mcp", connect_timeout_s=1)
        waited_s = time.monotonic() - started
    assert str(refused.value) == f"cannot reach the MCP server http://127.0.0.1:{port}/mcp: no session within 1 s"
    assert waited_s < 4, waited_s
