"""Chapter 03 exercises, solved and checked: the k3 KL estimator, Dr. GRPO's advantages, and why the
loss normaliser must be constant once completions are pruned.

Run: python dppo_core/assets/course/solutions/ch03_grpo.py   (seconds, no model;
tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import itertools
import math

import torch

from dppo_core.grpo import group_advantages, kl_k3, policy_loss

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Take d = ref_logp - logp (in that order) and keep the - d term: e^d - d - 1 is never negative, "
        "while e^d - 1 alone can be."),
    2: ("Work along each group (dim=1, keepdim=True) with the population std (unbiased=False) plus 1e-4; "
        "with scale='none' only subtract the mean."),
    3: ("A pattern's probability multiplies p[i] for each kept item and 1 - p[i] for each dropped one; sum "
        "it times value_of_draw over all 2^N tuples of bools."),
}

# --------------------------------------------------------------------------------------------------
# Exercise 1: the k3 estimator of KL(pi || ref)
# --------------------------------------------------------------------------------------------------


def my_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per token: r - log r - 1 with r = ref / pi, computed in log space (d = log r)."""
    d = ref_logp - logp
    return d.exp() - d - 1


def exercise_1(my_k3=my_k3) -> None:
    gen = torch.Generator().manual_seed(0)
    logp, ref = -3 * torch.rand(4, 7, generator=gen), -3 * torch.rand(4, 7, generator=gen)
    assert torch.allclose(my_k3(logp, ref), kl_k3(logp, ref))
    assert (my_k3(logp, ref) >= 0).all()                      # e^d >= 1 + d: every token's estimate is >= 0
    # Unbiased: over tokens sampled from pi, E[k3] is exactly KL(pi || ref). Exactly, on a 10-token
    # vocabulary:
    pi = torch.softmax(torch.randn(10, generator=gen, dtype=torch.float64), 0)
    rf = torch.softmax(torch.randn(10, generator=gen, dtype=torch.float64), 0)
    expected_k3 = (pi * my_k3(pi.log(), rf.log())).sum()      # = sum ref - 1 + sum pi log(pi / ref)
    kl = (pi * (pi / rf).log()).sum()
    assert torch.isclose(expected_k3, kl)
    # In the loss: beta * k3 is added per token, then averaged like the surrogate (mean over each completion's
    # tokens, weighted sum over completions, / num_sequences).
    N, T, beta = 4, 7, 0.1
    mask = torch.ones(N, T)
    mask[1, 4:] = 0
    adv = torch.randn(N, generator=gen)
    without, _ = policy_loss(logp, adv, mask, num_sequences=N)
    with_kl, stats = policy_loss(logp, adv, mask, ref_logprobs=ref, beta=beta, num_sequences=N)
    per_seq_kl = (my_k3(logp, ref) * mask).sum(1) / mask.sum(1)
    assert torch.isclose(with_kl - without, beta * per_seq_kl.sum() / N)
    print(f"k3 == dppo_core.grpo.kl_k3; E_pi[k3] = KL = {kl.item():.4f}; in policy_loss: + beta * mean k3 "
          f"(token-mean kl stat {stats['kl'].item():.3f})")


# --------------------------------------------------------------------------------------------------
# Exercise 2: Dr. GRPO (scale_rewards="none") against GRPO's group scaling
# --------------------------------------------------------------------------------------------------


