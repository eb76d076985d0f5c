"""Token log-probabilities of a batch of sequences, without the full-vocabulary logits in memory.

The decoder runs once over the padded batch; the output head and log-softmax then run only on the
positions whose next token is wanted (the trainable ones), in chunks of rows, each chunk under
activation checkpointing when gradients are needed. So at most one chunk × vocabulary of logits is
alive at a time, in the forward and in the backward pass (FACTS.md: the full 8×256×49152 logits are
a large part of an 8 GB peak).

Results are aligned with token positions: out[b, t] = log p(token t | tokens < t), 0 where not
wanted, exactly as Trajectory.logprobs stores the engine's values. What a model's `forward` does to
the head's logits after it (Granite's division, Cohere's scale, Gemma 2's soft cap) is done here
too (`logit_transform`); `check_logit_head` refuses a model whose forward does something else,
before any work, rather than train on logprobs of a distribution the engine does not sample.

A GRPO group's rows share their prompt; micro-batches come packed (packing.py), so that the
decoder runs that prompt once per packed row and a micro-batch in one call, whatever the number of
groups in it.
"""

from __future__ import annotations

import random
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.nn.modules.dropout import _DropoutNd
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel

from agentrl.errors import ConfigError
from agentrl.trainer.packing import PackedInputs, PackedRow, packed_inputs
from agentrl.trainer.segment_attention import KEYWORD, NAME


@dataclass
class PaddedBatch:
    ids_BT: torch.Tensor
    attention_BT: torch.Tensor
    mask_BT: torch.Tensor  # float, 1 on trainable tokens
    packed: PackedInputs | None = None  # the decoder's inputs when rows share packed rows (packing.py)

    @property
    def num_tokens(self) -> int:
        return int(self.mask_BT.sum().item())


def pad_sequences(sequences: list[list[int]], masks: list[list[int]], pad_id: int,
                  device: torch.device | str = "cpu") -> PaddedBatch:
    width = max(len(s) for s in sequences)
    ids_BT = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_BT = torch.zeros((len(sequences), width), dtype=torch.long)
    mask_BT = torch.zeros((len(sequences), width), dtype=torch.float)
    for row, (seq, mask) in enumerate(zip(sequences, masks)):  # right padding
        ids_BT[row, : len(seq)] = torch.tensor(seq)
        attention_BT[row, : len(seq)] = 1
        mask_BT[row, : len(mask)] = torch.tensor(mask, dtype=torch.float)
    mask_BT[:, 0] = 0.0  # the first token has no context to be predicted from
    return PaddedBatch(ids_BT.to(device), attention_BT.to(device), mask_BT.to(device))


def pad_values(rows: list[list[float]], width: int, device: torch.device | str) -> torch.Tensor:
    """Per-token float rows (logprobs, advantages, values) right-padded with 0 to `width`."""
    out = torch.zeros((len(rows), width), dtype=torch.float)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float)
    return out.to(device)


