"""The SGLang engine against SGLang's API, without SGLang: every call, keyword and route it uses exists.

SGLang cannot be installed where this suite runs (CI has no GPU and no SGLang), so the engine is
checked against tests/sglang_api.json, a snapshot of the signatures it needs read from SGLang's
source by tests/sglang_api.py; when that source (../shared/sglang-cpu, or $SGLANG_CPU) is present,
the snapshot is checked against it too. The HTTP engine's requests go to an httpx mock transport
that records them: the process boundary to an SGLang server is what cannot run here. The real
engine against real SGLang is `make test-sglang` (tests/real_sglang/).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from functools import partial
from typing import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.config import SGLangConfig
from agentrl.recipe import load_recipe
from agentrl.errors import ConfigError
from agentrl.rollout import sglang_server
from agentrl.rollout.run import build_engine
from agentrl.rollout.sglang_engine import _SGLANG_REGIONS, ReleasedRegions, sampling_dict, server_args
from agentrl.rollout.sglang_launch import cli_flags
from agentrl.rollout.sglang_server import SGLangServerEngine
from agentrl.types import SamplingParams
from safetensors.torch import load_file
from tests.sglang_api import SNAPSHOT, extract

API = json.loads(SNAPSHOT.read_text())
SOURCE = Path(os.environ.get("SGLANG_CPU", Path(__file__).parents[1] / ".." / "shared" / "sglang-cpu")) / API["source"]
ENGINE_SOURCE = Path(__file__).parents[1] / "agentrl" / "rollout" / "sglang_engine.py"
REGENERATE = "update tests/sglang_api.py's lists and run `python tests/sglang_api.py SGLANG-SOURCE.tar.gz`"


def test_snapshot_matches_the_sglang_source():
    if not SOURCE.is_file():
        pytest.skip(f"no SGLang source at {SOURCE} (set SGLANG_CPU=DIR to check the snapshot against it)")
    assert extract(SOURCE) == API


def engine_calls(owner: str) -> list[tuple[str, list[str | None]]]:
    """(method, keywords) of every `OWNER.METHOD(...)` call in sglang_engine.py."""
    calls = []
    for node in ast.walk(ast.parse(ENGINE_SOURCE.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == owner:
            calls.append((node.func.attr, [kw.arg for kw in node.keywords]))
    return calls


def test_in_process_engine_calls_exist_with_those_keywords():
    calls = engine_calls("self._engine")
    assert {name for name, _ in calls} == {"async_generate", "update_weights_from_tensor",
                                           "release_memory_occupation", "resume_memory_occupation", "shutdown"}
    for name, keywords in calls:
        assert name in API["engine_methods"], f"sglang.Engine.{name} is not in the snapshot: {REGENERATE}"
        spec = API["engine_methods"][name]
        assert set(keywords) <= set(spec["params"]), f"sglang.Engine.{name} takes no {set(keywords) - set(spec['params'])}"
        # Synchronous calls are routed to the engine's loop thread through Engine.loop.run_until_complete.
        assert spec["async"] if name == "async_generate" else spec["runs_on_self_loop"] or name == "shutdown", name
    assert API["engine_methods"]["__init__"]["var_kwargs"]  # sglang.Engine(**server_args)
    # The flush that waits for an idle scheduler is the tokenizer manager's (a coroutine).
    assert engine_calls("self._engine.tokenizer_manager") == [("flush_cache", ["timeout_s"])]
    spec = API["tokenizer_manager_methods"]["flush_cache"]
    assert spec["async"] and "timeout_s" in spec["params"]
    # A cancelled caller's request is aborted by its rid: abort_request(rid), a plain function
    # scheduled on the engine's loop, and generate passes that rid to async_generate.
    tree = ast.parse(ENGINE_SOURCE.read_text())
    scheduled = [node.args for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and ast.unparse(node.func) == "self._thread.loop.call_soon_threadsafe"]
    assert [ast.unparse(args[0]) for args in scheduled] == ["self._engine.tokenizer_manager.abort_request"]
    abort = API["tokenizer_manager_methods"]["abort_request"]
    assert not abort["async"] and abort["params"][:2] == ["self", "rid"] and len(scheduled[0]) == 2
    assert ("async_generate", ["input_ids", "sampling_params", "return_logprob", "rid"]) in calls


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_server_args_are_sglang_fields_and_flags(device):
    args = server_args("/models/m", device, "bfloat16", 3, SGLangConfig(max_total_tokens=4096, tp_size=2))
    assert args["device"] == device[:4] and args.get("base_gpu_id") == (1 if device == "cuda:1" else None)
    assert set(args) <= set(API["server_args"]), f"not in the snapshot: {set(args) - set(API['server_args'])}; {REGENERATE}"
    assert args["enable_memory_saver"] is (device != "cpu") and args["skip_tokenizer_init"] is True
    assert args["attention_backend"] == "torch_native" if device == "cpu" else "attention_backend" not in args
    for key, value in args.items():  # True becomes a bare flag, which only a bool field takes
        assert isinstance(value, bool) == (API["server_args"][key] == "bool"), key
    flags = cli_flags(args)
    assert flags[:2] == ["--model-path", "/models/m"] and flags[flags.index("--tp-size") + 1] == "2"
    assert ("--enable-memory-saver" in flags) is (device != "cpu")  # False is left out, True is a bare flag
    assert flags[flags.index("--skip-tokenizer-init") + 1].startswith("--")
    named = [f[2:].replace("-", "_") for f in flags if f.startswith("--")]
    assert set(named) <= set(API["server_args"])


def test_extra_args_reach_sglang_unchanged():
    args = server_args("m", "cuda", "bfloat16", 0, SGLangConfig(extra_args={"context_length": 4096, "log_level": "info"}))
    assert args["context_length"] == 4096 and args["log_level"] == "info"


def test_sampling_keys_are_sglang_sampling_params():
    params = sampling_dict(SamplingParams(max_new_tokens=7, temperature=0.0, top_p=0.9, stop_token_ids=(2, 5)))
    assert params == {"max_new_tokens": 7, "temperature": 0.0, "top_p": 0.9, "stop_token_ids": [2, 5]}
    assert set(params) <= set(API["sampling_params"])


def test_memory_regions_are_sglang_memory_types_and_resume_in_order():
    assert {r for regions in _SGLANG_REGIONS.values() for r in regions} == set(API["memory_types"])
    regions = ReleasedRegions()
    assert regions.to_resume(None) == []  # nothing released: SGLang would fail on resuming
    released = regions.to_release()
    assert released == ["weights", "kv_cache", "cuda_graph"]
    regions.released.update(released)
    assert regions.to_release() == []
    assert regions.to_resume(("weights",)) == ["weights"]
    assert regions.to_resume(("kv_cache", "weights")) == ["weights", "kv_cache", "cuda_graph"]
    with pytest.raises(ValueError, match=r"resume_memory: unknown tags \['kv'\]; expected weights, kv_cache"):
        regions.to_resume(("kv",))


class RestrictedUnpickler(pickle.Unpickler):
    """The rule of SGLang's SafeUnpickler: only globals from the allowed module prefixes."""

    def find_class(self, module: str, name: str):
        if not any((module + ".").startswith(p) for p in API["unpickler_allowed_prefixes"]):
            raise pickle.UnpicklingError(f"SGLang would refuse {module}.{name}")
        return super().find_class(module, name)


# The /server_info fields the engine reads (a real one holds every ServerArgs field and more).
SERVER_INFO = {"enable_memory_saver": True, "device": "cuda", "context_length": None, "max_total_num_tokens": 400000,
               "max_req_input_len": 32762}


class FakeServer:
    """Answers like SGLang's HTTP server (shapes taken from a real one) and records each request."""

    def __init__(self, failures: int = 0):
        self.info = dict(SERVER_INFO)
        self.requests: list[tuple[str, str, dict]] = []
        self.failures = failures  # connection errors before the first answer
        self.loaded: list[dict[str, dict[str, torch.Tensor]]] = []  # shards of each disk update
        self.queries: list[dict[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.failures:
            self.failures -= 1
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content) if request.content else {}
        self.requests.append((request.method, request.url.path, body))
        self.queries.append(dict(request.url.params))
        if request.url.path == "/update_weights_from_disk":  # read now: the next update deletes the files
            self.loaded.append({f.name: load_file(f) for f in sorted(Path(body["model_path"]).iterdir())})
        if request.url.path == "/server_info":
            return httpx.Response(200, json=self.info)
        if request.url.path != "/generate":
            return httpx.Response(200, json=None)
        if body["sampling_params"]["max_new_tokens"] == 0:  # a score request
            ids = body["input_ids"][body["logprob_start_len"]:]
            return httpx.Response(200, json={"output_ids": [], "meta_info": {
                "finish_reason": {"type": "length", "length": 0},
                "input_token_logprobs": [[None, ids[0], None]] + [[-0.5, t, None] for t in ids[1:]]}})
        return httpx.Response(200, json={"output_ids": [7, 2], "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "cached_tokens": 2,
            "output_token_logprobs": [[-0.25, 7, None], [-0.75, 2, None]]}})


