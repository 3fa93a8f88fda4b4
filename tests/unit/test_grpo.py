"""GRPO's advantages and loss against hand-computed values."""

import math

import pytest
import torch

from dppo_core.grpo import group_advantages, kl_k3, policy_loss, token_logprobs

# Only the two tests that reduce float32 tensors of random values (or take a softmax) are marked `numerics`; the
# others compare a few hand-computed values at tolerances far above rounding (all-equal groups: A = 0 by a test of
# max == min, not by the mean's rounding).


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = group_advantages(r, "group", eps=0.0 + 1e-12)
    # group 0: mean 0.5, population std 0.5 -> +-1; group 1: zero std -> 0
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(group_advantages(r, "none"), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0.0]]))
    batch_std = r.std(unbiased=False).item()
    assert torch.allclose(group_advantages(r, "batch", eps=0.0), group_advantages(r, "none") / batch_std)


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="num_prompts, G"):
        group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.ones(2, 2), "sequence")


def test_loss_by_hand_one_epoch():
    """With old = current the ratio is 1: loss = -(1/N) sum_i A_i for loss_type grpo."""
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = policy_loss(lp, adv, mask)
    assert math.isclose(loss.item(), -(2.0 - 1.0) / 2)
    loss.backward()
    # d loss / d logp_t = -A_i / (|o_i| N) on real tokens, 0 on padding
    expected = torch.tensor([[-2 / 2 / 2, -2 / 2 / 2, 0.0], [1 / 3 / 2] * 3])
    assert torch.allclose(lp.grad, expected)
    assert stats["clip_fraction"].item() == 0.0


def test_clipping_by_hand():
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    # A > 0: token 0 clipped at 1.2, token 1 unclipped (min picks 0.5) -> per-token -(1.2, 0.5)
    loss, stats = policy_loss(lp, torch.tensor([1.0]), mask, old_logprobs=old, epsilon=0.2)
    assert math.isclose(loss.item(), -(1.2 + 0.5) / 2, rel_tol=1e-6)
    assert math.isclose(stats["clip_fraction"].item(), 0.5)
    # epsilon_high widens the upper bound only
    loss_hi, _ = policy_loss(lp, torch.tensor([1.0]), mask, old_logprobs=old, epsilon=0.2, epsilon_high=0.28)
    assert math.isclose(loss_hi.item(), -(1.28 + 0.5) / 2, rel_tol=1e-6)
    # A < 0: token 1 clipped at 0.8 -> -min(-1.5, -1.2)=1.5 ; -min(-0.5, -0.8)=0.8
    loss_neg, _ = policy_loss(lp, torch.tensor([-1.0]), mask, old_logprobs=old, epsilon=0.2)
    assert math.isclose(loss_neg.item(), (1.5 + 0.8) / 2, rel_tol=1e-6)


def test_kl_term_by_hand():
    lp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -2.0]])
    k = kl_k3(lp, ref)
    assert torch.allclose(k, torch.tensor([[0.0, math.exp(-1) + 1 - 1]]))
    loss, stats = policy_loss(lp, torch.tensor([0.0]), torch.ones(1, 2), ref_logprobs=ref, beta=0.1)
    assert math.isclose(loss.item(), 0.1 * k.mean().item(), rel_tol=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, torch.tensor([0.0]), torch.ones(1, 2), beta=0.1)


def test_normalisers_by_loss_type():
    lp = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, 1.0])
    old = lp - 0.0
    g, _ = policy_loss(lp, adv, mask, old_logprobs=old, loss_type="grpo", num_sequences=8)
    d, _ = policy_loss(lp, adv, mask, old_logprobs=old, loss_type="dr_grpo", num_sequences=8,
                       max_completion_length=16)
    p, _ = policy_loss(lp, adv, mask, old_logprobs=old, loss_type="dapo")
    assert math.isclose(g.item(), -(1 + 1) / 8)
    assert math.isclose(d.item(), -(2 + 1) / (8 * 16))
    assert math.isclose(p.item(), -(2 + 1) / 3)
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(lp, adv, mask, loss_type="ppo")


@pytest.mark.numerics  # float32 reductions over differently laid-out batches, compared bit for bit and closely
def test_unit_weights_equal_plain_grpo_and_weights_scale_each_sequence():
    torch.manual_seed(0)
    lp = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[:, 0] = 1
    adv = torch.randn(6)
    old = lp + 0.1 * torch.randn(6, 5)
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        plain, _ = policy_loss(lp, adv, mask, old_logprobs=old, loss_type=loss_type)
        ones, _ = policy_loss(lp, adv, mask, old_logprobs=old, loss_type=loss_type, weights=torch.ones(6))
        assert torch.equal(plain, ones)
    # grpo: a weight of 3 on sequence 0 equals three copies of it with the normaliser held fixed
    w = torch.ones(6)
    w[0] = 3.0
    weighted, _ = policy_loss(lp, adv, mask, old_logprobs=old, weights=w, num_sequences=6)
    rep = [0, 0, 0, 1, 2, 3, 4, 5]
    copies, _ = policy_loss(lp[rep], adv[rep], mask[rep], old_logprobs=old[rep], num_sequences=6)
    assert torch.allclose(weighted, copies)


@pytest.mark.numerics  # log-softmax: vectorised exp/log and reductions, whose code differs with the CPU capability
def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    tokens = torch.randint(0, 11, (2, 3))
    for temp in (1.0, 0.7):
        expected = torch.log_softmax(logits / temp, -1).gather(-1, tokens[..., None]).squeeze(-1)
        assert torch.allclose(token_logprobs(logits, tokens, temp), expected, atol=1e-6)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_all_equal_groups_have_zero_advantage_at_any_reward_value(scale_rewards):
    # float32 means of 3.7 or 0.1 repeated miss them by a rounding; such a group must still have A = 0 exactly
    rewards = torch.tensor([[3.7] * 8, [0.1] * 8, [1 / 3] * 8, [-2.2] * 8, [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    adv = group_advantages(rewards, scale_rewards)
    assert torch.equal(adv[:4], torch.zeros(4, 8))
    assert (adv[4] != 0).all()
