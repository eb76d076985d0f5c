"""Supervised training on multi-turn conversations, with the rollout loop's token builder and mask.

A conversation (system, user, assistant turns with tool calls, tool results) is turned into one
token sequence exactly as an episode would be: the prompt rendered once, each assistant turn as its
content ids plus the end-of-turn token (mask 1), every other turn as the template suffix (mask 0).
So SFT and RL train on identical token layouts. This module does no RL and no distributed training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from agentrl.rollout.chat import ChatRenderer, SpecialTextError, TemplateError, normalize_tool_calls
from agentrl.trainer.logprobs import pad_sequences, token_logprobs


@dataclass
class Sample:
    token_ids: list[int]
    loss_mask: list[int]


def conversation_sample(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> Sample:
    """Token ids and loss mask of a conversation; only assistant tokens carry loss.

    Each assistant turn is what the template renders for it (content, tool calls, end-of-turn
    token), so an OpenAI-style message with `content: null` and `tool_calls` trains on its calls.
    """
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = renderer.prompt_ids(messages[:first])
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        turn, _ = renderer.assistant_turn_ids(messages[:i], messages[i])
        ids, mask = ids + turn, mask + [1] * len(turn)
        end = next((j for j in range(i + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        if end < len(messages):  # no suffix after the last assistant turn: nothing follows it
            history = messages[:i] + [normalize_tool_calls(messages[i])]
            suffix, _ = renderer.suffix_ids(ids, history, messages[i + 1:end])
            ids, mask = ids + suffix, mask + [0] * len(suffix)
        i = end
    return Sample(ids, mask)


def sft_train(model: torch.nn.Module, samples: list[Sample], pad_id: int, steps: int, batch_size: int = 4,
              lr: float = 1e-4, seed: int = 0, bf16_autocast: bool = False,
              on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """AdamW on the token-mean negative log-likelihood of mask-1 tokens; returns the loss per step."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        chosen = rng.sample(samples, min(batch_size, len(samples)))
        batch = pad_sequences([s.token_ids for s in chosen], [s.loss_mask for s in chosen], pad_id, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_autocast):
            logprobs_BT, _ = token_logprobs(model, batch)
        loss = -(logprobs_BT * batch.mask_BT).sum() / batch.mask_BT.sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step:
            on_step(len(losses), loss.item())
    model.eval()
    return losses


def run_sft(config) -> str:
    """`agentrl sft`: demonstrations → supervised steps → a model directory; returns its path."""
    import sys
    import time
    from pathlib import Path

    from agentrl.errors import ConfigError
    from agentrl.recipe import to_yaml
    from agentrl.data import arithmetic_demonstrations, conversation_file
    from agentrl.hardware import choose_dtype
    from agentrl.models import load_model, load_tokenizer
    from agentrl.trainer.checkpoint import check_replaceable, save_model
    from agentrl.tools.loader import load_tool_files

    print(to_yaml(config), file=sys.stderr)
    s = config.sft
    check_replaceable(s.output, "sft.output")  # before anything loads: the save replaces the directory
    if config.model.lora.rank > 0 and Path(s.base_model).exists() and \
            Path(s.base_model).resolve().is_relative_to(Path(s.output).resolve()):
        raise ConfigError(f"sft.base_model: '{s.base_model}' is inside sft.output ('{s.output}'), which the save "
                          "replaces with LoRA adapters that name their base; save them elsewhere")
    tools = load_tool_files(config.rollout.tool_configs)
    conversations = ([(f"sft.data arithmetic #{i + 1}", c) for i, c in enumerate(arithmetic_demonstrations(
                         s.num_examples, s.seed, s.min_digits, s.max_digits, config.rollout.system_prompt))]
                     if s.data == "arithmetic" else conversation_file(s.data))
    tokenizer = load_tokenizer(s.base_model, config.model.chat_template, needs_tools=bool(tools))
    try:
        renderer = ChatRenderer(tokenizer, tools)
    except SpecialTextError as e:  # a tool schema spelling a control token: before the model loads
        raise ConfigError(f"rollout.tool_configs: {e}") from None
    renderer.system_prompt = config.rollout.system_prompt  # rendered as written; a conversation's own is text
    samples = []
    for place, conversation in conversations:
        try:
            samples.append(conversation_sample(renderer, conversation))
        except TemplateError as e:  # a row the template cannot render token by token: before the model loads
            raise ConfigError(f"{place}: {e}") from None
    model = load_model(s.base_model)
    if config.model.lora.rank > 0:  # the adapters train and are saved; load_model merges them for use
        from agentrl.trainer.lora import add_lora

        model = add_lora(model, config.model.lora, s.base_model, seed=s.seed)
    model.to(config.trainer.device)  # where the RL stage trains the policy too
    started = time.perf_counter()
    bf16 = choose_dtype(s.dtype, next(model.parameters()).device).dtype == "bfloat16"
    losses = sft_train(model, samples, tokenizer.pad_token_id, s.steps, s.batch_size, s.lr, s.seed, bf16,
                       on_step=lambda step, loss: print(f"sft step {step}/{s.steps} loss {loss:.4f}"))
    save_model(model, tokenizer, s.output)
    if losses:
        print(f"sft: {len(samples)} conversations, {s.steps} steps in {time.perf_counter() - started:.0f} s, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {s.output}")
    return s.output
