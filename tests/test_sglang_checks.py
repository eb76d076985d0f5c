"""The SGLang engines' checks against SGLang's limits, and their memory and weight-transfer calls.

SGLang cannot run here, so the in-process sglang.Engine is replaced by a recording stand-in and the
HTTP server by test_sglang_contract.py's FakeServer behind an httpx mock transport; what SGLang
itself does (the prompt limit its scheduler enforces, what /server_info holds, how it reads one
payload per rank) is checked against its source when ../shared/sglang-cpu is present.
"""

from __future__ import annotations

import base64
import io
import pickle
import re
import shutil
import signal
import sys
import tarfile
import threading
import types
from functools import partial
from http.server import ThreadingHTTPServer

import httpx
import pytest
import torch

from agentrl import cli
from agentrl.errors import ConfigError
from agentrl.recipe import load_recipe
from agentrl.rollout import sglang_engine, sglang_server
from agentrl.rollout.run import build_engine
from agentrl.rollout.sglang_engine import ReleasedRegions, SGLangEngine
from agentrl.rollout.sglang_server import SGLangServerEngine
from agentrl.train import train
from tests.conftest import JSONHandler, free_port
from tests.test_sglang_contract import SERVER_INFO, SOURCE, FakeServer

SERVER_WARNING = ("agentrl: warning: the SGLang server at {url} (engine.sglang.url) runs without "
                  "--enable-memory-saver, so it keeps its GPU memory while the trainer runs; if it shares GPUs "
                  "with the trainer, start it with --enable-memory-saver\n")


def sglang_source(path: str) -> str:
    if not SOURCE.is_file():
        pytest.skip(f"no SGLang source at {SOURCE}")
    with tarfile.open(SOURCE) as tar:
        return tar.extractfile(f"python/sglang/srt/{path}").read().decode()


@pytest.fixture
def server(monkeypatch) -> FakeServer:
    fake = FakeServer()
    transport = httpx.MockTransport(fake)
    monkeypatch.setattr(sglang_server.httpx, "Client", partial(httpx.Client, transport=transport))
    monkeypatch.setattr(sglang_server.httpx, "AsyncClient", partial(httpx.AsyncClient, transport=transport))
    return fake


class StartedEngine:
    """sglang_engine.SGLangEngine's stand-in: records that it started, and closes."""

    started: list[dict] = []
    max_req_input_len: int | None = None

    def __init__(self, args, update_bucket_bytes):
        self.args, self.closed = args, False
        StartedEngine.started.append(args)

    def close(self):
        self.closed = True


@pytest.fixture
def in_process(monkeypatch):
    """build_engine's in-process SGLang path, up to the engine's start."""
    StartedEngine.started, StartedEngine.max_req_input_len = [], None
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    monkeypatch.setattr(sglang_engine, "SGLangEngine", StartedEngine)
    return StartedEngine


def sglang_recipe(model_dir, *overrides: str):
    return load_recipe(None, [f"model.path={model_dir}", "engine.name=sglang", *overrides])


# --- the prompt limit ---------------------------------------------------------------------------

def test_the_context_margin_is_sglangs():
    """SGLang aborts a prompt of max_req_input_len = min(context_len - 1, max_total_tokens - 1) - 5
    tokens or more; it rejects prompt + max_new_tokens above context_len in the tokenizer manager."""
    worker = sglang_source("managers/tp_worker.py")
    assert re.search(r"max_req_len = min\(\s*self\.model_config\.context_len - 1,\s*self\.model_runner\."
                     r"effective_max_total_num_tokens \* self\.ps\.attn_dcp_size\s*- 1,\s*\)", worker)
    assert re.search(r"max_req_len,\s*max_req_len - 5,", worker)  # (max_req_len, max_req_input_len)
    assert sglang_engine.CONTEXT_MARGIN == 1 + 5
    assert "if len(req.origin_input_ids) >= max_req_input_len:" in sglang_source("managers/utils.py")


