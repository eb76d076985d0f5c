"""LoRA through peft: adapters on a causal LM, the merged weights an engine receives, and loading a
saved adapter for inference.

Only the adapters train (the base weights are frozen, so the backward pass computes no gradient for
them and the optimizer holds state for the adapters alone) and only they are checkpointed. Engines
know nothing of LoRA: every weight sync sends full tensors under the base model's names, with each
adapted layer merged as W + scaling · B·A (transposed for an embedding). The merge happens on the
gathered full tensors, so it is the same under FSDP. This module does not choose which layers to
adapt beyond peft's own options, but it refuses the input embeddings and the output head of a model
that ties them to one weight (SmolLM2 does): peft adapts only the module named, so the trainer would
run W + B·A in one place and W in the other while the engines, which tie the weight they receive,
run the merged one in both (and `ensure_weight_tying` ties the adapters but merges them twice).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from agentrl.errors import ConfigError
from agentrl.trainer.distributed import full_tensors
from agentrl.yaml_files import one_line

if TYPE_CHECKING:
    from agentrl.config import LoraSettings

_PEFT_PREFIX = "base_model.model."


@contextlib.contextmanager
def peft_wrapping():
    """peft (0.21) reads the model's `is_gradient_checkpointing`, which transformers 5.24 deprecated
    for `is_activation_checkpointing`: a FutureWarning per wrapped model that the user can do
    nothing about. Only that warning is silenced, only while peft wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def add_lora(model: torch.nn.Module, settings: "LoraSettings", base: str, seed: int = 0) -> torch.nn.Module:
    """The model wrapped with fresh LoRA adapters (B = 0, so it starts as the base model; A drawn
    from `seed`, the same on every rank and in every run of a recipe, whatever the process's own
    random state). `base` is what the model was loaded from (a directory, hub id or builtin name;
    itself possibly a saved adapter), recorded in the adapter's config so that loading the adapter
    rebuilds the same model."""
    from peft import LoraConfig, get_peft_model

    from agentrl.models import BUILTIN_MODELS, resolve_model

    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha if settings.alpha is not None else 2 * settings.rank,
                        lora_dropout=settings.dropout, target_modules=settings.target_modules, bias="none",
                        task_type="CAUSAL_LM")
    refuse_tied_targets(model, config)
    resolved = resolve_model(base)
    if base in BUILTIN_MODELS and not Path(base).is_dir():  # its name: the cache directory is this machine's
        recorded = base
    else:
        recorded = str(Path(resolved).resolve()) if Path(resolved).is_dir() else resolved
    # peft records the instance's `name_or_path` (transformers sets it at load, relative as given,
    # and merging a loaded adapter leaves the adapter's own base there), not the config's.
    model.config._name_or_path = model.name_or_path = recorded
    try:
        with torch.random.fork_rng(devices=[]), peft_wrapping():  # the caller's random state is left as it was
            torch.manual_seed(seed)
            return get_peft_model(model, config)
    except ValueError as e:  # peft's NoMatchingPeftModuleError, or a layer type it cannot adapt
        targets = settings.target_modules
        # peft reads one string (but 'all-linear') as a regex over a module's whole path: 'q_proj'
        # alone matches nothing, and the message did not say why.
        hint = (f"; one name is a regular expression over a module's whole path, so to adapt the modules "
                f"named {targets!r} give the list [{targets}]"
                if isinstance(targets, str) and targets != "all-linear" and any(
                    name.rsplit(".", 1)[-1] == targets for name, _ in model.named_modules()) else "")
        raise ConfigError(f"model.lora.target_modules: peft cannot adapt {targets!r} in this model "
                          f"({one_line(e)}){hint}") from None


def refuse_tied_targets(model: torch.nn.Module, config: Any) -> None:
    """A ConfigError when the LoRA `config` targets the input embeddings or the output head of a
    model that ties them to one weight (see the module docstring)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is not getattr(embedding, "weight", None):
        return
    tied = {name: module for name, module in model.named_modules() if module is embedding or module is head}
    for name in tied:
        if check_target_module_exists(config, name):
            other = next((n for n in tied if n != name), name)
            raise ConfigError(f"model.lora.target_modules: '{name}' shares its weight with '{other}' (the model ties "
                              "its input embeddings and output head); LoRA would adapt it in one of them only while "
                              "the engines run the merged weight in both, so leave both out")


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors named as the base model's state_dict, each LoRA layer merged into its weight.
    For a model without adapters, its own full tensors. Every rank must exhaust it (gathers)."""
    if not is_lora(model):
        yield from full_tensors(model)
        return
    from peft.tuners.lora import LoraLayer

    layers = {name.removeprefix(_PEFT_PREFIX): module for name, module in model.named_modules()
              if isinstance(module, LoraLayer)}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in full_tensors(model):
        name = name.removeprefix(_PEFT_PREFIX)
        owner = next((layer for layer in (name.split(".base_layer.")[0], name.split(".lora_")[0]) if layer in layers), None)
        if owner is None:
            yield name, tensor
            continue
        part = name[len(owner) + 1:]
        if part.startswith("base_layer.") and not part.endswith(".weight"):
            yield f"{owner}.{part.removeprefix('base_layer.')}", tensor  # the base layer's bias
            continue
        parts = pending.setdefault(owner, {})
        parts[_part_role(name, part)] = tensor
        if len(parts) == 3:
            yield f"{owner}.weight", _merge(layers[owner], pending.pop(owner))
    if pending:  # a weight never sent would leave the engines on stale values without a word
        missing = ", ".join(f"{owner} has only {sorted(parts)}" for owner, parts in pending.items())
        raise RuntimeError(f"LoRA merge incomplete: {missing}")


_PART_ROLES = {"base_layer.weight": "W", "lora_A.": "A", "lora_B.": "B",
               "lora_embedding_A.": "A", "lora_embedding_B.": "B"}  # peft's names in a linear / an embedding layer


def _part_role(name: str, part: str) -> str:
    role = next((role for prefix, role in _PART_ROLES.items() if part.startswith(prefix)), None)
    if role is None:
        raise RuntimeError(f"{name}: a LoRA tensor this weight sync cannot merge (only plain LoRA on linear and "
                           "embedding layers is supported)")
    return role


def _merge(layer: torch.nn.Module, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """W + scaling · B·A, as peft's merge: transposed for an embedding (A is rank × vocabulary)
    and for a layer storing its weight fan-in first."""
    from peft.tuners.lora import Embedding

    (adapter,) = layer.active_adapters
    delta = (parts["B"].float() @ parts["A"].float()) * layer.scaling[adapter]
    if isinstance(layer, Embedding) or getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return (parts["W"].float() + delta).to(parts["W"].dtype)


def load_merged(adapter_dir: str, base: str, dtype: str) -> torch.nn.Module:
    """A saved adapter applied to its base model and merged into it: a plain model for engines.
    The base may itself be a saved adapter (LoRA RL after LoRA SFT); it is merged first."""
    from peft import PeftModel

    from agentrl.models import load_model

    model = load_model(base, dtype)
    with peft_wrapping():
        return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
