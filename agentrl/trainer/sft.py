"""Supervised training on multi-turn conversations, with the rollout loop's token builder and mask.

A conversation (system, user, assistant turns with tool calls, tool results) is turned into one
token sequence exactly as an episode would be: the prompt rendered once, each assistant turn as its
content ids plus the end-of-turn token (mask 1), every other turn as the template suffix (mask 0).
A conversation opens as an episode's prompt does, with the recipe's system prompt unless it has its
own. So SFT and RL train on identical token layouts. This module does no RL and no distributed
training.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from agentrl.rollout.chat import ChatRenderer, SpecialTextError, TemplateError, normalize_tool_calls
from agentrl.trainer.logprobs import pad_sequences, token_logprobs
from agentrl.trainer.optimizer import adamw
from agentrl.types import Task


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


def batch_order(count: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The indices of `steps` batches of min(batch_size, count) examples of `count`, dealt in turn
    from epochs, each a shuffle of all of them drawn from `seed`: every example is drawn once before
    any is drawn again. (Batches drawn independently left some of a small set unseen: 3 steps of 4
    drew 9 distinct demonstrations of 16.) A batch that runs past an epoch's end completes itself
    from the next epoch with examples it does not hold yet, which that epoch deals later."""
    rng = random.Random(seed)
    size = min(batch_size, count)
    pending: list[int] = []  # the current epoch's examples not dealt yet, in order
    batches = []
    for _ in range(steps):
        batch, pending = pending[:size], pending[size:]
        if len(batch) < size:  # this epoch is dealt: the next one's shuffle fills the batch
            epoch = list(range(count))
            rng.shuffle(epoch)
            taken = [i for i in epoch if i not in batch][:size - len(batch)]
            batch += taken
            pending = [i for i in epoch if i not in taken]
        batches.append(batch)
    return batches


def sft_train(model: torch.nn.Module, samples: list[Sample], pad_id: int, steps: int, batch_size: int = 4,
              lr: float = 1e-4, seed: int = 0, bf16_autocast: bool = False,
              on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """AdamW on the token-mean negative log-likelihood of mask-1 tokens, on batches dealt from
    seeded shuffles of `samples` (batch_order); returns the loss per step."""
    device = next(model.parameters()).device
    optimizer = adamw(model.parameters(), lr, 0.0)
    model.train()
    losses = []
    for indices in batch_order(len(samples), batch_size, steps, seed):
        chosen = [samples[i] for i in indices]
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


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """A conversation opening as an RL episode's prompt opens (Task.messages): with the recipe's
    system prompt first unless its opening (the messages before the first assistant turn) has a
    system message of its own. Without it SFT trained after the template's default system message,
    and RL then sampled after another."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return Task(id="", prompt=messages[:first]).messages(system_prompt) + messages[first:]


def sft_conversations(config) -> list[tuple[str, list[dict[str, Any]]]]:
    """The conversations `agentrl sft` trains on, each with its place for errors: generated
    demonstrations, or sft.data's file with the recipe's system prompt laid out as RL lays it out."""
    from agentrl.data import arithmetic_demonstrations, conversation_file

    s, system_prompt = config.sft, config.rollout.system_prompt
    if s.data == "arithmetic":
        return [(f"sft.data arithmetic #{i + 1}", c) for i, c in enumerate(arithmetic_demonstrations(
            s.num_examples, s.seed, s.min_digits, s.max_digits, system_prompt))]
    return [(place, with_system_prompt(c, system_prompt)) for place, c in conversation_file(s.data)]


@contextlib.contextmanager
def naming_model_errors(key: str) -> Iterator[None]:
    """A ConfigError about the model itself ("model '/x': ...") names the recipe `key` that chose it;
    one about another key (model.chat_template) already names that one."""
    from agentrl.errors import ConfigError

    try:
        yield
    except ConfigError as e:
        if str(e).startswith("model "):
            raise ConfigError(f"{key}: {e}") from None
        raise


def run_sft(config) -> str:
    """`agentrl sft`: demonstrations → supervised steps → a model directory; returns its path."""
    import sys
    import time
    from pathlib import Path

    from agentrl.errors import ConfigError
    from agentrl.recipe import to_yaml
    from agentrl.hardware import choose_dtype
    from agentrl.models import load_model, load_tokenizer
    from agentrl.trainer.checkpoint import check_replaceable, save_model
    from agentrl.tools.base import tool_name
    from agentrl.tools.loader import load_tool_files

    print(to_yaml(config), file=sys.stderr)
    s = config.sft
    check_replaceable(s.output, "sft.output")  # before anything loads: the save replaces the directory
    if config.model.lora.rank > 0 and Path(s.base_model).exists() and \
            Path(s.base_model).resolve().is_relative_to(Path(s.output).resolve()):
        raise ConfigError(f"sft.base_model: '{s.base_model}' is inside sft.output ('{s.output}'), which the save "
                          "replaces with LoRA adapters that name their base; save them elsewhere")
    tools = load_tool_files(config.rollout.tool_configs)
    conversations = sft_conversations(config)
    # sft.base_model is model.path unless set: an error names the key the path came from
    key = "sft.base_model" if s.base_model != config.model.path else "model.path"
    with naming_model_errors(key):
        tokenizer = load_tokenizer(s.base_model, config.model.chat_template, needs_tools=bool(tools))
    offered = sorted(tool_name(t) for t in tools)
    if s.data == "arithmetic" and "calculator" not in offered:  # RL would answer each such call "unknown tool"
        raise ConfigError(f"sft.data 'arithmetic': its demonstrations call the tool 'calculator', which "
                          f"rollout.tool_configs does not offer (it offers: {', '.join(offered) or 'no tools'}); "
                          "add tool_configs/calculator.yaml, or give sft.data a file of conversations")
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
    with naming_model_errors(key):
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