def disable_model_dropout(model: torch.nn.Module, rank: int = 0) -> None:
    """The checkpoint's own train-mode randomness off: nn.Dropout modules, and every float setting
    named for dropout (`dropout`, `attn_pdrop`, `layerdrop`, `drop_path_rate`, ...) or for an MoE
    router's jitter (`router_jitter_noise`, ...) on each module and on each config, which many
    architectures (OPT, GPTBigCode, Starcoder2, Bloom, Mixtral, ...) apply functionally in train mode.
    PPO's ratio compares the training pass with the old logprobs, taken without dropout like the
    engine's samples, and its value clip the critic's training pass with the old values, taken in
    eval mode; a dropout mask in the training pass moves either by chance and clips tokens at
    unchanged weights. LoRA's adapter dropout is a recipe setting (model.lora.dropout) and stays.
    A jitter setting is kept when zeroing it changes an eval-mode pass: PhiMoE's routes by it in
    eval mode too, so it is part of the model the engine and the reference run, not noise.
    A warning (on `rank` 0) names a model whose training passes still differ (see
    `check_train_mode_determinism`)."""
    holders: list[dict[str, Any]] = []  # the attribute dicts of modules and of their configs
    configs: list[PretrainedConfig] = []
    for name, module in model.named_modules():
        if _is_lora_dropout(name):
            continue
        if isinstance(module, _DropoutNd):
            module.p = 0.0
        holders.append(vars(module))
        if isinstance(getattr(module, "config", None), PretrainedConfig):
            configs.append(module.config)
    seen: set[int] = set()
    while configs:  # a forward that reads its config reads 0 too; sub-configs (text_config, ...) as well
        config = configs.pop()
        if id(config) not in seen:
            seen.add(id(config))
            holders.append(vars(config))
            configs += [sub for sub in vars(config).values() if isinstance(sub, PretrainedConfig)]
    for attributes in holders:
        _zero_settings(attributes, "drop")
    has_jitter = any(_named_setting(k, v, "jitter") for a in holders for k, v in a.items())
    before = _probe_passes(model, training=False, count=1) if has_jitter else None
    jitter = [(attributes, _zero_settings(attributes, "jitter")) for attributes in holders]
    if before is not None:
        after = _probe_passes(model, training=False, count=1)
        if after is not None and not torch.equal(before[0], after[0]):
            for attributes, changed in jitter:
                attributes.update(changed)
    check_train_mode_determinism(model, rank)


def _is_lora_dropout(name: str) -> bool:
    return ".lora_dropout." in f".{name}."


def _zero_settings(attributes: dict[str, Any], word: str) -> dict[str, float]:
    """Floats whose name holds `word` set to 0.0 (a bool or an int 0 is left alone); returns the
    values they had."""
    changed = {key: value for key, value in attributes.items() if _named_setting(key, value, word)}
    attributes.update(dict.fromkeys(changed, 0.0))
    return changed


def _named_setting(key: str, value: Any, word: str) -> bool:
    """A non-zero float setting whose name holds `word`, not one of LoRA's."""
    lowered = key.lower()
    return type(value) is float and value != 0.0 and word in lowered and not lowered.startswith("lora_")