def test_a_context_sglang_would_refuse_stops_before_the_engine_starts(tiny_model_dir, in_process):
    """SGLang served rollout.max_context_tokens up to the model's positions: an episode whose prompt
    came within 6 tokens of them ended in SGLang's error instead of finish 'length'."""
    with pytest.raises(ConfigError, match="^" + re.escape(
            "rollout.max_context_tokens (2048) is more than SGLang serves: it refuses a prompt of 2042 tokens or "
            f"more (the context length of model.path '{tiny_model_dir}' (2048) - 6), and an episode's prompt "
            "reaches rollout.max_context_tokens - 1; set rollout.max_context_tokens to 2042 or less") + "$"):
        build_engine(sglang_recipe(tiny_model_dir), pad_token_id=2)  # the tiny model has 2048 positions
    assert in_process.started == []
    engine = build_engine(sglang_recipe(tiny_model_dir, "rollout.max_context_tokens=2042"), pad_token_id=2)
    assert in_process.started == [engine.args] and not engine.closed


@pytest.mark.parametrize("overrides, limit, why", [
    (["engine.sglang.extra_args={context_length: 1024}"], 1018, "engine.sglang.extra_args.context_length (1024)"),
    (["engine.sglang.max_total_tokens=512"], 506, "engine.sglang.max_total_tokens (512)"),
    (["engine.sglang.max_total_tokens=4096", "engine.sglang.extra_args={max_total_tokens: 700, context_length: 900}"],
     694, "engine.sglang.extra_args.max_total_tokens (700)")])
def test_the_limit_comes_from_the_engine_arguments_when_given(tiny_model_dir, in_process, overrides, limit, why):
    config = sglang_recipe(tiny_model_dir, f"rollout.max_context_tokens={limit + 1}", *overrides)
    with pytest.raises(ConfigError, match=re.escape(f"refuses a prompt of {limit} tokens or more ({why} - 6)")):
        build_engine(config, pad_token_id=2)
    assert in_process.started == []
    build_engine(sglang_recipe(tiny_model_dir, f"rollout.max_context_tokens={limit}", *overrides), pad_token_id=2)
    assert len(in_process.started) == 1


def test_the_running_engines_own_limit_is_checked_and_the_engine_closed(tiny_model_dir, in_process):
    """The KV cache SGLang sizes from mem_fraction may hold fewer tokens than the context: its
    scheduler's limit is known only once it runs."""
    in_process.max_req_input_len = 1000
    with pytest.raises(ConfigError, match=r"^rollout.max_context_tokens \(1024\) is more than SGLang serves: it "
                                          r"refuses a prompt of 1000 tokens or more \(the engine's max_req_input_len"):
        build_engine(sglang_recipe(tiny_model_dir, "rollout.max_context_tokens=1024"), pad_token_id=2)
    assert len(in_process.started) == 1
    engine = build_engine(sglang_recipe(tiny_model_dir, "rollout.max_context_tokens=1000"), pad_token_id=2)
    assert not engine.closed


def test_a_cached_hub_id_reaches_sglang_as_the_snapshot_the_trainer_loads(tiny_model_dir, in_process, tmp_path,
                                                                          monkeypatch):
    """SGLang was handed the hub id and fetched it itself: offline it waited out the hub's retries, online
    it could load a newer revision than the cached one the trainer loads (`local_first`)."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--fake--tiny" / "snapshots" / ("c0ffee" * 6 + "0000")
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    # The names not cached go to the hub: offline, it says so at once (it retried a refused connection for 24 s).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local fake/ directory
    build_engine(sglang_recipe("fake/tiny", "rollout.max_context_tokens=1024"), pad_token_id=2)
    build_engine(sglang_recipe("nobody/not-cached", "rollout.max_context_tokens=1024"), pad_token_id=2)
    # Loading the tokenizer caches its files and config.json only: SGLang still has the weights to fetch.
    partial = tmp_path / "hub" / "models--fake--partial" / "snapshots" / snapshot.name
    partial.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(snapshot / name, partial / name)
    (partial.parents[1] / "refs").mkdir()
    (partial.parents[1] / "refs" / "main").write_text(snapshot.name)
    build_engine(sglang_recipe("fake/partial", "rollout.max_context_tokens=1024"), pad_token_id=2)
    assert [args["model_path"] for args in in_process.started] == [str(snapshot), "nobody/not-cached", "fake/partial"]


def test_a_given_server_is_held_to_the_limit_it_reports(tiny_model_dir, server, monkeypatch):
    closed: list[bool] = []
    monkeypatch.setattr(SGLangServerEngine, "close", lambda self: closed.append(True))
    recipe = partial(sglang_recipe, tiny_model_dir, "engine.sglang.mode=server",
                     "engine.sglang.url=http://gpu-host:30000")
    server.info["max_req_input_len"] = 1500
    with pytest.raises(ConfigError, match="^" + re.escape(
            "rollout.max_context_tokens (2048) is more than SGLang serves: it refuses a prompt of 1500 tokens or "
            "more (the engine's max_req_input_len: the smaller of its context length and its KV-cache tokens (the "
            "server's at engine.sglang.url 'http://gpu-host:30000'), less 6), and an episode's prompt reaches "
            "rollout.max_context_tokens - 1; set rollout.max_context_tokens to 1500 or less") + "$"):
        build_engine(recipe(), pad_token_id=2)
    assert closed == [True]
    server.info["max_req_input_len"] = 4000  # started with a longer context: its number, not the model's, counts
    engine = build_engine(recipe(), pad_token_id=2)
    assert engine.max_req_input_len == 4000 and closed == [True]
    assert [p for _, p, _ in server.requests] == ["/health_generate", "/server_info"] * 2


def test_the_engines_read_the_limit_where_sglang_keeps_it():
    """/server_info holds the scheduler's init info (max_req_input_len) and the ServerArgs fields; the
    in-process Engine gives its tokenizer manager the same max_req_input_len."""
    http = sglang_source("entrypoints/http_server.py")
    assert re.search(r'@app\.get\("/server_info"\)\s*async def server_info\(\):', http)
    assert "**dataclasses.asdict(server_args),\n            **_global_state.scheduler_info," in http
    assert '"max_req_input_len": self.max_req_input_len,' in sglang_source("managers/scheduler.py")
    assert "tokenizer_manager.max_req_input_len = scheduler_init_result.scheduler_infos[" in \
        sglang_source("entrypoints/engine.py")
    server_args = sglang_source("server_args.py")
    for field in ("enable_memory_saver", "device", "tp_size"):
        assert re.search(rf"^    {field}: ", server_args, re.M), field


# --- memory ---------------------------------------------------------------------------------------

def test_a_server_without_the_memory_saver_gets_one_warning_at_the_first_release(server, capsys):
    """SGLang without --enable-memory-saver answers a release with 200 and frees nothing: the run
    went on as if the GPU were shared."""
    server.info["enable_memory_saver"] = False
    engine = SGLangServerEngine("http://127.0.0.1:1", {})
    assert capsys.readouterr().err == ""  # a rollout or a served model never releases: nothing to say
    for _ in range(2):
        engine.release_memory()
        engine.resume_memory()
    assert capsys.readouterr().err == SERVER_WARNING.format(url="http://127.0.0.1:1")
    assert [p for _, p, _ in server.requests].count("/release_memory_occupation") == 2  # still asked: harmless


@pytest.mark.parametrize("info", [{"enable_memory_saver": True}, {"enable_memory_saver": False, "device": "cpu"}])
def test_a_server_that_can_release_or_has_no_gpu_gets_no_warning(server, capsys, info):
    server.info.update(info)
    engine = SGLangServerEngine("http://127.0.0.1:1", {})
    engine.release_memory()
    assert capsys.readouterr().err == ""


def test_a_server_without_server_info_is_named_and_its_checks_skipped(monkeypatch, capsys):
    def router(request: httpx.Request) -> httpx.Response:  # a router in front of servers: no /server_info
        return httpx.Response(404 if request.url.path == "/server_info" else 200, text="Not Found")

    monkeypatch.setattr(sglang_server.httpx, "Client", partial(httpx.Client, transport=httpx.MockTransport(router)))
    engine = SGLangServerEngine("http://router:8000", {})
    assert engine.max_req_input_len is None and engine.server_info == {}
    assert capsys.readouterr().err == ("agentrl: warning: SGLang server at http://router:8000: GET /server_info failed "
                                       "(SGLang server at http://router:8000: GET /server_info failed (HTTP 404: Not "
                                       "Found)); the checks of its prompt limit and memory saver are skipped\n")


def test_the_in_process_engine_empties_torchs_cache_before_sglang_resumes(monkeypatch):
    """The trainer's freed tensors stayed in PyTorch's cache while SGLang mapped its regions again."""
    calls: list = []

    class Engine:
        def resume_memory_occupation(self, tags):
            calls.append(("resume", tags))

    engine = SGLangEngine.__new__(SGLangEngine)  # no sglang here: only what resume_memory uses
    engine._engine, engine._regions = Engine(), ReleasedRegions()
    engine._regions.released.update(["weights", "kv_cache", "cuda_graph"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache",))
    engine.resume_memory(("kv_cache",))  # nothing left to resume: nothing called
    assert calls == ["empty_cache", ("resume", ["weights"]), "empty_cache", ("resume", ["kv_cache", "cuda_graph"])]


@pytest.mark.parametrize("url, empties", [("http://127.0.0.1:1", True), ("http://gpu-host:30000", False)])
def test_the_server_engine_empties_torchs_cache_before_a_loopback_server_resumes(server, monkeypatch, url, empties):
    engine = SGLangServerEngine(url, {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: server.requests.append(("-", "empty_cache", {})))
    engine.release_memory()
    engine.resume_memory()
    assert [p for _, p, _ in server.requests][-2:] == (
        ["empty_cache", "/resume_memory_occupation"] if empties else ["/release_memory_occupation",
                                                                      "/resume_memory_occupation"])


# --- weights over HTTP, tensor-parallel -----------------------------------------------------------

class OnGPU(torch.Tensor):
    """A CPU tensor that says it is on CUDA: enough for the engine to send it by handle."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_handles_are_pickled_once_per_rank(server, monkeypatch):
    """SGLang's ranks each read their own payload; one payload repeated for every rank had each
    rank open the same CUDA IPC handles, which upsets the sender's reference counting."""
    pickled: list[tuple[list[str], bool]] = []

    def serialize(bucket, by_handle):
        pickled.append(([name for name, _ in bucket], by_handle))
        return f"payload-{len(pickled)}"

    monkeypatch.setattr(sglang_server, "serialize_bucket", serialize)
    engine = SGLangServerEngine("http://127.0.0.1:1", {"tp_size": 2}, update_bucket_bytes=32)
    weights = [(name, torch.ones(4).as_subclass(OnGPU)) for name in ("a", "b", "c")]  # 16 bytes each
    engine.update_weights(iter(weights), version=1, flush_cache=False)
    bodies = [body for _, path, body in server.requests if path == "/update_weights_from_tensor"]
    assert [b["serialized_named_tensors"] for b in bodies] == [["payload-1", "payload-2"], ["payload-3", "payload-4"]]
    assert pickled == [(["a", "b"], True)] * 2 + [(["c"], True)] * 2  # buckets of 32 bytes: handles are small


