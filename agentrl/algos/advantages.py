"""Advantage estimators: pure tensor functions of rewards, values and masks.

Outcome estimators (GRPO, Dr.GRPO, RLOO) give one scalar per trajectory, broadcast to its trainable
tokens by the caller; REINFORCE++ whitens per-token returns over the batch's trained tokens; GAE gives one value per token and skips mask-0 tokens (tool
output, user turns), carrying the value and the discounting across them, so a tool call's advantage
sees the tool's consequences but tool tokens themselves are never bootstrapped from.
"""

from __future__ import annotations

import torch


def _group_stats(rewards_BG: torch.Tensor, valid_BG: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(valid_BG as float64, members per group n_B1, rewards centred on their group's mean, 0 off
    valid), in float64. A group whose valid rewards are all equal is centred to exactly 0: the float32
    mean of, say, eight rewards of 0.7 is not 0.7, and dividing that rounding error by the group's
    equally tiny std would give every member an advantage of about 0.1, all of one sign."""
    rewards_BG = rewards_BG.double()
    valid_BG = torch.ones_like(rewards_BG) if valid_BG is None else valid_BG.to(rewards_BG.dtype)
    n_B1 = valid_BG.sum(dim=1, keepdim=True)
    mean_B1 = (rewards_BG * valid_BG).sum(dim=1, keepdim=True) / n_B1.clamp(min=1)
    kept_BG = valid_BG > 0
    high_B1 = rewards_BG.masked_fill(~kept_BG, -torch.inf).amax(dim=1, keepdim=True)
    low_B1 = rewards_BG.masked_fill(~kept_BG, torch.inf).amin(dim=1, keepdim=True)
    centered_BG = torch.where(high_B1 == low_B1, 0.0, (rewards_BG - mean_B1) * valid_BG)
    return valid_BG, n_B1, centered_BG


def grpo_advantages(rewards_BG: torch.Tensor, valid_BG: torch.Tensor | None = None, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: (r - mean_group) / (std_group + eps).

    GRPO: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, section 4.1.2. With
    `normalize_std=False` this is Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    arXiv:2503.20783), which drops the std division that up-weights near-solved groups.
    `rewards_BG` holds B groups of G samples; `valid_BG` (1 = keep) leaves failed episodes out of
    their group's mean and std, and gives them 0. The std is unbiased; a group with fewer than two
    valid members has advantage 0, never NaN.
    """
    valid_BG, n_B1, centered_BG = _group_stats(rewards_BG, valid_BG)
    if not normalize_std:
        return centered_BG.to(rewards_BG.dtype)
    std_B1 = ((centered_BG ** 2).sum(dim=1, keepdim=True) / (n_B1 - 1).clamp(min=1)).sqrt()
    return (centered_BG / (std_B1 + eps)).to(rewards_BG.dtype)


def rloo_advantages(rewards_BG: torch.Tensor, valid_BG: torch.Tensor | None = None) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean_{j≠i} r_j over the valid members of each group.

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics", arXiv:2402.14740. r_i - mean_{j≠i} r_j = (r_i - mean) · n / (n - 1); a group
    with fewer than two valid members has no baseline and gets 0.
    """
    valid_BG, n_B1, centered_BG = _group_stats(rewards_BG, valid_BG)
    loo_BG = torch.where(n_B1 >= 2, centered_BG * n_B1 / (n_B1 - 1).clamp(min=1), torch.zeros_like(centered_BG))
    return loo_BG.to(rewards_BG.dtype)


def group_baseline(rewards_BG: torch.Tensor, valid_BG: torch.Tensor | None = None) -> torch.Tensor:
    """Each reward less its group's mean over the valid members (0 for failed ones): the baseline of
    REINFORCE++-baseline, before reinforce_pp_advantages."""
    return _group_stats(rewards_BG, valid_BG)[2].to(rewards_BG.dtype)


def reinforce_pp_advantages(returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """REINFORCE++: per-token returns whitened over every trained token of the batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", arXiv:2501.03262: a
    token's return is the outcome reward (here less its group's mean, the paper's baseline variant)
    minus β times the KL-to-go when the KL is a reward penalty; the advantage is that return
    normalised over the batch's tokens, so β weighs the KL against the rewards in their own units
    and the advantages have mean 0. (Whitening each sequence's reward before subtracting the KL made
    β a multiple of the batch's reward spread and left the advantages off centre.) A batch whose
    rewards are all equal has only the KL left in its returns, which the whitening scales up to unit
    spread, as in the paper's formulation: that step pulls towards the reference alone. Mask-0
    tokens get 0; all-equal returns 0.
    """
    return masked_whiten(returns_BT, mask_BT)


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
    """Zero-mean unit-variance over the mask-1 entries (PPO advantage normalisation).

    The statistics are taken in float64: in float32 the mean of a thousand equal values is off by
    a rounding error that the eps-sized variance then scales up, and every token got the same
    spurious advantage (up to 5e-3 for values near 6) where all should be 0."""
    x = x_BT.double()
    m = mask_BT.to(torch.float64)
    mean = (x * m).sum() / m.sum().clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / m.sum().clamp(min=1)
    return ((x - mean) * torch.rsqrt(var + eps) * m).to(x_BT.dtype)
