"""Shared fixtures: the real SmolLM2 tokenizer with the Hermes template, and a tiny random Llama.

The tiny model has SmolLM2's vocabulary so every token id in a test is a real one.
"""

from __future__ import annotations

import json
import socket
import subprocess
from http.server import BaseHTTPRequestHandler

from tests import loopback_guard  # first: libraries imported below read the environment it sets

import pytest  # noqa: E402
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.models import load_tokenizer, provision_builtin
from agentrl.types import Completion, SamplingParams


@pytest.fixture(autouse=True)
def loopback_only():
    """Fails a test that resolved or connected beyond loopback (tests/loopback_guard.py)."""
    attempts = loopback_guard.BEYOND_LOOPBACK
    before = len(attempts)
    yield
    assert not attempts[before:], f"the test reached beyond loopback: {attempts[before:]}"


@pytest.fixture
def agentrl_in_process(monkeypatch, capsys):
    """`agentrl ARGS...` run in this process, for a command that must stop before any model loads:
    (exit status, last line of stderr), the whole of stderr in `.stderr`. A model that loads fails
    the test; the signal handlers the command sets for itself are put back. A subprocess would
    spend seconds importing torch first."""
    import signal

    import agentrl.models
    import agentrl.rollout.run
    import agentrl.trainer.roles
    from agentrl.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for module in (agentrl.models, agentrl.rollout.run, agentrl.trainer.roles):
        monkeypatch.setattr(module, "load_model", no_loading)

    def run(*args: str) -> tuple[int, str]:
        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
        try:
            status = main(list(args))
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            run.stderr = capsys.readouterr().err
        lines = run.stderr.strip().splitlines()
        return status, lines[-1] if lines else ""

    return run


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct", chat_template="hermes")


def make_tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_model():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A saved tiny model with the SmolLM2 tokenizer and the Hermes template, as a user would have."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    return provision_builtin("smollm2-135m-instruct")


class ScriptedEngine:
    """Replays fixed assistant turns through the Engine protocol.

    It stands in for the policy only where a test needs a specific tool call or answer that a small
    model would not sample; everything around it (tokenizer, template, tools, loop) is real.
    Logprobs are -0.01 * (position + 1) so a test can check their alignment exactly.
    """

    def __init__(self, tokenizer, turns: list[str], stop: bool = True):
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([2] if stop else []) for t in turns]
        self.prompts: list[list[int]] = []
        self.seeds: list[int | None] = []  # each request's SamplingParams.seed
        self.weight_version = 0

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        self.prompts.append(list(token_ids))
        self.seeds.append(sampling.seed)
        ids = self.turns[len(self.prompts) - 1][: sampling.max_new_tokens]
        finish = "stop" if ids and ids[-1] in sampling.stop_token_ids else "length"
        return Completion(ids, [-0.01 * (i + 1) for i in range(len(ids))], finish, self.weight_version)

    def update_weights(self, named_tensors, version, flush_cache=True):
        self.weight_version = version

    def release_memory(self):
        return None

    def resume_memory(self, tags=None):
        return None


@pytest.fixture
def served(tokenizer):
    """A ChatService on a ScriptedEngine behind the real app on a loopback port."""
    from agentrl.serve.app import create_app
    from agentrl.serve.server import BackgroundServer
    from agentrl.serve.service import ChatService, ServeSettings
    from agentrl.tools.parsers import parse_hermes

    started = []

    def start(turns, max_body_bytes=1_000_000, engine=None):
        engine = engine or ScriptedEngine(tokenizer, turns)
        service = ChatService(engine, tokenizer, parse_hermes, ServeSettings(model_name="scripted"))
        server = BackgroundServer(create_app(service, max_body_bytes=max_body_bytes))
        server.start()
        started.append(server)
        return server, engine

    yield start
    for server in started:
        server.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen) -> None:
    """Terminate a server the test started and wait for it."""
    process.terminate()
    process.wait(10)


class JSONHandler(BaseHTTPRequestHandler):
    """A stand-in HTTP server's handler that answers JSON and logs nothing."""

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass
