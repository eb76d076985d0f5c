"""Advantages, policy losses and KL estimators against numbers computed by hand or a plain loop."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algos.advantages import (gae_advantages, group_baseline, grpo_advantages, masked_whiten,
                                      reinforce_pp_advantages, rloo_advantages)
from agentrl.algos.losses import (aggregate, entropy_from_logits, kl_estimate, ppo_policy_loss,
                                 truncated_importance_weights, value_loss)

close = torch.testing.assert_close


def test_grpo_and_dr_grpo():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 → ±0.5 / 0.57735 = ±0.86603
    close(grpo_advantages(rewards), torch.tensor([[0.86603, -0.86603, -0.86603, 0.86603], [0.0] * 4]),
          atol=1e-4, rtol=0)
    close(grpo_advantages(rewards, normalize_std=False), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4]))


def test_rloo():
    # r=1: 1 - (0+0+1)/3 = 2/3; r=0: 0 - (1+0+1)/3 = -2/3
    close(rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    close(rloo_advantages(torch.tensor([[1.0]])), torch.tensor([[0.0]]))  # no baseline: no signal, no NaN


def test_failed_members_leave_their_groups_baseline():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 7.0], [2.0, 0.0, 5.0, 5.0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])  # the 7 and the lone group's peers failed
    # group 1 over (1, 0, 0): mean 1/3, unbiased std sqrt(1/3); group 2 has one member: all 0
    s = math.sqrt(1 / 3)
    close(grpo_advantages(rewards, valid), torch.tensor([[2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 0], [0.0] * 4]),
          atol=1e-4, rtol=0)
    close(grpo_advantages(rewards, valid, normalize_std=False), torch.tensor([[2 / 3, -1 / 3, -1 / 3, 0], [0.0] * 4]))
    # RLOO: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5
    close(rloo_advantages(rewards, valid), torch.tensor([[1.0, -0.5, -0.5, 0.0], [0.0] * 4]))
    # REINFORCE++'s baseline: the group's valid mean (1/3) and nothing for the lone member
    close(group_baseline(rewards, valid), torch.tensor([[2 / 3, -1 / 3, -1 / 3, 0], [0.0] * 4]))


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages, group_baseline])
def test_estimators_never_give_nan_on_degenerate_input(estimator):
    for rewards in (torch.tensor([[1.0]]), torch.tensor([[3.0, 3.0]]), torch.tensor([[1.0, 2.0]])):
        for valid in (None, torch.tensor([[0] * rewards.shape[1]]), torch.tensor([[1] + [0] * (rewards.shape[1] - 1)])):
            assert torch.isfinite(estimator(rewards, valid)).all(), (estimator.__name__, rewards, valid)


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages, group_baseline])
def test_a_group_of_equal_partial_rewards_has_no_advantage(estimator):
    """Eight rewards of 0.7 (or 1.2: partial credit, summed tool rewards) used to have a float32
    mean one rounding step off, which GRPO's division by the equally tiny std turned into an
    advantage of about 0.1 for every member; REINFORCE++ did the same over a batch of such groups."""
    rewards = torch.tensor([[0.7] * 8, [1.2] * 8, [0.3] * 3 + [9.0] * 5])  # the 9.0s are failed episodes
    valid = torch.tensor([[1] * 8, [1] * 8, [1] * 3 + [0] * 5])
    advantages = estimator(rewards, valid)
    assert advantages.dtype == torch.float32 and torch.equal(advantages, torch.zeros_like(advantages))
    # One different member still gets its hand-computed share: rewards (0.7 × 7, 1.7), mean 0.825.
    mixed = estimator(torch.tensor([[0.7] * 7 + [1.7]]))
    if estimator is rloo_advantages:  # 1.7 - 0.7 = 1; 0.7 - (0.7 × 6 + 1.7) / 7 = -1/7
        close(mixed, torch.tensor([[-1 / 7] * 7 + [1.0]]))
    elif estimator is group_baseline:
        close(mixed, torch.tensor([[-0.125] * 7 + [0.875]]))
    else:  # centred -0.125 and 0.875; unbiased std sqrt((7 × 0.125² + 0.875²) / 7) = sqrt(1/8)
        close(mixed, torch.tensor([[-0.125] * 7 + [0.875]]) / math.sqrt(1 / 8), atol=1e-4, rtol=0)


def test_reinforce_pp_whitens_over_trained_tokens():
    # returns 0.5, 0.6 | -0.9, -0.8 on trained tokens (the 9.0 is a tool token): mean -0.15,
    # population variance (0.65² + 0.75² + 0.75² + 0.65²) / 4 = 0.4925
    returns = torch.tensor([[0.5, 0.6, 9.0], [-0.9, -0.8, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    s = math.sqrt(0.4925)
    close(reinforce_pp_advantages(returns, mask), torch.tensor([[0.65 / s, 0.75 / s, 0], [-0.75 / s, -0.65 / s, 0]]),
          atol=1e-5, rtol=0)
    assert torch.equal(reinforce_pp_advantages(torch.zeros(2, 3), mask), torch.zeros(2, 3))  # nothing to learn: 0


@pytest.mark.parametrize("value", [0.1, 0.7, 6.1])
def test_whitening_equal_values_gives_zero_advantages(value):
    # 2000 equal returns: their float32 mean is off by a rounding error, which the eps-sized
    # variance scaled up to the same nonzero advantage on every token (6e-4 at 0.7, 5e-3 at 6.1)
    returns, mask = torch.full((2, 1000), value), torch.ones(2, 1000)
    assert reinforce_pp_advantages(returns, mask).abs().max().item() < 1e-9
    assert masked_whiten(returns, mask).dtype == torch.float32


def test_gae_by_hand_skips_tool_tokens():
    # Tokens: two sampled, two tool-output (mask 0), one sampled with the final reward 1.
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.3]])
    rewards = torch.tensor([[0.0, 0.0, 5.0, 0.0, 1.0]])  # the reward on a tool token is ignored
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv, torch.tensor([[0.5, 0.6, 0.0, 0.0, 0.7]]))  # R - V on sampled tokens
    close(ret, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]))


def reference_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE on the sampled tokens alone, scattered back."""
    out = torch.zeros_like(values)
    for b in range(values.shape[0]):
        idx = [t for t in range(values.shape[1]) if mask[b, t]]
        running = 0.0
        for k in reversed(range(len(idx))):
            nxt = values[b, idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[b, idx[k]] + gamma * nxt - values[b, idx[k]]
            running = delta + gamma * lam * running
            out[b, idx[k]] = running
    return out


def test_gae_matches_plain_loop():
    g = torch.Generator().manual_seed(0)
    values, rewards = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)
    mask = (torch.rand(3, 12, generator=g) > 0.3).long()
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, reference_gae(rewards, values, mask, 0.9, 0.8))


