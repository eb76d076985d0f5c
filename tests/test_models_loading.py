"""Loading a model's tokenizer and weights: a missing chat template is a one-line error before any
weights load, and a hub id already in the local cache loads without asking the hub.

The hub here is a recording server on 127.0.0.1 (HF_ENDPOINT) that answers 404 to everything, so
nothing leaves loopback and every request the loaders would make is counted. huggingface_hub reads
HF_HOME and HF_ENDPOINT when it is imported, so the loading runs in a fresh process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agentrl.errors import ConfigError
from agentrl.models import load_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def templateless_dir(tmp_path, tiny_model_dir):
    """The tiny model with a tokenizer that has no chat template, as a base model's has none."""
    path = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def no_template_error(path) -> str:
    return (f"model.chat_template: the tokenizer of '{path}' has no chat template; set model.chat_template to "
            "'hermes' (ChatML with tool calls) or a Jinja file")


def test_a_tokenizer_without_a_chat_template_is_a_config_error_unless_tools_choose_hermes(templateless_dir, capsys):
    assert load_tokenizer(str(templateless_dir), needs_template=False).chat_template is None  # decoding only
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(templateless_dir))
    assert str(err.value) == no_template_error(templateless_dir)
    assert "<tool_call>" in load_tokenizer(str(templateless_dir), "hermes").chat_template  # what the error says to set
    capsys.readouterr()
    # with tools, a model without a template gets the Hermes template, as one whose template ignores them
    assert "<tool_call>" in load_tokenizer(str(templateless_dir), needs_tools=True).chat_template
    assert capsys.readouterr().err == f"agentrl: {templateless_dir} has no chat template; using 'hermes'\n"


@pytest.mark.parametrize("command, overrides", [
    ("sft", ["sft.base_model={model}", "sft.output={tmp}/sft", "rollout.tool_configs=[]", "trainer.device=cpu"]),
    ("eval", ["model.path={model}", "output_dir={tmp}/eval", "engine.device=cpu", "eval.num_tasks=2",
              "rollout.tool_configs=[]"]),
])
def test_sft_and_eval_stop_with_one_line_before_any_model_loads(templateless_dir, tmp_path, agentrl_in_process,
                                                                  command, overrides):
    """SFT used to fail inside transformers with a traceback, and eval to fail every episode."""
    recipe = "recipes/quickstart.yaml" if command == "sft" else "recipes/rollout_cpu.yaml"
    args = [o.format(model=templateless_dir, tmp=tmp_path) for o in overrides]
    assert agentrl_in_process(command, recipe, *args) == (2, f"agentrl: error: {no_template_error(templateless_dir)}")


class RecordingHub(BaseHTTPRequestHandler):
    """A hub that has nothing (404) and remembers every request."""

    requests: list[str] = []

    def answer(self) -> None:
        type(self).requests.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub():
    RecordingHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordingHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", RecordingHub.requests
    server.shutdown()
    server.server_close()


@pytest.fixture
def hf_home(tmp_path, tiny_model_dir):
    """A Hugging Face cache holding the tiny model as the hub id 'fake/tiny', as a download leaves it."""
    home = tmp_path / "hf"
    repo = home / "hub" / "models--fake--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


LOAD = """
import json, sys
from agentrl.errors import ConfigError
from agentrl.models import load_model, load_tokenizer
results = {}
for name in sys.argv[1:]:
    try:
        results[name] = [type(load_tokenizer(name)).__name__, type(load_model(name)).__name__]
    except ConfigError as e:
        results[name] = str(e)
print(json.dumps(results))
"""


def test_a_cached_hub_id_loads_without_asking_the_hub_and_a_missing_one_still_asks(hf_home, hub, tmp_path):
    url, requests = hub
    (tmp_path / "runs").mkdir()
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_ENDPOINT": url}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])  # this checkout, from tmp_path
    done = subprocess.run([sys.executable, "-c", LOAD, "fake/tiny", "runs/final", "nobody/no-such-model"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert results["fake/tiny"][1] == "LlamaForCausalLM"
    assert not [r for r in requests if "fake/tiny" in r], requests  # it used to retry each for a minute offline
    # A mistyped path under a local directory is reported as one, without a hub lookup.
    assert results["runs/final"] == ("model 'runs/final': not a local model directory ('runs' holds no 'final') "
                                     "and not a builtin (smollm2-135m-instruct)")
    # A name that is neither local nor cached still goes to the hub, and the error names it.
    assert results["nobody/no-such-model"].startswith(
        "model 'nobody/no-such-model': not a local model directory, not a builtin (smollm2-135m-instruct) nor a hub "
        "id in the local cache, and downloading it from the hub failed (")
    assert not [r for r in requests if "runs/final" in r], requests
    assert [r for r in requests if "nobody/no-such-model" in r]
