"""Chapter 06 exercises, solved and checked: fixed-size draws, the floor, uniform pruning against
pruning by |A|, and the keep probabilities that minimise the variance under a token budget.

Run: python dppo_core/assets/course/solutions/ch06_completion_pruning.py   (seconds, no model: rewards are
synthetic and each completion's gradient is stood in for by a number s; tests/course/test_solutions.py runs it
too)
"""

from __future__ import annotations

import torch

from dppo_core.grpo import group_advantages
from dppo_core.pruning import completion_keep_probs, importance_weights, keep_probs_from_scores, sample_keep

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Call sample_keep once per draw with the generator passed in, weight by importance_weights (0 where "
        "not kept), and count the kept completions per group."),
    2: ("Sum only over the completions with s != 0 (their p may be 0) and divide by the absolute value of "
        "the full sum of s, not by the number of completions."),
    3: ("Divide kept by the number of completions with A != 0, not by all P * G of them, and leave p at "
        "exactly 0 where A == 0."),
    4: ("Fit each group on its own: score by |s| / sqrt(length), and pass zero=(A == 0) and costs=lengths to "
        "keep_probs_from_scores so the budget counts tokens."),
}

P, G = 16, 8


def synthetic_batch(seed: int = 0):
    """0/1 rewards of P groups of G, their advantages, and s: each completion's gradient along the full-batch
    gradient (as in the chapter's section 4), so that sum s > 0.

    |s| is |A| times a positive factor (the completion's length, how sure the model already was): |A| is a
    proxy for |s|, not |s|. Most completions push along the full gradient, a quarter against it.
    """
    gen = torch.Generator().manual_seed(seed)
    success = torch.rand(P, 1, generator=gen, dtype=torch.float64)
    rewards = (torch.rand(P, G, generator=gen, dtype=torch.float64) < success).double()
    A = group_advantages(rewards).double()
    factor = 0.5 + torch.rand(P, G, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(P, G, generator=gen) < 0.75, 1.0, -1.0).double()
    return A, A.abs() * factor * sign


def exact_std(p: torch.Tensor, s: torch.Tensor) -> float:
    """Std of sum K s / p over independent draws (over the completions with s != 0, where p > 0), relative to
    sum s: sqrt(sum (1/p - 1) s^2) / |sum s|."""
    nz = s != 0
    return ((1 / p[nz] - 1) * s[nz] ** 2).sum().sqrt().item() / abs(s.sum().item())


# --------------------------------------------------------------------------------------------------
# Exercise 1: fixed-size sampling is unbiased too, and less noisy
# --------------------------------------------------------------------------------------------------