def test_ppo_clip_asymmetric_and_dual():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 4.0, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    # token 0: max(-1.5, -1.2) = -1.2; token 1: max(0.5, 0.8) = 0.8; token 2: max(4, 1.2) = 4;
    # token 3: ratio 1 → -2.
    loss, metrics = ppo_policy_loss(new, old, adv, mask, 0.2, 0.2)
    close(loss, torch.tensor((-1.2 + 0.8 + 4.0 - 2.0) / 4))
    assert metrics["clip_fraction"] == 0.5  # tokens 0 and 1
    loss, _ = ppo_policy_loss(new, old, adv, mask, 0.2, 0.28)  # clip-higher: token 0 → -1.28
    close(loss, torch.tensor((-1.28 + 0.8 + 4.0 - 2.0) / 4))
    loss, metrics = ppo_policy_loss(new, old, adv, mask, 0.2, 0.2, dual_clip=3.0)  # token 2 → min(4, 3)
    close(loss, torch.tensor((-1.2 + 0.8 + 3.0 - 2.0) / 4))
    assert metrics["clip_fraction"] == 0.75  # token 2's loss is the dual bound now: no gradient either


def test_truncated_importance_weights_scale_each_tokens_surrogate():
    # The engine found token 0 e times less likely than the trainer (weight e, capped at 2),
    # token 1 e times more likely (1/e), token 2 as likely (1); token 3's overflows to the cap.
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[-2.0, -1.0, -0.5, -200.0]])
    weights = truncated_importance_weights(old, rollout, cap=2.0)
    close(weights, torch.tensor([[2.0, math.exp(-1.0), 1.0, 2.0]]))
    assert not weights.requires_grad
    new = old.clone().requires_grad_(True)  # ratio 1: the surrogate is -A per token
    adv = torch.tensor([[1.0, 1.0, -1.0, 0.5]])
    loss, metrics = ppo_policy_loss(new, old, adv, torch.ones(1, 4), weights_BT=weights)
    loss.backward()
    close(loss, torch.tensor((-2.0 - math.exp(-1.0) + 1.0 - 1.0) / 4))
    close(new.grad, torch.tensor([[-2.0, -math.exp(-1.0), 1.0, -1.0]]) / 4)
    assert metrics["clip_fraction"] == 0.0


