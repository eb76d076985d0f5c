"""Advantage estimators: pure tensor functions of rewards, values and masks.

Outcome estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++) give one scalar per trajectory, broadcast to
its trainable tokens by the caller; GAE gives one value per token and skips mask-0 tokens (tool
output, user turns), carrying the value and the discounting across them, so a tool call's advantage
sees the tool's consequences but tool tokens themselves are never bootstrapped from.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards_BG: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: (r - mean_group) / (std_group + eps).

    GRPO: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, section 4.1.2. With
    `normalize_std=False` this is Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    arXiv:2503.20783), which drops the std division that up-weights near-solved groups.
    `rewards_BG` holds B groups of G samples; the std is unbiased (torch default).
    """
    centered_BG = rewards_BG - rewards_BG.mean(dim=1, keepdim=True)
    if not normalize_std or rewards_BG.shape[1] < 2:
        return centered_BG
    return centered_BG / (rewards_BG.std(dim=1, keepdim=True) + eps)


def rloo_advantages(rewards_BG: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean_{j≠i} r_j.

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics", arXiv:2402.14740.
    """
    g = rewards_BG.shape[1]
    if g < 2:
        raise ValueError("RLOO needs at least 2 samples per group")
    return rewards_BG * g / (g - 1) - rewards_BG.sum(dim=1, keepdim=True) / (g - 1)


def reinforce_pp_advantages(rewards_BG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with baseline: subtract the group mean, then normalise over the whole batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", arXiv:2501.03262.
    """
    centered_BG = rewards_BG - rewards_BG.mean(dim=1, keepdim=True)
    return (centered_BG - centered_BG.mean()) / (centered_BG.std() + eps)


def gae_advantages(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor,
                   gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over trainable tokens only; returns (advantages, returns).

    Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", arXiv:1506.02438.
    Token t's successor is the next token with mask 1; mask-0 tokens get advantage 0 and pass the
    running value and advantage through unchanged. Rewards on mask-0 positions are ignored.
    """
    advantages_BT = torch.zeros_like(values_BT)
    next_value_B = torch.zeros_like(values_BT[:, 0])
    running_B = torch.zeros_like(values_BT[:, 0])
    for t in reversed(range(values_BT.shape[1])):
        m_B = mask_BT[:, t].to(values_BT.dtype)
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        updated_B = delta_B + gamma * lam * running_B
        running_B = m_B * updated_B + (1 - m_B) * running_B
        next_value_B = m_B * values_BT[:, t] + (1 - m_B) * next_value_B
        advantages_BT[:, t] = m_B * running_B
    returns_BT = (advantages_BT + values_BT) * mask_BT
    return advantages_BT, returns_BT


def masked_whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean unit-variance over the mask-1 entries (PPO advantage normalisation)."""
    m = mask_BT.to(x_BT.dtype)
    mean = (x_BT * m).sum() / m.sum().clamp(min=1)
    var = (((x_BT - mean) * m) ** 2).sum() / m.sum().clamp(min=1)
    return (x_BT - mean) * torch.rsqrt(var + eps) * m