@pytest.fixture
def fake_server(monkeypatch):
    server = FakeServer()
    transport = httpx.MockTransport(server)
    monkeypatch.setattr(sglang_server.httpx, "Client", partial(httpx.Client, transport=transport))
    monkeypatch.setattr(sglang_server.httpx, "AsyncClient", partial(httpx.AsyncClient, transport=transport))
    return server


def check_against_api(method: str, path: str, body: dict, query: dict | None = None) -> None:
    route = API["routes"][path]
    assert method in route["methods"], (method, path)
    assert set(query or {}) <= set(route["params"]), (path, query)
    if route["body"]:
        assert set(body) <= set(API["requests"][route["body"]]), f"{path}: {set(body) - set(API['requests'][route['body']])}"


async def test_server_engine_requests_are_sglang_requests(fake_server):
    import asyncio

    engine = SGLangServerEngine("http://127.0.0.1:1", {"tp_size": 2}, update_bucket_bytes=48, weight_transfer="tensor")
    completion = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(2,)))
    assert (completion.token_ids, completion.logprobs, completion.finish) == ([7, 2], [-0.25, -0.75], "stop")
    assert engine.stats == {"requests": 1, "generated_tokens": 2, "prompt_tokens": 3, "cached_tokens": 2}
    assert await asyncio.to_thread(engine.score, [1, 2, 3, 4], 2) == [-0.5, -0.5]
    weights = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3)), ("c", torch.zeros(4))]  # 24, 24, 16 bytes
    engine.release_memory()
    engine.resume_memory(("weights",))
    engine.update_weights(iter(weights), version=3)
    engine.resume_memory(("kv_cache",))
    engine.resume_memory(("kv_cache",))  # nothing left to resume: no request
    assert engine.weight_version == 3

    paths = [(m, p) for m, p, _ in fake_server.requests]
    assert paths == [("GET", "/health_generate"), ("GET", "/server_info"), ("POST", "/generate"), ("POST", "/generate"),
                     ("POST", "/flush_cache"), ("POST", "/release_memory_occupation"),
                     ("POST", "/resume_memory_occupation")] + [("POST", "/update_weights_from_tensor")] * 3 + [
                     ("POST", "/flush_cache"), ("POST", "/resume_memory_occupation")]
    for (method, path, body), query in zip(fake_server.requests, fake_server.queries):
        check_against_api(method, path, body, query)
        if "sampling_params" in body:
            assert set(body["sampling_params"]) <= set(API["sampling_params"])
    # Every flush (also the one before a release) waits for the scheduler to be idle.
    assert [q for (_, p, _), q in zip(fake_server.requests, fake_server.queries) if p == "/flush_cache"] == \
        [{"timeout": "60.0"}] * 2
    tags = [body["tags"] for _, path, body in fake_server.requests if "memory" in path]
    assert tags == [["weights", "kv_cache", "cuda_graph"], ["weights"], ["kv_cache", "cuda_graph"]]
    # By value, buckets of at most 48 / tp_size = 24 bytes, so that a body holding one payload per
    # tensor-parallel rank stays within 48 bytes of tensors; each payload a pickle SGLang accepts.
    updates = [body for _, path, body in fake_server.requests if path == "/update_weights_from_tensor"]
    assert [u["flush_cache"] for u in updates] == [False, False, False]
    received = []
    for update in updates:
        first, second = update["serialized_named_tensors"]
        assert first == second
        received += RestrictedUnpickler(io.BytesIO(base64.b64decode(first))).load()
    assert [name for name, _ in received] == ["a", "b", "c"]
    for (_, sent), (_, got) in zip(weights, received):
        assert torch.equal(sent, got)