def test_a_handle_names_its_gpu_by_uuid_so_a_server_that_numbers_gpus_otherwise_opens_the_same_one(monkeypatch):
    """torch's handle holds the sender's index of the device: device 0 here is device 1 in a server
    started with CUDA_VISIBLE_DEVICES=1,0. CUDA cannot run here, so torch's reduction of a CUDA
    tensor is replaced by one that answers as it does (rebuild_cuda_tensor and its arguments)."""
    from torch.multiprocessing import reductions

    def reduce_cuda(tensor):
        return reductions.rebuild_cuda_tensor, (torch.Tensor, (4,), (1,), 0, torch.float32, None, 0, b"handle", 16, 0)

    from multiprocessing.reduction import ForkingPickler

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_cuda)
    for kind in (torch.Tensor, torch.nn.Parameter):  # where torch registered its reduction for pickles
        monkeypatch.setitem(ForkingPickler._extra_reducers, kind, reduce_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid=f"5c1f0a2e-uuid-of-{device}"))
    rebuilt = []

    class Receiver(pickle.Unpickler):  # SGLang's scheduler rebuilds each tensor from these arguments
        def find_class(self, module, name):
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return lambda *args: rebuilt.append(args) or name
            return super().find_class(module, name)

    payload = sglang_server.serialize_bucket([("a", torch.ones(4)), ("b", torch.nn.Parameter(torch.ones(4)))],
                                             by_handle=True)
    assert Receiver(io.BytesIO(base64.b64decode(payload))).load() == [("a", "rebuild_cuda_tensor"),
                                                                      ("b", "rebuild_cuda_tensor")]
    assert [args[6] for args in rebuilt] == ["5c1f0a2e-uuid-of-0"] * 2
    assert [args[7] for args in rebuilt] == [b"handle"] * 2  # the rest as torch gave it