def pruned_estimates(p: torch.Tensor, s: torch.Tensor, draws: int, fixed_size: bool,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``draws`` pruning draws of the (P, G) keep probabilities p, one sample_keep(p, gen, fixed_size) call
    each: (the estimates sum K s / p of sum s, shape (draws,); how many completions each group kept, (draws,
    P))."""
    est, counts = [], []
    for _ in range(draws):
        keep = sample_keep(p, gen, fixed_size=fixed_size)
        w = importance_weights(torch.ones(p.shape[0]), p, keep)      # 1/p where kept, 0 elsewhere
        est.append((w * s).sum())
        counts.append(keep.sum(1))
    return torch.stack(est), torch.stack(counts)


def exercise_1(pruned_estimates=pruned_estimates, draws: int = 2000) -> None:
    A, s = synthetic_batch()
    p = completion_keep_probs(A, 0.5)                           # proportional, per group
    full = s.sum().item()
    results = {}
    for name, fixed in (("Bernoulli", False), ("fixed size", True)):
        est, counts = pruned_estimates(p, s, draws, fixed, torch.Generator().manual_seed(1))
        est = est.double() / full
        assert est.shape == (draws,) and counts.shape == (draws, P)
        results[name] = (est.mean().item(), est.std().item(), counts)
        assert abs(est.mean().item() - 1) < 4 * est.std().item() / draws**0.5      # centred on the full batch
    for name, (mean, std, counts) in results.items():
        print(f"{name:<10} mean {mean:.3f}  std {std:.3f}  distinct per-group kept counts over the draws: "
              f"{len({tuple(c.tolist()) for c in counts})}")
    # Coin flips: the spread is the exact one, sqrt(sum (1/p - 1) s^2) (4 standard errors of a std estimate).
    assert abs(results["Bernoulli"][1] - exact_std(p, s)) < 4 * exact_std(p, s) / (2 * draws) ** 0.5
    assert results["fixed size"][1] < results["Bernoulli"][1]
    # Every group's sum of p is an integer here, so the fixed-size design keeps exactly that many each draw.
    assert torch.allclose(p.sum(1), p.sum(1).round())
    assert ((results["fixed size"][2] == p.sum(1).round()).all()
            and results["Bernoulli"][2].unique().numel() > 1)
    print(f"exact std for coin flips {exact_std(p, s):.3f} (the Monte Carlo above: "
          f"{results['Bernoulli'][1]:.3f})")


# --------------------------------------------------------------------------------------------------
# Exercise 2: what the floor is for
# --------------------------------------------------------------------------------------------------

def exercise_2(exact_std=exact_std) -> None:
    A, s = synthetic_batch()
    # First the formula, against 20000 coin-flip draws (4 standard errors of a std estimate):
    p = completion_keep_probs(A, 0.75)
    K = sample_keep(p.expand(20000, -1, -1), torch.Generator().manual_seed(3))
    mc = ((K * importance_weights(torch.ones(P), p) * s).sum((1, 2)) / s.sum()).std().item()
    assert abs(exact_std(p, s) - mc) < 4 * mc / 40000**0.5, (exact_std(p, s), mc)
    # A second s for which |A| is a useless proxy: every completion with A != 0 has the same |s|.
    s_flat = torch.where(A != 0, s.sign() * s[s != 0].abs().mean(), torch.zeros_like(s))
    print("floor   max weight   std, |s| ~ |A| x noise   std, all |s| equal")
    stds, w_max = {}, {}
    for floor in (0.1, 0.02):
        p = completion_keep_probs(A, 0.9, min_keep_prob=floor)
        w_max[floor] = (1 / p[p > 0]).max().item()
        stds[floor] = (exact_std(p, s), exact_std(p, s_flat))
        print(f"{floor:>5}   {w_max[floor]:>10.1f}   {stds[floor][0]:>22.3f}   {stds[floor][1]:>18.3f}")
        assert w_max[floor] <= 1 / floor + 1e-9                 # the floor caps every weight at 1 / floor
    assert w_max[0.02] > w_max[0.1]
    # When |A| tracks the gradient, a lower floor lets p follow |A| more closely and the estimate gets *less*
    # noisy; when it does not, the completions pushed to low p carry large weights and the variance grows. The
    # floor bounds the damage of a bad proxy (and keeps every completion with A != 0 possible: unbiased).
    assert stds[0.02][0] < stds[0.1][0] and stds[0.02][1] > stds[0.1][1]


# --------------------------------------------------------------------------------------------------
# Exercise 3: uniform pruning (still weighted) against pruning by |A|
# --------------------------------------------------------------------------------------------------

def uniform_probs(A: torch.Tensor, kept: float) -> torch.Tensor:
    """(P, G) keep probabilities: 0 where A == 0, the same value for every completion with A != 0, chosen so
    that kept completions are expected in all."""
    nz = A != 0
    return torch.where(nz, torch.full_like(A, kept / nz.sum().item()), torch.zeros_like(A))


def exercise_3(uniform_probs=uniform_probs) -> None:
    A, s = synthetic_batch()
    nz = A != 0
    for rate in (0.25, 0.5, 0.75):
        p_prop = completion_keep_probs(A, rate)
        kept = p_prop.sum().item()
        p_uniform = uniform_probs(A, kept)
        assert p_uniform.shape == A.shape and (p_uniform[~nz] == 0).all()
        assert (p_uniform[nz] == p_uniform[nz][0]).all() and p_uniform.max() <= 1
        assert abs(p_uniform.sum().item() - kept) < 1e-9             # the same expected number trained
        # Both are unbiased: E[sum K w s] = sum p (1/p) s = sum s, whatever p > 0 is.
        for p in (p_prop, p_uniform):
            assert torch.isclose((p * importance_weights(torch.ones(P), p) * s).sum(), s.sum())
        u, prop = exact_std(p_uniform, s), exact_std(p_prop, s)
        print(f"r = {rate}: {kept:.1f} kept of {int(nz.sum())} with A != 0 | std uniform {u:.3f}, by |A| "
              f"{prop:.3f}")
        assert prop < u
    # Using |A| buys precision at no bias: at equal cost, it spends the budget where the gradient is.


# --------------------------------------------------------------------------------------------------
# Exercise 4: variance per token
# --------------------------------------------------------------------------------------------------

def oracle_probs(s: torch.Tensor, A: torch.Tensor, lengths: torch.Tensor, rate: float,
                 floor: float) -> torch.Tensor:
    """The variance-optimal p under each group's token budget: minimise sum s^2 / p subject to sum p * len =
    (1 - r) * the group's tokens and floor <= p <= 1. Lagrange: s^2 / p^2 = lambda * len, so p = clip(c |s| /
    sqrt(len), floor, 1), with c set by the budget: the length scheme's fit, on |s| itself."""
    out = torch.empty_like(s)
    for q in range(s.shape[0]):
        out[q] = keep_probs_from_scores(s[q].abs() / lengths[q].sqrt(), rate, min_keep_prob=floor,
                                        zero=A[q] == 0, costs=lengths[q])
    return out