class LengthFirstServer:
    """Answers /generate with scripted turns the way older SGLang schedulers finish a request: the
    length budget is tested before the stop tokens, so a turn whose <|im_end|> is its last allowed
    token is reported as "length"."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.reasons = turns, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json=SERVER_INFO)
        if request.url.path != "/generate":
            return httpx.Response(200, json=None)
        budget = json.loads(request.content)["sampling_params"]["max_new_tokens"]
        ids = self.turns[len(self.reasons)][:budget]
        self.reasons.append("length" if len(ids) >= budget else "stop")
        return httpx.Response(200, json={"output_ids": ids, "meta_info": {
            "finish_reason": {"type": self.reasons[-1]}, "output_token_logprobs": [[-0.5, t, None] for t in ids]}})


def test_a_turn_ending_in_its_stop_token_on_its_last_allowed_position_finished(monkeypatch, tokenizer):
    """The episode read SGLang's "length" for such a turn as a cut-off: the tool call it made never
    ran, and the episode ended "length" with the <|im_end|> left in the message a grader reads."""
    import asyncio

    from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
    from agentrl.tools.builtin.calculator import calculator
    from agentrl.tools.parsers import parse_hermes
    from agentrl.types import Task

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    turns = [tokenizer(text, add_special_tokens=False)["input_ids"] + [2] for text in (call, "It is 42.")]
    server = LengthFirstServer(turns)
    transport = httpx.MockTransport(server)
    monkeypatch.setattr(sglang_server.httpx, "Client", partial(httpx.Client, transport=transport))
    monkeypatch.setattr(sglang_server.httpx, "AsyncClient", partial(httpx.AsyncClient, transport=transport))
    engine = SGLangServerEngine("http://127.0.0.1:1", {})
    runner = EpisodeRunner(engine, tokenizer, [calculator], parse_hermes,
                           EpisodeSettings(max_new_tokens_per_turn=len(turns[0])), reward_fn=lambda task, messages: 0.0)
    traj = asyncio.run(runner.run(Task(id="t", prompt="6 * 7?", answer="42"), group_id="g"))
    engine.close()

    assert server.reasons == ["length", "stop"]  # the first turn used its whole budget, <|im_end|> last
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[1]["content"] == call and "truncated" not in traj.messages[1]
    assert traj.messages[2]["content"] == "42" and traj.finish == "stop"
    assert traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 1
    # A turn cut off before its stop token is still "length".
    server.turns, server.reasons = [[7, 8, 9, 2]], []
    engine = SGLangServerEngine("http://127.0.0.1:1", {})
    completion = asyncio.run(engine.generate([1], SamplingParams(max_new_tokens=3, stop_token_ids=(2,))))
    engine.close()
    assert (completion.token_ids, completion.finish) == ([7, 8, 9], "length")


def test_cpu_weights_reach_a_loopback_server_through_safetensors_shards(fake_server):
    engine = SGLangServerEngine("http://127.0.0.1:1", {}, update_bucket_bytes=40)
    embed = torch.arange(6.0).reshape(2, 3)
    weights = [("embed", embed), ("norm", torch.ones(4)), ("lm_head", embed), ("mlp", torch.full((5,), 2.0))]
    engine.update_weights(iter(weights), version=1, flush_cache=False)
    first_dir = Path(fake_server.requests[-1][2]["model_path"])
    engine.update_weights(iter(weights[:1]), version=2)
    assert [p for _, p, _ in fake_server.requests] == ["/health_generate", "/server_info", "/update_weights_from_disk",
                                                       "/update_weights_from_disk", "/flush_cache"]
    for method, path, body in fake_server.requests:
        check_against_api(method, path, body)
    assert fake_server.requests[2][2]["flush_cache"] is False
    # Buckets of at most 40 bytes become shards; the tied lm_head, in a bucket of its own, goes under its name.
    assert [{k: v.tolist() for k, v in shard.items()} for shard in fake_server.loaded[0].values()] == [
        {"embed": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "norm": [1.0] * 4}, {"lm_head": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]},
        {"mlp": [2.0] * 5}]
    assert list(fake_server.loaded[0]) == ["model-00000.safetensors", "model-00001.safetensors",
                                           "model-00002.safetensors"]
    assert not first_dir.exists() and engine._weights_dir.is_dir()  # the server's current model path stays
    engine.close()
    assert not engine._weights_dir.exists() and engine.weight_version == 2


def test_every_weight_reaches_the_disk_update_ties_in_one_shard_once(fake_server):
    """Merged LoRA weights or gathered shards are fresh tensors, and one may sit where a freed one
    sat: the disk update used to take it for a tie of the earlier name and drop it (the server kept
    stale weights). A tie inside one bucket used to make safetensors refuse the shard."""
    import weakref

    import numpy as np

    engine = SGLangServerEngine("http://127.0.0.1:1", {}, update_bucket_bytes=16)  # a bucket per weight
    memory, free = np.zeros((3, 4), dtype=np.float32), [0, 1, 2]  # an allocator: a slot is reused once freed

    def fresh():
        for i in range(6):
            slot = free.pop(0)
            view = memory[slot]  # the tensor's storage holds this view; when that goes, the slot is free again
            weakref.finalize(view, free.append, slot)
            yield f"layers.{i}.weight", torch.from_numpy(view).fill_(float(i))

    engine.update_weights(fresh(), version=1, flush_cache=False)
    engine.update_bucket_bytes = 2**30  # one bucket: a tie inside a shard
    embed = torch.arange(6.0).reshape(2, 3)
    engine.update_weights(iter([("embed", embed), ("norm", torch.ones(4)), ("lm_head", embed)]), version=2,
                          flush_cache=False)
    first, second = ({name: t.tolist() for shard in update.values() for name, t in shard.items()}
                     for update in fake_server.loaded)
    assert first == {f"layers.{i}.weight": [float(i)] * 4 for i in range(6)}
    assert second == {"embed": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "norm": [1.0] * 4}
    engine.close()


def test_server_engine_retries_then_names_url_route_and_cause(monkeypatch):
    server = FakeServer(failures=2)
    monkeypatch.setattr(sglang_server.httpx, "Client", partial(httpx.Client, transport=httpx.MockTransport(server)))
    monkeypatch.setattr(sglang_server.time, "sleep", lambda s: None)
    engine = SGLangServerEngine("http://127.0.0.1:9/", {})  # the health check only answers on its third try
    engine.update_weights([("w", torch.ones(1))], version=1)  # retried posts reach the server
    assert [p for _, p, _ in server.requests] == ["/health_generate", "/server_info", "/update_weights_from_disk",
                                                  "/flush_cache"]
    server.failures = 3
    with pytest.raises(RuntimeError, match=r"^SGLang server at http://127.0.0.1:9: POST /flush_cache failed "
                                           r"\(ConnectError: connection refused\)$"):
        engine.update_weights([], version=2)
    assert engine.weight_version == 1
    weights_dir = engine._weights_dir
    engine.close()  # the server's current weights live in a temporary directory until then
    assert not weights_dir.exists()


def test_a_request_that_timed_out_waiting_for_its_answer_is_not_sent_again(monkeypatch):
    """A server that accepts but never answers: the request may still be running there, so it
    fails after one timeout (naming it) instead of being sent three times."""
    server = FakeServer()
    monkeypatch.setattr(sglang_server.httpx, "Client", partial(httpx.Client, transport=httpx.MockTransport(server)))
    monkeypatch.setattr(sglang_server.time, "sleep", lambda s: None)
    engine = SGLangServerEngine("http://127.0.0.1:9/", {})
    sent = []

    def hung(request):
        sent.append(request.url.path)
        raise httpx.ReadTimeout("timed out", request=request)

    engine._client._transport = httpx.MockTransport(hung)
    with pytest.raises(RuntimeError, match=r"^SGLang server at http://127.0.0.1:9: POST /flush_cache failed "
                                           r"\(ReadTimeout: timed out\)$"):
        engine.update_weights([], version=1)
    assert sent == ["/flush_cache"]


def test_list_and_mapping_values_become_flags_argparse_reads():
    flags = cli_flags({"cuda_graph_bs": [1, 2, 4], "json_model_override_args": {"a": 1}, "tp_size": 2})
    assert flags == ["--cuda-graph-bs", "1", "2", "4", "--json-model-override-args", '{"a": 1}', "--tp-size", "2"]


def test_health_check_on_a_port_nothing_listens_on_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RuntimeError, match=rf"^SGLang server at http://127.0.0.1:{port}: GET /health_generate "
                                           r"failed \(ConnectError: "):
        SGLangServerEngine(f"http://127.0.0.1:{port}", {}, timeout_s=5.0)


def test_engine_name_picks_the_engine_and_sglang_is_imported_only_for_it(tiny_model_dir, monkeypatch):
    config = load_recipe(None, [f"model.path={tiny_model_dir}"])
    assert type(build_engine(config, pad_token_id=2)).__name__ == "HFEngine"
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "sglang" else object())
    sglang_config = load_recipe(None, [f"model.path={tiny_model_dir}", "engine.name=sglang"])
    with pytest.raises(ConfigError, match=r"^engine.name 'sglang': SGLang is not installed here"):
        build_engine(sglang_config, pad_token_id=2)
    with pytest.raises(ConfigError, match=r"engine.name: Input should be 'hf' or 'sglang' \(got 'vllm'\)"):
        load_recipe(None, ["engine.name=vllm"])


def test_a_server_that_never_answers_the_connection_fails_within_timeout_s(monkeypatch):
    """A host gone dark (its SYNs unanswered, here a loopback socket whose accept queue is full):
    each connection attempt used to wait a whole timeout_s, three times over. Now the retries share
    one timeout_s, each attempt at most CONNECT_TIMEOUT_S."""
    import asyncio
    import socket
    import time

    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(0)
    fillers = []
    for _ in range(4):  # fill the accept queue: later connection attempts get no answer at all
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(black_hole.getsockname())
        except BlockingIOError:
            pass
        fillers.append(filler)
    time.sleep(0.2)
    monkeypatch.setattr(SGLangServerEngine, "check_health", lambda self: None)
    monkeypatch.setattr(SGLangServerEngine, "_read_server_info", lambda self: {})
    engine = SGLangServerEngine(f"http://127.0.0.1:{black_hole.getsockname()[1]}", {}, timeout_s=2.0)
    try:
        for name, request in (("generate", lambda: asyncio.run(engine.generate([1, 2], SamplingParams(4)))),
                              ("flush_cache", engine.flush_cache)):
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"failed \(ConnectTimeout"):
                request()
            assert time.monotonic() - started < 4.0, name  # before: 3 × 2 s + backoff, 7.5 s
    finally:
        engine.close()
        for s in fillers + [black_hole]:
            s.close()


@contextlib.contextmanager
def http_on_loopback(answer: Callable[[httpx.Request], httpx.Response]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 whose every request `answer` replies to, with sockets kept
    alive between requests as SGLang's are; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.reply(b"")

        def do_POST(self):
            self.reply(self.rfile.read(int(self.headers.get("Content-Length", 0))))

        def reply(self, body: bytes):
            response = answer(httpx.Request(self.command, f"http://127.0.0.1{self.path}", content=body))
            self.send_response(response.status_code)
            self.send_header("Content-Length", str(len(response.content)))
            self.end_headers()
            self.wfile.write(response.content)

    class Server(ThreadingHTTPServer):
        request_queue_size = 64  # a rollout's requests connect at once

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def loopback_server():
    """A stand-in for SGLang's HTTP server on 127.0.0.1 (SGLang needs a GPU): real sockets. GET
    answers an empty 200; POST answers `answer["body"]`, `answer["delay_s"]` late."""
    answer = {"body": json.dumps({"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"},
                                                                   "output_token_logprobs": [[-0.5, 7, None]]}})}

    def reply(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200)
        time.sleep(answer.get("delay_s", 0.0))
        return httpx.Response(200, content=answer["body"].encode())

    with http_on_loopback(reply) as url:
        yield url, answer


def test_a_200_whose_body_is_not_sglangs_answer_names_url_route_and_body(loopback_server):
    """A proxy's error page or another service on the port used to end in a bare JSONDecodeError
    or KeyError naming neither the server nor the route."""
    import asyncio

    url, answer = loopback_server
    engine = SGLangServerEngine(url, {})
    calls = {"generate": lambda: asyncio.run(engine.generate([1, 2], SamplingParams(4))),
             "score": lambda: engine.score([1, 2, 3], 1)}
    try:
        for body, cause in (("<html>502 Bad Gateway</html>", "JSONDecodeError: Expecting value: line 1 column 1 "
                                                             "(char 0)"),
                            ('{"error": "overloaded"}', "KeyError: 'meta_info'")):
            answer["body"] = body
            message = f"SGLang server at {url}: POST /generate failed (HTTP 200 with an unexpected body " \
                      f"({cause}): {body})"
            for call in calls.values():
                with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
                    call()
    finally:
        engine.close()


def test_each_rollouts_connections_close_with_its_event_loop_and_the_last_in_close(loopback_server):
    """Each rollout runs in an event loop of its own, with a client of its own. Those clients used
    to stay open after their loops ended (here 20 sockets each, and as many in the server), and
    close() did not close the last one."""
    import asyncio

    url, _ = loopback_server
    engine = SGLangServerEngine(url, {})

    def open_fds(settled_at: int) -> int:  # the server closes its ends in its own threads: a moment later
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/fd")) != settled_at and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(os.listdir("/proc/self/fd"))

    async def rollout():
        await asyncio.gather(*(engine.generate([1, 2, 3], SamplingParams(1)) for _ in range(20)))

    before = len(os.listdir("/proc/self/fd"))  # with the synchronous client's connection, both ends
    for _ in range(3):
        asyncio.run(rollout())
        assert open_fds(before) == before
    loop = asyncio.new_event_loop()  # a loop that stays open: its client is still connected
    try:
        loop.run_until_complete(rollout())
        assert len(os.listdir("/proc/self/fd")) >= before + 40  # 20 connections, both ends
        engine.close()
    finally:
        loop.close()
    assert open_fds(before - 2) == before - 2  # the synchronous client's connection closed too


def test_rollouts_in_two_threads_keep_their_own_connections(loopback_server):
    """Each thread's event loop gets its own client; a loop asking for one used to close the other
    loop's while its requests were in flight (they failed with ReadError, and a generate that may
    have reached the server is not sent again)."""
    import asyncio

    url, answer = loopback_server
    answer["delay_s"] = 0.1
    engine = SGLangServerEngine(url, {})
    results: list = []

    def rollouts() -> None:
        async def one() -> list:
            return await asyncio.gather(*(engine.generate([1, 2, 3], SamplingParams(1)) for _ in range(4)),
                                        return_exceptions=True)

        for _ in range(4):
            results.extend(asyncio.run(one()))

    threads = [threading.Thread(target=rollouts) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    engine.close()
    assert [type(r).__name__ for r in results] == ["Completion"] * 32, [r for r in results if isinstance(r, Exception)]


@pytest.fixture
def fake_sglang_on_loopback():
    """FakeServer behind a real HTTP server on 127.0.0.1, for code that builds its own engine (a
    training run): (url, the FakeServer)."""
    fake = FakeServer()
    with http_on_loopback(fake) as url:
        yield url, fake


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_training_run_deletes_its_weight_files_and_stops_its_tool_servers_when_it_ends(
        tmp_path, tiny_model_dir, fake_sglang_on_loopback, backend):
    """The rollout workers' engines and tools used to be left to the process's exit (which Ray's
    kill does not run): every run on an SGLang server left its last weights, a copy of the model,
    in the temporary directory, and an MCP server per rollout worker ran on after train() returned."""
    from agentrl.rollout.run import run_rollout
    from agentrl.train import train
    from tests.test_mcp_tool import mcp_file, server_stopped

    url, fake = fake_sglang_on_loopback
    marker = f"agentrl-mcp-{uuid.uuid4().hex}"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        model: {{path: {tiny_model_dir}, dtype: float32}}
        output_dir: {tmp_path / "run"}
        engine: {{name: sglang, sglang: {{mode: server, url: '{url}'}}}}
        data: {{source: arithmetic, num_tasks: 2}}
        rollout: {{group_size: 2, max_turns: 1, max_new_tokens_per_turn: 4,
                   tool_configs: ['{mcp_file(tmp_path, ["multiply"], marker)}']}}
        trainer: {{steps: 2, tasks_per_step: 1, dtype: float32, backend: {backend}}}
        reward: {{function: null, tool_step_rewards: true}}
    """))

    if backend == "local":
        train(load_recipe(recipe, for_training=True))
    else:  # through the command, as a user runs it: a local Ray whose actors this test cannot reach
        ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        try:
            done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(recipe)], capture_output=True,
                                  text=True, timeout=600, env={**os.environ, "RAY_TMPDIR": ray_tmp,
                                                               "RAY_USAGE_STATS_ENABLED": "0"})
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        assert done.returncode == 0, done.stderr[-3000:]
    disk_updates = [body["model_path"] for _, path, body in fake.requests if path == "/update_weights_from_disk"]
    assert len(disk_updates) == 2 and all(fake.loaded)  # a sync after each step, each read by the server
    assert not any(Path(d).exists() for d in disk_updates)
    assert server_stopped(marker)

    if backend == "local":
        run_rollout(load_recipe(recipe, ["output_dir=" + str(tmp_path / "rollout")]))
        assert (tmp_path / "rollout" / "rollout.jsonl").is_file() and server_stopped(marker)


