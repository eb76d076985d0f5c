"""Supervised training on multi-turn conversations, with the rollout loop's token builder and mask.

A conversation (system, user, assistant turns with tool calls, tool results) is turned into one
token sequence exactly as an episode would be: the prompt rendered once, each assistant turn as its
content ids plus the end-of-turn token (mask 1), every other turn as the template suffix (mask 0).
So SFT and RL train on identical token layouts. This module does no RL and no distributed training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.rollout.episode import ChatRenderer


@dataclass
class Sample:
    token_ids: list[int]
    loss_mask: list[int]


def conversation_sample(renderer: ChatRenderer, messages: list[dict[str, Any]], eos_token_id: int) -> Sample:
    """Token ids and loss mask of a conversation; only assistant tokens carry loss."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = renderer.prompt_ids(messages[:first])
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        turn = renderer.encode(messages[i]["content"] or "") + [eos_token_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
        end = next((j for j in range(i + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        if end < len(messages):  # no suffix after the last assistant turn: nothing follows it
            suffix, _ = renderer.suffix_ids(ids, messages[: i + 1], messages[i + 1:end])
            ids, mask = ids + suffix, mask + [0] * len(suffix)
        i = end
    return Sample(ids, mask)


def sequence_logprobs(model: torch.nn.Module, ids_BT: torch.Tensor, attention_BT: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens < t) for t ≥ 1; shape (B, T-1)."""
    logits_BTV = model(input_ids=ids_BT, attention_mask=attention_BT).logits[:, :-1].float()
    return torch.log_softmax(logits_BTV, dim=-1).gather(2, ids_BT[:, 1:, None]).squeeze(2)


def pad_batch(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s.token_ids) for s in samples)
    ids_BT = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_BT = torch.zeros((len(samples), width), dtype=torch.long)
    mask_BT = torch.zeros((len(samples), width), dtype=torch.float)
    for row, s in enumerate(samples):  # right padding: training needs no aligned last token
        ids_BT[row, : len(s.token_ids)] = torch.tensor(s.token_ids)
        attention_BT[row, : len(s.token_ids)] = 1
        mask_BT[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float)
    return ids_BT, attention_BT, mask_BT


def sft_train(model: torch.nn.Module, samples: list[Sample], pad_id: int, steps: int, batch_size: int = 4,
              lr: float = 1e-4, seed: int = 0) -> list[float]:
    """AdamW on the token-mean negative log-likelihood of mask-1 tokens; returns the loss per step."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        batch = rng.sample(samples, min(batch_size, len(samples)))
        ids_BT, attention_BT, mask_BT = pad_batch(batch, pad_id)
        logprobs_BT = sequence_logprobs(model, ids_BT, attention_BT)
        target_mask_BT = mask_BT[:, 1:]
        loss = -(logprobs_BT * target_mask_BT).sum() / target_mask_BT.sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses
