"""Shared fixtures: the real SmolLM2 tokenizer with the Hermes template, and a tiny random Llama.

The tiny model has SmolLM2's vocabulary so every token id in a test is a real one.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess

# Tests talk to loopback only. Every process a test starts (the agentrl command, Ray's processes,
# Chromium) inherits these: an HTTP request to anywhere else goes to a loopback port where nothing
# listens and fails at once, without a DNS lookup. Ray's dashboard process asks the cloud metadata
# address (169.254.169.254) which cloud it runs on, usage statistics off or not.
NOWHERE = "http://127.0.0.1:9"
for _key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
    os.environ[_key] = os.environ[_key.lower()] = NOWHERE
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost,::1"

import pytest  # noqa: E402  (after the environment above, which some libraries read when imported)
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.models import load_tokenizer, provision_builtin
from agentrl.types import Completion, SamplingParams

BEYOND_LOOPBACK: list[str] = []  # what this process tried to resolve or reach elsewhere


def is_local(host: object) -> bool:
    """A loopback name or address, or none (a bind to every interface sends nothing)."""
    if host is None:
        return True
    host = (host.decode() if isinstance(host, bytes) else str(host)).strip("[]").split("%")[0]
    if host in ("", "localhost") or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    address = getattr(address, "ipv4_mapped", None) or address
    return address.is_loopback or address.is_unspecified


def _refuse(what: str) -> OSError:
    BEYOND_LOOPBACK.append(what)
    return OSError(f"tests reach loopback only, not {what}")


_getaddrinfo, _connect, _connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex


def _guarded_getaddrinfo(host, *args, **kwargs):
    if not is_local(host):
        raise _refuse(f"a lookup of {host!r}")
    return _getaddrinfo(host, *args, **kwargs)


def _destination(sock: socket.socket, address: object) -> str | None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple) and not is_local(address[0]):
        return f"a connection to {address[0]}:{address[1]}"
    return None


def _guarded_connect(self, address):
    where = _destination(self, address)
    if where:
        raise _refuse(where)
    return _connect(self, address)


def _guarded_connect_ex(self, address):
    where = _destination(self, address)
    if where:
        raise _refuse(where)
    return _connect_ex(self, address)


# In this process, a lookup or a connection beyond loopback fails before any packet is sent, and the
# test that tried fails too (below), even where a library swallows the error (a telemetry ping).
socket.getaddrinfo = _guarded_getaddrinfo
socket.socket.connect, socket.socket.connect_ex = _guarded_connect, _guarded_connect_ex


@pytest.fixture(autouse=True)
def loopback_only():
    before = len(BEYOND_LOOPBACK)
    yield
    assert not BEYOND_LOOPBACK[before:], f"the test reached beyond loopback: {BEYOND_LOOPBACK[before:]}"


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
