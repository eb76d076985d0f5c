"""From trajectories to per-token training targets: advantages, and returns for the critic.

The estimators themselves are tensor functions in agentrl.algos.advantages; this module only places
each trajectory's outcome reward and KL penalty on its tokens. Lists are aligned with token ids and
are 0 wherever the loss mask is 0 (prompt, tool output, template tokens).
"""

from __future__ import annotations

import torch

from agentrl.algos.advantages import (gae_advantages, group_baseline, grpo_advantages, masked_whiten,
                                      reinforce_pp_advantages, rloo_advantages)
from agentrl.config import AlgorithmConfig
from agentrl.types import Trajectory

# REINFORCE++'s per-sequence part is the baseline; token_advantages whitens over the batch's tokens.
OUTCOME_ESTIMATORS = {"grpo": grpo_advantages,
                      "dr_grpo": lambda r, valid: grpo_advantages(r, valid, normalize_std=False),
                      "rloo": rloo_advantages, "reinforce_pp": group_baseline}


def outcome_advantages(trajectories: list[Trajectory], group_size: int, algo: AlgorithmConfig) -> list[float | None]:
    """One group-relative advantage per trajectory, in order (groups are consecutive runs of
    `group_size`). Failed episodes (finish 'error') get None: they are left out of the update and
    out of their group's baseline, so an infrastructure failure never becomes a negative advantage."""
    valid = [t.finish != "error" for t in trajectories]
    # float64, as the estimators' group statistics: float32 rounded rewards 2e-5 apart at 1000 to
    # one value, and their group got no advantage.
    rewards_BG = torch.tensor([t.reward if ok else 0.0 for t, ok in zip(trajectories, valid)],
                              dtype=torch.float64).view(-1, group_size)
    valid_BG = torch.tensor(valid, dtype=torch.float64).view(-1, group_size)
    per_sequence = OUTCOME_ESTIMATORS[algo.advantage](rewards_BG, valid_BG).flatten().tolist()
    return [advantage if ok else None for advantage, ok in zip(per_sequence, valid)]


def token_advantages(trajectories: list[Trajectory], per_sequence: list[float], algo: AlgorithmConfig,
                     kl_per_token: list[list[float]] | None = None) -> list[list[float]]:
    """Each trajectory's advantage on its trainable tokens, minus the KL-to-go when the KL is a
    reward penalty (summed from each token to the end, γ = 1); for REINFORCE++ that return is then
    whitened over the batch's trained tokens."""
    out = []
    for i, (traj, advantage) in enumerate(zip(trajectories, per_sequence)):
        row = [advantage * m for m in traj.loss_mask]
        if kl_per_token is not None:
            to_go = 0.0
            for t in reversed(range(len(row))):
                to_go += algo.kl_coef * kl_per_token[i][t] * traj.loss_mask[t]
                row[t] -= to_go * traj.loss_mask[t]
        out.append(row)
    if algo.advantage == "reinforce_pp" and out:
        width = max(len(row) for row in out)
        returns_BT, mask_BT = _padded(out, width), _trained_mask(trajectories, width)
        out = [row[:len(t.token_ids)] for row, t in zip(reinforce_pp_advantages(returns_BT, mask_BT).tolist(),
                                                           trajectories)]
    return out


def _padded(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float)


def _trained_mask(trajectories: list[Trajectory], width: int) -> torch.Tensor:
    """1 on the tokens the update trains (loss mask 1, position 0 aside: nothing predicts it)."""
    mask_BT = _padded([[float(m) for m in t.loss_mask] for t in trajectories], width)
    mask_BT[:, 0] = 0.0
    return mask_BT


def token_rewards(trajectories: list[Trajectory], algo: AlgorithmConfig,
                  kl_per_token: list[list[float]] | None = None) -> list[list[float]]:
    """The outcome reward on each trajectory's last trainable token, minus kl_coef·KL per token."""
    out = []
    for i, traj in enumerate(trajectories):
        row = [0.0] * len(traj.token_ids)
        if kl_per_token is not None:
            row = [-algo.kl_coef * k * m for k, m in zip(kl_per_token[i], traj.loss_mask)]
        trainable = [t for t, m in enumerate(traj.loss_mask) if m and t > 0]
        if trainable:
            row[trainable[-1]] += traj.reward or 0.0
        out.append(row)
    return out


def gae_targets(trajectories: list[Trajectory], values: list[list[float]], algo: AlgorithmConfig,
                kl_per_token: list[list[float]] | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """(advantages, returns) by GAE over trainable tokens; advantages whitened over the batch."""
    width = max(len(t.token_ids) for t in trajectories)
    mask_BT = _trained_mask(trajectories, width)
    advantages_BT, returns_BT = gae_advantages(_padded(token_rewards(trajectories, algo, kl_per_token), width),
                                               _padded(values, width), mask_BT, algo.gamma, algo.lam)
    advantages_BT = masked_whiten(advantages_BT, mask_BT)
    lengths = [len(t.token_ids) for t in trajectories]
    return ([row[:n] for row, n in zip(advantages_BT.tolist(), lengths)],
            [row[:n] for row, n in zip(returns_BT.tolist(), lengths)])
