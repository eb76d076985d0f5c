"""Policy losses, loss aggregation, KL estimators and importance weights: pure tensor functions over (B, T) tensors.

Every (B, T) tensor is aligned with the token sequence and weighted by `mask_BT` (1 on tokens the
policy sampled). Nothing here knows about models, batches or optimisers.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]
LOG_RATIO_LIMIT = 20.0  # |log ratio| beyond which exp is taken at the limit, or along its tangent there
LOG_RATIO_CEILING = 1e4  # a PPO log ratio's bound, so that even an -inf old logprob gives finite numbers


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: Aggregation = "token-mean") -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    token-mean: every trainable token weighs the same (DAPO, Yu et al. 2025, arXiv:2503.14476).
    seq-mean-token-mean: mean per sequence, then over sequences (the original GRPO objective).
    seq-mean-token-sum: sum per sequence, then mean over sequences (Dr.GRPO, arXiv:2503.20783,
    without its constant normaliser). Sequences with no trainable token are left out of the means.
    """
    m = mask_BT.to(loss_BT.dtype)
    if mode == "token-mean":
        return (loss_BT * m).sum() / m.sum().clamp(min=1)
    per_seq_B = (loss_BT * m).sum(dim=1)
    has_tokens_B = (m.sum(dim=1) > 0).to(loss_BT.dtype)
    if mode == "seq-mean-token-mean":
        per_seq_B = per_seq_B / m.sum(dim=1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation '{mode}'")
    return (per_seq_B * has_tokens_B).sum() / has_tokens_B.sum().clamp(min=1)


def ppo_policy_loss(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor,
                    mask_BT: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None, aggregation: Aggregation = "token-mean",
                    weights_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with asymmetric bounds and optional dual clip; (loss, metrics).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347. The ratio is
    clipped to [1 - clip_low, 1 + clip_high]; a larger clip_high is DAPO's clip-higher (Yu et al.
    2025, arXiv:2503.14476). Dual clip bounds the loss of negative-advantage tokens by
    -dual_clip * A (Ye et al. 2020, "Mastering Complex Control in MOBA Games", arXiv:1912.09729).
    `weights_BT` (constants, e.g. `truncated_importance_weights`) scale each token's surrogate.
    """
    # Past e^88 float32 overflows, and a token with zero advantage (common under GRPO) would give
    # 0 · inf = NaN. Above LOG_RATIO_LIMIT the ratio goes on along exp's tangent: a clamp there gave
    # a negative-advantage token the policy had raised that far no gradient at all, where the
    # surrogate (no clip binds it without dual_clip) pushes it down hardest. Below -LOG_RATIO_LIMIT
    # the ratio is ~0 and the clip range decides. The ceiling keeps an -inf old logprob finite.
    log_ratio_BT = torch.clamp(logprobs_BT - old_logprobs_BT, -LOG_RATIO_LIMIT, LOG_RATIO_CEILING)
    ratio_BT = _exp_within_floats(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError("dual_clip must be larger than 1")
        bounded_BT = torch.minimum(loss_BT, -advantages_BT * dual_clip)
        loss_BT = torch.where(advantages_BT < 0, bounded_BT, loss_BT)
    if weights_BT is not None:
        loss_BT = loss_BT * weights_BT.detach()
    m = mask_BT.to(loss_BT.dtype)
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        # The tokens the surrogate gives no gradient: clipped by the ratio's range, or bound by the dual clip.
        no_gradient_BT = clipped_BT > unclipped_BT
        if dual_clip is not None:
            no_gradient_BT |= (advantages_BT < 0) & (-advantages_BT * dual_clip < torch.maximum(unclipped_BT, clipped_BT))
        metrics = {"clip_fraction": (no_gradient_BT.to(m.dtype) * m).sum().item() / n.item(),
                   "approx_kl": (0.5 * log_ratio_BT ** 2 * m).sum().item() / n.item(),
                   "ratio_mean": (ratio_BT * m).sum().item() / n.item()}
    return aggregate(loss_BT, mask_BT, aggregation), metrics


def truncated_importance_weights(old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """min(p_old / p_rollout, cap) per token, without gradient: truncated importance sampling (Yao et
    al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"). The engine
    samples from its own numerics (bfloat16, other kernels), not exactly from the trainer's
    pre-update policy the surrogate assumes; weighting each token's surrogate by this ratio corrects
    the expectation, and the cap bounds the variance a token the engine found far less likely than
    the trainer does would add."""
    with torch.no_grad():
        return torch.exp(old_logprobs_BT - rollout_logprobs_BT).clamp(max=cap)  # an overflow to inf is capped too


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html), with
    r = p_ref / p_policy: k1 = -log r (unbiased, high variance), k2 = (log r)^2 / 2,
    k3 = (r - 1) - log r (unbiased, non-negative, low variance).
    """
    log_r_BT = ref_logprobs_BT - logprobs_BT
    if kind == "k1":
        return -log_r_BT
    if kind == "k2":
        return 0.5 * log_r_BT ** 2
    if kind == "k3":
        return _exp_within_floats(log_r_BT) - 1.0 - log_r_BT
    raise ValueError(f"unknown KL estimator '{kind}'")


def _exp_within_floats(x_BT: torch.Tensor) -> torch.Tensor:
    """exp(x) up to x = LOG_RATIO_LIMIT and its tangent beyond: past e^88 float32 overflows. Only the
    top is bounded: below, exp underflows to 0 harmlessly, and a clamp there made k3 flat, so the
    tokens the policy had raised furthest above the reference got no pull back at all. Along the
    tangent the gradient stays finite and keeps its sign (clamping the exp's input alone flips k3's)."""
    capped_BT = torch.clamp(x_BT, max=LOG_RATIO_LIMIT)
    return torch.exp(capped_BT) * (1.0 + x_BT - capped_BT)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of softmax(logits), shape (B, T)."""
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(dim=-1)


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               mask_BT: torch.Tensor, clip: float | None = 0.2) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old ± clip) - R)^2), token mean."""
    loss_BT = (values_BT - returns_BT) ** 2
    if clip is not None:
        clipped_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -clip, clip)
        loss_BT = torch.maximum(loss_BT, (clipped_BT - returns_BT) ** 2)
    return 0.5 * aggregate(loss_BT, mask_BT, "token-mean")