def test_sglang_maps_a_handles_gpu_uuid_to_its_own_device():
    """SGLang's rank patches torch's rebuild before it reads its payload; the patched rebuild takes
    the device at the same place, as an index or a UUID."""
    worker = sglang_source("managers/tp_worker.py")
    assert re.search(r"monkey_patch_torch_reductions\(\)\s*return MultiprocessingSerializer\.deserialize\(", worker)
    patch = sglang_source("utils/patch_torch.py")
    assert "_REDUCE_TENSOR_ARG_DEVICE_INDEX = 6" in patch
    assert "args = _modify_tuple(args, _REDUCE_TENSOR_ARG_DEVICE_INDEX, _device_from_maybe_uuid)" in patch
    assert "if str(torch.cuda.get_device_properties(device).uuid) == device_maybe_uuid:" in patch


def test_by_value_a_request_carries_at_most_update_bucket_bytes_for_all_ranks(server):
    """By value the body holds the bucket's bytes once per rank: with tp_size 4 a 64-byte bucket
    made a request of 256 bytes of tensors."""
    engine = SGLangServerEngine("http://gpu-host:30000", {"tp_size": 4}, update_bucket_bytes=64)
    weights = [(name, torch.full((4,), float(i))) for i, name in enumerate("abcd")]  # 16 bytes each
    engine.update_weights(iter(weights), version=1, flush_cache=False)
    bodies = [body for _, path, body in server.requests if path == "/update_weights_from_tensor"]
    received = []
    for body in bodies:
        payloads = body["serialized_named_tensors"]
        assert len(payloads) == 4 and len(set(payloads)) == 1
        tensors = pickle.load(io.BytesIO(base64.b64decode(payloads[0])))
        assert 4 * sum(t.nbytes for _, t in tensors) <= 64
        received += [(name, t.tolist()) for name, t in tensors]
    assert received == [(name, [float(i)] * 4) for i, name in enumerate("abcd")]


def test_a_given_servers_own_tensor_parallel_size_decides_the_payloads_per_request(server):
    """The recipe's engine.sglang.tp_size (1 by default) says nothing of a server started apart: a
    tp 2 server's rank 1 found no payload of its own and the scheduler stopped the server."""
    server.info["tp_size"] = 2
    engine = SGLangServerEngine("http://gpu-host:30000", {"tp_size": 1}, update_bucket_bytes=64)
    assert engine.tp_size == 2
    engine.update_weights(iter([("a", torch.ones(4)), ("b", torch.zeros(4))]), version=1, flush_cache=False)
    bodies = [body for _, path, body in server.requests if path == "/update_weights_from_tensor"]
    assert [len(body["serialized_named_tensors"]) for body in bodies] == [2]  # 2 × 32 bytes fit in 64


def test_one_given_server_for_several_replicas_is_a_recipe_error(tiny_model_dir):
    with pytest.raises(ConfigError, match=re.escape(
            "engine.sglang.url gives one SGLang server, and each of the trainer.engine_replicas (2) replicas would "
            "release, resume and update it on its own: SGLang stops at the second resume; set "
            "trainer.engine_replicas to 1, or leave engine.sglang.url unset to launch a server for each replica")):
        load_recipe(None, [f"model.path={tiny_model_dir}", "engine.name=sglang", "engine.sglang.mode=server",
                           "engine.sglang.url=http://gpu-host:30000", "trainer.backend=ray", "trainer.world_size=2",
                           "trainer.engine_replicas=2"], for_training=True)
    launched = load_recipe(None, [f"model.path={tiny_model_dir}", "engine.name=sglang", "engine.sglang.mode=server",
                                  "trainer.backend=ray", "trainer.world_size=2", "trainer.engine_replicas=2"],
                           for_training=True)  # a server launched for each replica
    assert launched.trainer.engine_replicas == 2


def test_sglang_reads_one_payload_per_rank():
    worker = sglang_source("managers/tp_worker.py")
    assert "serialized_named_tensors[self.ps.tp_rank]" in worker
    assert re.search(r"MultiprocessingSerializer\.serialize\(tensors\)\s*for _ in range\(self\.server_args\.tp_size\)",
                     sglang_source("entrypoints/engine.py"))