def exercise_4(oracle_probs=oracle_probs) -> None:
    rate, floor = 0.5, 0.02
    A, s = synthetic_batch()
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(8, 65, A.shape, generator=gen).double()      # tokens of each completion
    # two worlds: a completion's gradient size does not depend on its length, or shrinks like 1 / sqrt(len)
    # (a per-sequence token mean of independent token gradients)
    for world, grad in (("|s| ~ |A|", s), ("|s| ~ |A| / sqrt(len)", s / lengths.sqrt() * 6)):
        stds, tokens = {}, {}
        for gamma in (0.0, 0.5, 1.0):
            p = completion_keep_probs(A, rate, scheme="length", lengths=lengths, length_exponent=gamma,
                                      min_keep_prob=floor)
            stds[gamma], tokens[gamma] = exact_std(p, grad), (p * lengths).sum().item()
        p_best = oracle_probs(grad, A, lengths, rate, floor)
        best = exact_std(p_best, grad)
        # The optimum's conditions: each group's token budget, p in [floor, 1] (0 where A == 0), and
        # Lagrange's p sqrt(len) / |s| equal for every completion strictly between floor and 1 in a group.
        budget = (1 - rate) * lengths.sum(1)
        assert torch.allclose((p_best * lengths).sum(1)[(A != 0).any(1)], budget[(A != 0).any(1)], rtol=1e-6)
        assert (p_best[A == 0] == 0).all() and (p_best[A != 0] >= floor - 1e-12).all() and (p_best <= 1).all()
        for q in range(P):
            inside = (p_best[q] > floor + 1e-9) & (p_best[q] < 1 - 1e-9)
            ratio = p_best[q][inside] * lengths[q][inside].sqrt() / grad[q][inside].abs()
            assert inside.sum() < 2 or torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-6), q
        print(f"{world:>22}: exact std / |sum s| at {tokens[0.5]:.0f} expected tokens: "
              + ", ".join(f"gamma {g:g}: {v:.3f}" for g, v in stds.items()) + f"; oracle {best:.3f}")
        assert max(tokens.values()) - min(tokens.values()) < 1e-6 * tokens[0.5]      # the same budget for all
        assert best <= min(stds.values()) + 1e-12                                  # nothing beats the optimum
        winner = min(stds, key=stds.get)
        assert winner == (0.5 if world == "|s| ~ |A|" else 1.0), (world, stds)
    # At the same expected tokens, p ∝ |A| / len^gamma wins with gamma = 1/2 when the gradient's size does not
    # depend on the length, and with gamma = 1 when it shrinks like 1 / sqrt(len). Which world the tiny model
    # lives in is what benchmarks/variance_cost.py measures on its real gradients (gamma = 1 won there).


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    exercise_4()
    print("chapter 06 solutions: all checks passed")


if __name__ == "__main__":
    main()