def my_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """(num_prompts, G) rewards -> advantages: r - mean, divided by (population std + 1e-4) when scale ==
    "group"."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    return centred / (centred.pow(2).mean(dim=1, keepdim=True).sqrt() + 1e-4)


def exercise_2(my_advantages=my_advantages) -> None:
    one_right = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]])
    half_right = torch.tensor([[1.0, 1, 1, 1, 0, 0, 0, 0]])
    eps = 1e-4
    # By hand: mean 1/8, population std sqrt(7)/8.
    std = math.sqrt(7) / 8
    group_by_hand = torch.tensor([[7 / 8 / (std + eps)] + [-1 / 8 / (std + eps)] * 7])
    none_by_hand = torch.tensor([[7 / 8] + [-1 / 8] * 7])
    assert torch.allclose(my_advantages(one_right, "group"), group_by_hand)
    assert torch.allclose(my_advantages(one_right, "none"), none_by_hand)
    many = torch.randint(0, 2, (16, 8), generator=torch.Generator().manual_seed(2)).float()
    for scale in ("group", "none"):                  # the package computes the same on any batch of groups
        assert torch.allclose(my_advantages(many, scale), group_advantages(many, scale), atol=1e-5)
    g1, g4 = group_advantages(one_right)[0, 0].item(), group_advantages(half_right)[0, 0].item()
    n1, n4 = (group_advantages(one_right, "none")[0, 0].item(),
              group_advantages(half_right, "none")[0, 0].item())
    print(f"the right answer's A: 1 of 8 right -> group {g1:.3f}, none {n1:.3f}; "
          f"4 of 8 -> group {g4:.3f}, none {n4:.3f}")
    # Dividing by the group's std scales a rare success up (sqrt(7) ~ 2.65 vs 1): hard prompts, where one
    # sample of eight is right, get larger updates per completion than prompts at 50%. Dr. GRPO drops the
    # division, so every group's advantages are on the reward's own scale.
    assert g1 > 2.6 and abs(g4 - 1) < 1e-3 and math.isclose(n1, 0.875) and math.isclose(n4, 0.5)


# --------------------------------------------------------------------------------------------------
# Exercise 3: under random pruning, which normaliser keeps the loss unbiased?
# --------------------------------------------------------------------------------------------------


def exact_expectation(p: torch.Tensor, value_of_draw) -> float:
    """E[value_of_draw(keep)] when item i is kept with probability p[i], independently: the sum over all
    2^N keep patterns (tuples of bools) of the pattern's probability times its value."""
    total = 0.0
    for keep in itertools.product([False, True], repeat=len(p)):
        prob = math.prod(p[i].item() if k else 1 - p[i].item() for i, k in enumerate(keep))
        total += prob * value_of_draw(keep)
    return total


def exercise_3(exact_expectation=exact_expectation) -> None:
    # Checked on a case whose answer is known first: E[number kept] = sum p, E[all kept] = prod p.
    q = torch.tensor([0.3, 0.5, 0.9], dtype=torch.float64)
    assert math.isclose(exact_expectation(q, sum), q.sum().item(), rel_tol=1e-9)
    assert math.isclose(exact_expectation(q, lambda keep: float(all(keep))), q.prod().item(), rel_tol=1e-9)
    gen = torch.Generator().manual_seed(1)
    N, T = 6, 5
    # ratio != 1: clipping active
    logp, old = -torch.rand(N, T, generator=gen), -torch.rand(N, T, generator=gen)
    adv = torch.randn(N, generator=gen, dtype=torch.float32)
    mask = torch.ones(N, T)
    mask[0, 3:] = 0
    mask[4, 2:] = 0
    p = torch.tensor([0.9, 0.5, 0.3, 1.0, 0.6, 0.2], dtype=torch.float64)   # keep probabilities

    def loss(keep, **kw):
        idx = [i for i in range(N) if keep[i]]
        if not idx:
            return 0.0
        w = (1 / p[idx]).float()
        value, _ = policy_loss(logp[idx], adv[idx], mask[idx], old_logprobs=old[idx], weights=w, **kw)
        return value.item()

    # The full-batch values (no pruning, every weight 1) that each pruned estimator should average to:
    full = {"grpo, C = N": policy_loss(logp, adv, mask, old_logprobs=old, num_sequences=N)[0].item(),
            "grpo, C = kept count": policy_loss(logp, adv, mask, old_logprobs=old, num_sequences=N)[0].item(),
            "dapo, kept tokens": policy_loss(logp, adv, mask, old_logprobs=old, loss_type="dapo")[0].item(),
            "dapo, all rolled-out tokens": policy_loss(logp, adv, mask, old_logprobs=old,
                                                       loss_type="dapo")[0].item()}
    expected = {                                                        # every one of the 2^N draws, exactly
        "grpo, C = N": exact_expectation(p, lambda keep: loss(keep, num_sequences=N)),
        "grpo, C = kept count": exact_expectation(
            p, lambda keep: loss(keep, num_sequences=sum(keep)) if any(keep) else 0.0),
        "dapo, kept tokens": exact_expectation(p, lambda keep: loss(keep, loss_type="dapo")),
        "dapo, all rolled-out tokens": exact_expectation(
            p, lambda keep: loss(keep, loss_type="dapo", num_tokens=int(mask.sum())))}
    for name in full:
        print(f"{name:<28} full batch {full[name]:+.5f}   E[pruned, weighted] {expected[name]:+.5f}")
    assert math.isclose(expected["grpo, C = N"], full["grpo, C = N"], rel_tol=1e-5)             # unbiased
    assert math.isclose(expected["dapo, all rolled-out tokens"], full["dapo, all rolled-out tokens"],
                        rel_tol=1e-5)
    assert not math.isclose(expected["grpo, C = kept count"], full["grpo, C = kept count"],
                            rel_tol=1e-2)  # ratio
    assert not math.isclose(expected["dapo, kept tokens"], full["dapo, kept tokens"], rel_tol=1e-2)


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 03 solutions: all checks passed")


if __name__ == "__main__":
    main()