def _probe_passes(model: torch.nn.Module, training: bool, count: int) -> list[torch.Tensor] | None:
    """The outputs of `count` forward passes of the same 8 tokens through `model`'s transformers
    model, in train or eval mode (LoRA's dropout, meant to be on, held off), without gradients, the
    random state and every module's mode left as they were; None for a model on the meta device
    or without a vocabulary size to pick tokens from."""
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if inner is None or any(p.device.type == "meta" for p in inner.parameters()):
        return None
    vocab = getattr(inner.config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        return None
    device = next(inner.parameters()).device
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    ids = (torch.arange(8, device=device) * 7 + 3).remainder(vocab).unsqueeze(0)
    modes = {module: module.training for module in model.modules()}
    model.train(training)
    for name, module in model.named_modules():
        if _is_lora_dropout(name):
            module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            return [inner(input_ids=ids, use_cache=False)[0] for _ in range(count)]
    finally:
        for module, training_before in modes.items():
            module.training = training_before


def check_train_mode_determinism(model: torch.nn.Module, rank: int = 0) -> bool:
    """Whether two train-mode forwards of a few tokens give the same output (`_probe_passes`);
    otherwise one warning on `rank` 0 naming the model type: some randomness that
    disable_model_dropout does not know of is on in training passes. A warning, not an error: a
    GPU kernel may be non-deterministic on its own."""
    passes = _probe_passes(model, training=True, count=2)
    if passes is None:
        return True
    first, second = passes
    same = torch.equal(first, second)
    if not same and rank == 0:
        model_type = next(m for m in model.modules() if isinstance(m, PreTrainedModel)).config.model_type
        print(f"agentrl: warning: two training-mode forward passes of the same tokens through this "
              f"{model_type!r} model differ (largest gap {(first - second).abs().max().item():.3g}): "
              "some dropout or other randomness is still on in training passes, so PPO/GRPO importance ratios "
              "(and the critic's value clip) will be noisy at unchanged weights", file=sys.stderr)
    return same


@contextmanager
def evaluation(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) for a pass without gradients, its mode restored after:
    old logprobs, reference logprobs and values must be those of the weights, not of a dropout mask."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def mini_batch_schedule(rng: random.Random, size: int, epochs: int, mini_batches: int) -> Iterator[list[int]]:
    """Indices of each optimizer step: every epoch reshuffles, then deals into `mini_batches` parts.
    An empty part (fewer rows than parts, e.g. after failed episodes were left out) is no step."""
    order = list(range(size))
    for _ in range(epochs):
        rng.shuffle(order)
        for part in (order[i::mini_batches] for i in range(mini_batches)):
            if part:
                yield part


def padded_micro_batches(plan: list[list[PackedRow]], sequences: list[list[int]], masks: list[list[int]],
                         pad_id: int, device: torch.device | str) -> Iterator[tuple[list[int], PaddedBatch]]:
    """Each planned micro-batch (packing.plan_micro_batches) padded: (its row indices, the batch),
    with the packed layout where a packed row holds several rows. An empty entry of the plan (a rank
    with fewer micro-batches than another, see distributed.Ranks) yields ([], a two-token dummy with
    one position to predict), which the caller weighs by zero; it keeps FSDP's collectives in step."""
    for micro_batch in plan:
        if not micro_batch:
            yield [], pad_sequences([[pad_id, pad_id]], [[0, 1]], pad_id, device)
            continue
        idx = [i for packed in micro_batch for i in packed.rows]
        batch = pad_sequences([sequences[i] for i in idx], [masks[i] for i in idx], pad_id, device)
        if any(len(packed.rows) > 1 for packed in micro_batch):
            batch.packed = packed_inputs(micro_batch, sequences, pad_id, device)
        yield idx, batch


def logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What transformers' models do to the output head's logits in `forward`, from their config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scaling = getattr(config, "logits_scaling", None)  # Granite divides
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 soft-caps

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scaling is not None:
            logits = logits / scaling
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def check_logit_head(model: torch.nn.Module, label: str) -> None:
    """ConfigError naming `label` (model.path) unless the model's `forward` logits are its decoder's
    hidden states through its output head and `logit_transform`, on a short input (eval mode: the
    same dropout-free pass twice)."""
    training, device = model.training, next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            ids_1T = torch.tensor([[1, 2, 3, 4]], device=device)
            forward_TV = model(input_ids=ids_1T).logits[0].float()
            hidden_TH = model.get_decoder()(input_ids=ids_1T).last_hidden_state[0]
            ours_TV = logit_transform(model.config)(model.get_output_embeddings()(hidden_TH)).float()
    finally:
        model.train(training)
    gap = (forward_TV - ours_TV).abs().max().item()
    if not gap <= 1e-3 * max(1.0, forward_TV.abs().max().item()):
        raise ConfigError(f"{label}: {type(model).__name__}'s forward changes the logits after its output head in "
                          f"a way the trainer does not reproduce (largest difference {gap:.3g}); its logprobs "
                          "would not be those of the distribution the engine samples")


def _head_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden_NH: torch.Tensor, targets_N: torch.Tensor,
                   temperature: float, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits_NV = head(hidden_NH)
    if temperature > 0 and temperature != 1:  # x / 1 is x: no pass over N x V for it
        logits_NV = logits_NV.float() / temperature
    logp_NV = torch.log_softmax(logits_NV, dim=-1, dtype=torch.float32)
    logp_N = logp_NV.gather(1, targets_N[:, None]).squeeze(1)
    # Last, and without a graph unless a loss term needs its gradient: the backward pass's
    # recomputation of this chunk then stops at the gather (checkpoint's early stop).
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy_N = -(logp_NV.exp() * logp_NV).sum(dim=-1)
    return logp_N, entropy_N


SHARDED_METHOD = "agentrl_token_logprobs"


def token_logprobs(model: torch.nn.Module, batch: PaddedBatch, temperature: float = 1.0,
                   chunk_rows: int = 512, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, entropy_BT) on the batch's mask-1 positions, zeros elsewhere.

    `temperature` must be the sampling temperature, so these match the engine's logprobs.
    Gradients flow when grad mode is on, into the entropy only with `entropy_grad` (a loss with an
    entropy term); otherwise it is a detached figure to report. This path calls the decoder and the output head
    separately, bypassing the model's `forward`; an FSDP2-sharded model carries it as a registered
    forward method instead (`attach_token_logprobs`), so that its root parameters (embeddings, head)
    are gathered and their gradients reduced.
    """
    method = getattr(model, SHARDED_METHOD, None)
    if method is not None:
        return method(batch, temperature, chunk_rows, entropy_grad)
    return compute_token_logprobs(model, batch, temperature, chunk_rows, entropy_grad)


def attach_token_logprobs(model: torch.nn.Module) -> str:
    """Give the model this computation as a method (to register with FSDP2); returns its name."""
    setattr(model, SHARDED_METHOD, types.MethodType(compute_token_logprobs, model))
    return SHARDED_METHOD


def compute_token_logprobs(model: torch.nn.Module, batch: PaddedBatch, temperature: float = 1.0,
                           chunk_rows: int = 512, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    want_BT = batch.mask_BT[:, 1:] > 0  # token t+1 is predicted from position t
    hidden_NH = _wanted_hidden(model, batch, want_BT)
    output, transform = model.get_output_embeddings(), logit_transform(model.config)
    head = lambda hidden_NH: transform(output(hidden_NH))  # noqa: E731
    targets_N = batch.ids_BT[:, 1:][want_BT]
    logps, entropies = [], []
    for start in range(0, hidden_NH.shape[0], chunk_rows):
        args = (head, hidden_NH[start:start + chunk_rows], targets_N[start:start + chunk_rows], temperature,
                entropy_grad)
        if torch.is_grad_enabled():
            logp_N, entropy_N = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            logp_N, entropy_N = _head_logprobs(*args)
        logps.append(logp_N)
        entropies.append(entropy_N)
    logprobs_BT = torch.zeros(batch.mask_BT.shape, dtype=torch.float, device=hidden_NH.device)
    entropy_BT = torch.zeros_like(logprobs_BT)
    if logps:
        full_want_BT = torch.zeros_like(batch.mask_BT, dtype=torch.bool)
        full_want_BT[:, 1:] = want_BT
        logprobs_BT = logprobs_BT.masked_scatter(full_want_BT, torch.cat(logps))
        entropy_BT = entropy_BT.masked_scatter(full_want_BT, torch.cat(entropies))
    return logprobs_BT, entropy_BT


_MASKED = torch.finfo(torch.bfloat16).min  # finite in float32 and in bf16, which mixed precision may cast it to


def _wanted_hidden(model: torch.nn.Module, batch: PaddedBatch, want_BT: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states at the positions `want_BT` (B × T-1) marks, [N, H] in row
    order, from the packed layout when there is one. They are taken from the decoder's output
    directly: laying packed rows out as B × T first cost a B × T × H copy (each row's prompt
    repeated) and, in the backward pass, as many zeros to scatter the few wanted gradients into."""
    decoder = model.get_decoder()
    packed = batch.packed
    if packed is None:
        hidden_BTH = decoder(input_ids=batch.ids_BT, attention_mask=batch.attention_BT, use_cache=False).last_hidden_state
        return hidden_BTH[:, :-1][want_BT]
    implementation = decoder.config._attn_implementation
    segmented = {KEYWORD: packed.segments} if packed.segments and implementation == NAME else {}
    mask_G1LL = packed.attention_G1LL
    if implementation == "eager":  # eager attention adds a 4-D mask to the scores: True would add 1, mask nothing
        mask_G1LL = torch.zeros(mask_G1LL.shape, device=mask_G1LL.device).masked_fill(~mask_G1LL, _MASKED)
    hidden_GLH = decoder(input_ids=packed.ids_GL, attention_mask=mask_G1LL,
                         position_ids=packed.positions_GL, use_cache=False, **segmented).last_hidden_state
    return hidden_GLH.flatten(0, 1)[packed.where_BT[:, :-1][want_BT]]