# --- a CPU where SGLang computes with its AMX kernels -----------------------------------------------

FLOAT32_ON_AMX = ("model.dtype 'float32': SGLang on this CPU (it has AMX) computes with its AMX kernels, which take "
                  "bfloat16 only (its scheduler stops at the first float32 forward pass); set model.dtype to "
                  "bfloat16 or auto, or use engine.name hf")
TRAINING_ON_AMX = ("engine.name 'sglang' on this CPU (it has AMX): SGLang packs its weights for its AMX kernels when "
                   "it loads the model, and its weight updates do not pack them again (an engine updated with its "
                   "own weights answered garbage), so a training run cannot sync its weights to it; train with "
                   "engine.name hf, or with SGLang on a GPU")


def amx(monkeypatch, present: bool) -> None:
    monkeypatch.setattr(sglang_engine, "sglang_uses_amx", lambda: present)


@pytest.mark.parametrize("command", ["train", "eval", "rollout", "serve"])
def test_a_float32_sglang_engine_on_a_cpu_with_amx_stops_at_the_recipe(tiny_model_dir, monkeypatch, command):
    """On such a CPU the scheduler died with '"rmsnorm_kernel" not implemented for 'Float'', after
    the trainer's model had loaded."""
    amx(monkeypatch, True)
    args = ["recipes/quickstart.yaml", f"model.path={tiny_model_dir}", "engine.name=sglang", "model.dtype=float32"]
    with pytest.raises(ConfigError, match="^" + re.escape(f"override 'model.dtype=float32': {FLOAT32_ON_AMX}") + "$"):
        load_recipe(args[0], args[1:], for_training=command == "train", devices=cli.DEVICE_KEYS[command])
    given = load_recipe(args[0], args[1:] + ["engine.sglang.mode=server", "engine.sglang.url=http://127.0.0.1:1"],
                        for_training=command == "train", devices=cli.DEVICE_KEYS[command])
    assert given.model.dtype == "float32"  # a given server runs as it was started
    amx(monkeypatch, False)
    assert load_recipe(args[0], args[1:], devices=cli.DEVICE_KEYS[command]).model.dtype == "float32"


def test_training_with_sglang_on_a_cpu_with_amx_stops_at_the_recipe_and_rollouts_run(tiny_model_dir, monkeypatch):
    amx(monkeypatch, True)
    args = [f"model.path={tiny_model_dir}", "engine.name=sglang", "model.dtype=bfloat16"]
    for mode in ("in_process", "server"):  # a server the run launches is on this CPU too
        with pytest.raises(ConfigError, match="^" + re.escape(f"override 'engine.name=sglang': {TRAINING_ON_AMX}") + "$"):
            load_recipe("recipes/quickstart.yaml", args + [f"engine.sglang.mode={mode}"], for_training=True,
                        devices=cli.DEVICE_KEYS["train"])
    for command in ("eval", "rollout", "serve"):
        assert load_recipe("recipes/quickstart.yaml", args, devices=cli.DEVICE_KEYS[command]).engine.name == "sglang"
    with pytest.raises(ConfigError, match="^" + re.escape(TRAINING_ON_AMX) + "$"):  # train() from Python too
        train(load_recipe("recipes/quickstart.yaml", args, for_training=True))
    on_gpu = load_recipe("recipes/quickstart.yaml", args + ["engine.device=cuda", "model.dtype=float32"])
    sglang_engine.check_cpu_engine(on_gpu, training=True)  # the AMX kernels are the CPU's only
    amx(monkeypatch, False)
    assert load_recipe("recipes/quickstart.yaml", args, for_training=True,
                       devices=cli.DEVICE_KEYS["train"]).engine.name == "sglang"


def test_a_given_server_is_not_held_to_this_cpus_amx(tiny_model_dir, server, monkeypatch):
    """A server given by URL runs in the dtype it was started with, wherever it is."""
    amx(monkeypatch, True)
    engine = build_engine(sglang_recipe(tiny_model_dir, "engine.sglang.mode=server", "model.dtype=float32",
                                        "engine.sglang.url=http://gpu-host:30000"), pad_token_id=2)
    assert engine.url == "http://gpu-host:30000"