def test_a_ratio_past_floats_range_gives_no_nan_loss_or_gradient():
    # An old logprob of -100 where the policy now gives ~0: e^100 overflows float32, and token 0's
    # zero advantage made 0 · inf = NaN. Along exp's tangent token 0 weighs 0 and token 1 gives -1.
    new = torch.tensor([[0.0, -0.1]], requires_grad=True)
    loss, metrics = ppo_policy_loss(new, torch.tensor([[-100.0, -0.1]]), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    close(loss, torch.tensor(-0.5))
    assert torch.isfinite(new.grad).all() and metrics["approx_kl"] == pytest.approx(0.5 * 100.0 ** 2 / 2)
    for old in (-float("inf"), -1e30):  # bounded at the ceiling: still no NaN
        new.grad = None
        loss, _ = ppo_policy_loss(new, torch.tensor([[old, -0.1]]), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2))
        loss.backward()
        close(loss, torch.tensor(-0.5))
        assert torch.isfinite(new.grad).all()


def test_a_negative_advantage_token_raised_past_the_limit_is_still_pushed_down():
    """The log ratio was clamped at 20 before exp: a token with A < 0 the policy had raised by more
    than 20 nats got no gradient at all, where the unclipped surrogate pushes it down hardest."""
    new = torch.tensor([[0.0]], requires_grad=True)
    loss, metrics = ppo_policy_loss(new, torch.tensor([[-25.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    loss.backward()
    close(loss, torch.tensor(math.exp(20.0) * 6.0))  # e^20 · (1 + 25 - 20), the tangent at 20
    close(new.grad, torch.tensor([[math.exp(20.0)]]))  # the tangent's slope: pushed down
    assert metrics["clip_fraction"] == 0.0
    # log r = 100: exp continues along its tangent at 20, so the value is finite and the gradient
    # still pulls the policy's logprob up towards the reference's
    logp = torch.tensor([[-100.0]], requires_grad=True)
    k3 = kl_estimate(logp, torch.tensor([[0.0]]), "k3")
    k3.sum().backward()
    close(k3, torch.tensor([[math.exp(20.0) * 81.0 - 1.0 - 100.0]]))
    close(logp.grad, torch.tensor([[1.0 - math.exp(20.0)]]))


@pytest.mark.parametrize("log_r", [-4.9, -24.9, -39.9])
def test_k3_pulls_back_tokens_far_above_the_reference(log_r):
    """log r = ref - logp far below 0: the policy gives the token e^24.9 times the reference's
    probability. k3 = e^lr - 1 - lr and d k3 / d logp = 1 - e^lr, by hand; a clamp at -20 made the
    value 19.0 and the gradient 0, so the KL term stopped pulling on exactly those tokens."""
    logp = torch.tensor([[-0.1]], requires_grad=True)
    k3 = kl_estimate(logp, torch.tensor([[-0.1 + log_r]]), "k3")
    k3.sum().backward()
    close(k3, torch.tensor([[math.exp(log_r) - 1.0 - log_r]]), atol=1e-4, rtol=0)
    close(logp.grad, torch.tensor([[1.0 - math.exp(log_r)]]))


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(aggregate(loss, mask, "token-mean"), torch.tensor(10 / 4))
    close(aggregate(loss, mask, "seq-mean-token-mean"), torch.tensor((2.0 + 4.0) / 2))
    close(aggregate(loss, mask, "seq-mean-token-sum"), torch.tensor((6.0 + 4.0) / 2))


def test_kl_estimators():
    logp, ref = torch.zeros(1, 1), torch.log(torch.tensor([[0.5]]))
    # log r = log 0.5 = -0.693147
    close(kl_estimate(logp, ref, "k1"), torch.tensor([[0.693147]]), atol=1e-6, rtol=0)
    close(kl_estimate(logp, ref, "k2"), torch.tensor([[0.240227]]), atol=1e-6, rtol=0)
    close(kl_estimate(logp, ref, "k3"), torch.tensor([[0.193147]]), atol=1e-6, rtol=0)
    assert kl_estimate(ref, ref, "k3").item() == 0.0


def test_entropy_and_value_loss():
    close(entropy_from_logits(torch.zeros(1, 1, 4)), torch.tensor([[math.log(4)]]))
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 1.0]])
    # token 0: max((1-0)^2, (0.7-0)^2) = 1; token 1: (0-1)^2 = 1 → 0.5 * mean = 0.5
    close(value_loss(values, old, returns, torch.ones(1, 2), clip=0.2), torch.tensor(0.5))