def test_a_disk_update_that_cannot_be_written_keeps_no_files_and_sends_nothing(fake_server, monkeypatch):
    """A full disk in the middle of the shards used to leave them in the temporary directory, where
    nothing deleted them, not even close()."""
    engine = SGLangServerEngine("http://127.0.0.1:1", {}, update_bucket_bytes=16)  # a bucket per weight
    engine.update_weights([("w", torch.ones(4))], version=1, flush_cache=False)
    kept = engine._weights_dir
    written: list[Path] = []

    def save_until_full(shard, path):
        if written:
            raise OSError(28, "No space left on device")
        save_file(shard, path)
        written.append(Path(path))

    from safetensors.torch import save_file

    monkeypatch.setattr(sglang_server, "save_file", save_until_full)
    with pytest.raises(OSError, match="No space left on device"):
        engine.update_weights([("a", torch.ones(4)), ("b", torch.ones(4))], version=2, flush_cache=False)
    assert len(written) == 1 and not written[0].parent.exists()
    assert engine._weights_dir == kept and kept.is_dir() and engine.weight_version == 1  # the server's weights
    assert [p for _, p, _ in fake_server.requests].count("/update_weights_from_disk") == 1
    engine.close()
    assert not kept.exists()


def test_closing_a_rollout_closes_every_part_and_never_raises(fake_server, tokenizer, capsys):
    """A tool connection that fails to close must not keep the engine's files, nor replace the
    run's own outcome (close_runner runs in `finally` blocks)."""
    from types import SimpleNamespace

    from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
    from agentrl.rollout.run import close_runner
    from agentrl.tools.parsers import parse_hermes

    class GoneSource:
        def close(self):
            raise ConnectionResetError("the tool server went away")

    schema = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                               "parameters": {"type": "object", "properties": {}}}}
    tool = SimpleNamespace(name="lookup", schema=schema, source=GoneSource())
    engine = SGLangServerEngine("http://127.0.0.1:1", {})
    engine.update_weights([("w", torch.ones(4))], version=1)
    weights_dir = engine._weights_dir
    close_runner(EpisodeRunner(engine, tokenizer, [tool], parse_hermes, EpisodeSettings()))
    assert not weights_dir.exists()
    assert capsys.readouterr().err == ("agentrl: warning: closing the rollout's tools failed: "
                                       "ConnectionResetError: the tool server went away\n")