def test_an_extra_args_dtype_sglang_cannot_run_here_stops_before_it_starts(tiny_model_dir, in_process, monkeypatch):
    amx(monkeypatch, True)
    with pytest.raises(ConfigError, match=r"^engine.sglang.extra_args.dtype 'float32': SGLang on this CPU \(it has "
                                          r"AMX\) computes with its AMX kernels, which take bfloat16 only$"):
        build_engine(sglang_recipe(tiny_model_dir, "engine.sglang.extra_args={dtype: float32}",
                                   "rollout.max_context_tokens=1024"), pad_token_id=2)
    assert in_process.started == []


def test_sglang_uses_amx_as_sglang_decides_it(monkeypatch):
    """SGLang's own check: a CPU with AMX and sgl_kernel's CPU build, the one with the weight-packing
    op (a GPU machine's CUDA build has not, and its CPU may have AMX)."""
    def uses(has_amx: bool, build: str | None) -> bool:
        monkeypatch.setattr(sglang_engine, "cpu_bf16_support", lambda: {"amx": has_amx, "avx512_bf16": True})
        monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if build is None else object())
        if build is not None:
            monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
        return sglang_engine.sglang_uses_amx()

    assert (uses(True, None), uses(True, "cuda")) == (False, False)
    library = torch.library.Library("sgl_kernel", "DEF")  # what the CPU build registers
    library.define("convert_weight_packed(Tensor weight) -> Tensor")
    try:
        assert (uses(False, "cpu"), uses(True, "cpu")) == (False, True)
    finally:
        library._destroy()


def test_auto_is_bfloat16_for_sglang_on_a_cpu_with_amx_and_probed_elsewhere(tiny_model_dir, in_process, monkeypatch):
    probed = []
    monkeypatch.setattr(sglang_engine, "choose_dtype",
                        lambda dtype, device: probed.append(dtype) or types.SimpleNamespace(dtype="float32"))
    amx(monkeypatch, True)
    build_engine(sglang_recipe(tiny_model_dir, "model.dtype=auto", "rollout.max_context_tokens=1024"), pad_token_id=2)
    build_engine(sglang_recipe(tiny_model_dir, "model.dtype=bfloat16", "rollout.max_context_tokens=1024"),
                 pad_token_id=2)
    assert [args["dtype"] for args in in_process.started] == ["bfloat16", "bfloat16"] and probed == []
    amx(monkeypatch, False)
    build_engine(sglang_recipe(tiny_model_dir, "model.dtype=auto", "rollout.max_context_tokens=1024"), pad_token_id=2)
    build_engine(sglang_recipe(tiny_model_dir, "model.dtype=float32", "rollout.max_context_tokens=1024"),
                 pad_token_id=2)
    assert [args["dtype"] for args in in_process.started[2:]] == ["float32", "float32"]
    assert probed == ["auto", "float32"]


def test_sglangs_cpu_rmsnorm_takes_its_amx_kernel_whatever_the_dtype():
    """What engine_dtype stands on: with AMX, forward_cpu calls sgl_kernel's rmsnorm_cpu, with no
    check of the input's dtype (and that kernel is built for bfloat16 and float16 only)."""
    layernorm = sglang_source("layers/layernorm.py")
    assert "_is_cpu_amx_available = cpu_has_amx_support()" in layernorm
    forward_cpu = layernorm.split("    def forward_cpu(", 1)[1].split("    def forward_", 1)[0]
    assert re.search(r"if _is_cpu_amx_available:\n(.*\n)*?\s+return torch\.ops\.sgl_kernel\.rmsnorm_cpu\(", forward_cpu)
    assert "dtype" not in forward_cpu.split("else:", 1)[0]


# --- a failing scheduler ------------------------------------------------------------------------

class RecordingSGLang:
    """sglang.Engine's stand-in: keeps the keywords it was started with."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.tokenizer_manager = None

    def shutdown(self):
        pass


def test_a_failing_scheduler_ends_the_run_as_a_signal_does_naming_sglang(monkeypatch, capsys):
    """SGLang's child processes send their parent SIGQUIT when they fail, and SGLang's own handler then
    SIGKILLs the parent: a training run vanished without a line. The in-process engine hands SGLang a
    handler that raises as Ctrl-C does (tests/real_sglang/test_sglang_failure.py crashes a real
    scheduler), and the CLI says what sent the signal."""
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=RecordingSGLang))
    engine = SGLangEngine({"model_path": "m", "device": "cuda"})
    handler = engine._engine.kwargs["custom_sigquit_handler"]
    engine.close()
    assert handler is sglang_engine.scheduler_failed  # module level: ServerArgs is pickled for the scheduler
    assert pickle.loads(pickle.dumps(handler)) is handler
    with pytest.raises(KeyboardInterrupt) as raised:  # what no episode's `except Exception` takes for its own
        handler(signal.SIGQUIT, None)
    assert raised.value.signum == signal.SIGQUIT

    def signalled(args):
        handler(signal.SIGQUIT, None)

    monkeypatch.setattr(cli, "_allocator", signalled)  # the signal arrives once the command runs
    assert cli.main(["rollout", "recipes/rollout_cpu.yaml"]) == 128 + signal.SIGQUIT
    assert capsys.readouterr().err.splitlines()[-1] == (
        "agentrl: terminated by SIGQUIT: SGLang's scheduler processes send it when one of them fails; "
        "the log above says why")


def test_sglang_calls_the_handler_it_is_given_for_sigquit():
    engine = sglang_source("entrypoints/engine.py")
    assert "signal.signal(signal.SIGQUIT, server_args.custom_sigquit_handler)" in engine
    assert re.search(r"def launch_phase_sigquit_handler\(signum, frame\):.*?kill_process_tree\(os\.getpid\(\)\)",
                     engine, re.S)  # the default it replaces
    assert "parent_process.send_signal(signal.SIGQUIT)" in sglang_source("managers/scheduler.py")


class StandInSGLang(JSONHandler):
    """A stand-in for SGLang's HTTP server (a real one cannot start in this test's time): its
    health and server info as SGLang answers them, and a /flush_cache that answers 503. Real HTTP
    on loopback, so that httpx's own routing (proxies, credentials) is what is tested."""

    def do_GET(self) -> None:
        self.reply(200, SERVER_INFO if self.path == "/server_info" else {})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.reply(503 if self.path.split("?")[0] == "/flush_cache" else 200, {"detail": "busy"})


def test_a_loopback_server_is_reached_past_the_environments_proxy_and_its_credentials_are_not_shown(monkeypatch):
    """HTTP_PROXY with NO_PROXY=localhost (127.0.0.1 is not 'localhost' to httpx) sent every
    request to the proxy: a healthy server was never reached. And a URL's password was printed in
    every error."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandInSGLang)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    dead_proxy = f"http://127.0.0.1:{free_port()}"  # nothing listens: a request sent there fails
    for key in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(key, dead_proxy)
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(key, "localhost")
    port = httpd.server_address[1]
    try:
        engine = SGLangServerEngine(f"http://trainer:s3cr3t@127.0.0.1:{port}", {})  # health and info: reached
        with pytest.raises(RuntimeError) as failed:
            engine.flush_cache()
        engine.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert str(failed.value).startswith(f"SGLang server at http://127.0.0.1:{port}: POST /flush_cache failed (HTTP 503")
    assert "s3cr3t" not in str(failed.value)


FAKE_LAUNCH_SERVER = """\
import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


ThreadingHTTPServer((args.host, args.port), Healthy).serve_forever()
"""


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaps, as a container's init may leave one, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launched_server_stops_when_its_launcher_is_killed(tmp_path):
    """The server runs in a session of its own, and only the launcher's exit code stopped it: a
    trainer killed by the OOM killer, or a rollout actor by ray.kill, left it holding its GPU and
    port. Here `python -m sglang.launch_server` is a stand-in HTTP server on loopback (SGLang
    cannot run here); the launcher, the pipe and the signals are real."""
    import os
    import subprocess
    import time

    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    launcher = ("import os, signal\n"
                "from agentrl.rollout.sglang_launch import launch_server\n"
                "process, url, log = launch_server({'model_path': 'm'}, timeout_s=60)\n"
                "print(process.pid, flush=True)\n"
                "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    server = int(done.stdout.split()[0])
    try:
        deadline = time.monotonic() + 15
        while running(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(server)
    finally:
        if running(server):
            os.killpg(server, signal.SIGKILL)
