"""Chapter 03b exercises, solved and checked: the score-function estimator of a categorical policy's gradient,
the Horvitz-Thompson estimator and its Poisson variance, PPO's clipped per-token objective, and one Adam step
(whose mean over pruning draws is not the step of the mean gradient).

Each check compares the piece with autograd, with ``dppo_core.grpo.policy_loss``, with ``torch.optim.AdamW``, or
with an exact sum over every keep pattern (2^N of them, N small): no sampling decides a check except exercise 1's
Monte Carlo mean, whose tolerance is five standard errors measured on the same draws.

Run: python notebooks/solutions/ch03b_estimation.py   (seconds, no model; tests/test_solutions.py runs it too)
"""

from __future__ import annotations

import itertools
import math

import torch

from dppo_core.grpo import policy_loss

# --------------------------------------------------------------------------------------------------
# Exercise 1: the score-function (REINFORCE) estimator, with a baseline
# --------------------------------------------------------------------------------------------------


def score_function_gradient(logits: torch.Tensor, rewards: torch.Tensor, samples: torch.Tensor,
                            baseline: float = 0.0) -> torch.Tensor:
    """The Monte Carlo estimate of ∇_logits E_{o~π}[r(o)] for π = softmax(logits) over K answers:
    mean over the samples o of (r(o) - b) ∇ log π(o), where ∇_logits log π(o) = onehot(o) - π. Shape (K,)."""
    pi = torch.softmax(logits, 0)
    score = torch.nn.functional.one_hot(samples, logits.numel()).to(pi.dtype) - pi   # (M, K)
    return ((rewards[samples] - baseline)[:, None] * score).mean(0)


def exercise_1(score_function_gradient=score_function_gradient) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=gen, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    pi = torch.softmax(logits, 0)
    # On any fixed samples it must be the gradient of the surrogate mean_j (r_j - b) log π(o_j): exact, by autograd.
    samples = torch.multinomial(pi, 50, replacement=True, generator=gen)
    for b in (0.0, 0.4):
        theta = logits.clone().requires_grad_(True)
        surrogate = ((rewards[samples] - b) * torch.log_softmax(theta, 0)[samples]).mean()
        by_autograd, = torch.autograd.grad(surrogate, theta)
        assert torch.allclose(score_function_gradient(logits, rewards, samples, b), by_autograd), \
            f"with baseline {b}: not the gradient of mean((r - b) log pi(o)) on the same samples"
    # Its mean is the exact gradient of J = sum_k pi_k r_k, with or without a baseline (five standard errors).
    theta = logits.clone().requires_grad_(True)
    exact, = torch.autograd.grad((torch.softmax(theta, 0) * rewards).sum(), theta)
    many = torch.multinomial(pi, 40_000, replacement=True, generator=gen)
    J = float((pi * rewards).sum())
    for b in (0.0, J):
        per_sample = (rewards[many] - b)[:, None] * (torch.nn.functional.one_hot(many, 6).double() - pi)
        se = per_sample.std(0) / math.sqrt(len(many))
        estimate = score_function_gradient(logits, rewards, many, b)
        assert ((estimate - exact).abs() <= 5 * se + 1e-12).all(), f"baseline {b}: the mean is off the exact gradient"
    print(f"score-function gradient == autograd of the surrogate; its mean over {len(many)} samples matches the "
          f"exact gradient with b = 0 and b = J = {J:.3f}")


# --------------------------------------------------------------------------------------------------
# Exercise 2: Horvitz-Thompson, checked over every keep pattern
# --------------------------------------------------------------------------------------------------


def horvitz_thompson(y: torch.Tensor, p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Σ over the kept items of y_i / p_i (``keep`` a 0/1 or bool tensor shaped like y)."""
    return (keep.to(y.dtype) * y / p).sum()


def poisson_variance(y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The variance of the Horvitz-Thompson sum when item i is kept with probability p_i, independently:
    Σ_i (1 - p_i) / p_i · y_i²."""
    return ((1 - p) / p * y**2).sum()


def exercise_2(horvitz_thompson=horvitz_thompson, poisson_variance=poisson_variance) -> None:
    gen = torch.Generator().manual_seed(2)
    for n in (4, 7):
        y = torch.randn(n, generator=gen, dtype=torch.float64) * 3
        p = 0.05 + 0.95 * torch.rand(n, generator=gen, dtype=torch.float64)
        mean = second = 0.0
        for pattern in itertools.product([0, 1], repeat=n):           # every one of the 2^n keep patterns
            keep = torch.tensor(pattern, dtype=torch.float64)
            prob = float(torch.where(keep == 1, p, 1 - p).prod())
            value = float(horvitz_thompson(y, p, keep))
            mean += prob * value
            second += prob * value**2
        assert math.isclose(mean, float(y.sum()), rel_tol=1e-9, abs_tol=1e-9), "E[estimate] is not Σ y: biased"
        assert math.isclose(second - mean**2, float(poisson_variance(y, p)), rel_tol=1e-7), \
            "poisson_variance does not match the variance over every keep pattern"
    everything = torch.ones(5, dtype=torch.float64)                   # keep everything: no randomness left
    assert float(poisson_variance(torch.arange(5.0, dtype=torch.float64), everything)) == 0.0
    print(f"Horvitz-Thompson: E = Σ y and Var = Σ (1 - p)/p y² over all 2^{n} patterns "
          f"(last case: Σ y = {float(y.sum()):.3f}, Var = {float(poisson_variance(y, p)):.3f})")


# --------------------------------------------------------------------------------------------------
# Exercise 3: the clipped per-token objective
# --------------------------------------------------------------------------------------------------


def clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, epsilon: float = 0.2) -> torch.Tensor:
    """Per token: min(ρ A, clip(ρ, 1 - ε, 1 + ε) A), shaped like ``ratio`` (``adv`` broadcasts). It is maximised;
    the loss is its negative."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon) * adv)


def exercise_3(clipped_objective=clipped_objective) -> None:
    ratios = torch.tensor([0.5, 0.79, 0.85, 1.0, 1.1, 1.21, 1.6, 0.6, 0.95, 1.05, 1.3, 2.0], dtype=torch.float64)
    advs = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.5, -1.5, -1.5, -1.5, -0.5], dtype=torch.float64)
    for epsilon in (0.2, 0.1):
        for rho, a in zip(ratios, advs, strict=True):                 # one token at a time, value and gradient
            logp = rho.log().reshape(1, 1).requires_grad_(True)
            mine = clipped_objective(logp.exp(), a, epsilon)
            package, _ = policy_loss(logp, a.reshape(1), torch.ones(1, 1, dtype=torch.float64),
                                     old_logprobs=torch.zeros(1, 1, dtype=torch.float64), epsilon=epsilon)
            assert torch.allclose(mine.sum(), -package), f"rho={rho:.2f}, A={a:+.1f}, eps={epsilon}: value"
            g_mine, = torch.autograd.grad(mine.sum(), logp)
            g_package, = torch.autograd.grad(-package, logp)
            assert torch.allclose(g_mine, g_package), f"rho={rho:.2f}, A={a:+.1f}, eps={epsilon}: gradient"
    # the flat regions: no gradient beyond 1 + eps when A > 0 and below 1 - eps when A < 0, exactly there
    logr = ratios.log().requires_grad_(True)
    grad, = torch.autograd.grad(clipped_objective(logr.exp(), advs, 0.2).sum(), logr)
    flat = ((ratios > 1.2) & (advs > 0)) | ((ratios < 0.8) & (advs < 0))
    assert bool((grad[flat] == 0).all()) and bool((grad[~flat] != 0).all()), "the gradient vanishes in the wrong places"
    print(f"clipped objective == -policy_loss per token (values and gradients); flat on {int(flat.sum())} of "
          f"{len(ratios)} tokens at eps = 0.2")


# --------------------------------------------------------------------------------------------------
# Exercise 4: one Adam step, and why a pruned gradient's mean step is not the step of the mean
# --------------------------------------------------------------------------------------------------


def adam_step(grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, lr: float = 1e-3,
              betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam's t-th step (t >= 1) from moments m, v (AdamW without weight decay, betas as DPPOTrainer's); returns
    (the parameter change, new m, new v).
    m' = β1 m + (1 - β1) g, v' = β2 v + (1 - β2) g², change = -lr · (m'/(1 - β1^t)) / (√(v'/(1 - β2^t)) + eps).
    ``grad`` may carry leading batch dimensions (one step per row, from the same state)."""
    b1, b2 = betas
    m_new = b1 * m + (1 - b1) * grad
    v_new = b2 * v + (1 - b2) * grad**2
    change = -lr * (m_new / (1 - b1**t)) / ((v_new / (1 - b2**t)).sqrt() + eps)
    return change, m_new, v_new


def exercise_4(adam_step=adam_step) -> None:
    gen = torch.Generator().manual_seed(4)
    D = 10
    history = torch.randn(5, D, generator=gen, dtype=torch.float64)
    # Against torch.optim.AdamW (no weight decay), step by step from zero moments.
    param = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)   # the trainer's
    m = v = torch.zeros(D, dtype=torch.float64)
    for t, g in enumerate(history, start=1):
        before = param.detach().clone()
        param.grad = g.clone()
        opt.step()
        change, m, v = adam_step(g, m, v, t)
        assert torch.allclose(param.detach() - before, change, rtol=1e-6, atol=1e-12), f"step {t}: not Adam's"
    # A pruned gradient: item i of N kept with probability q_i and weighted 1/q_i. Every pattern, exactly.
    N = 8
    items = torch.randn(N, D, generator=gen, dtype=torch.float64)
    q = torch.tensor([0.9, 0.3, 0.5, 0.7, 0.2, 0.6, 0.4, 0.8], dtype=torch.float64)
    g = items.sum(0)
    patterns = torch.tensor(list(itertools.product([0.0, 1.0], repeat=N)), dtype=torch.float64)   # (2^N, N)
    prob = torch.where(patterns == 1, q, 1 - q).prod(1)                                            # (2^N,)
    g_hat = (patterns / q) @ items                                                                 # (2^N, D)
    assert torch.allclose(prob @ g_hat, g), "the pruned gradient should be unbiased (check the set-up)"
    t = len(history) + 1
    mean_change = prob @ adam_step(g_hat, m, v, t)[0]
    change_of_mean = adam_step(g, m, v, t)[0]
    gap = float((mean_change - change_of_mean).norm() / change_of_mean.norm())
    shrink = float(mean_change.norm() / change_of_mean.norm())
    assert gap > 0.05, "E[Adam step of the pruned gradient] should differ from the Adam step of E[gradient]"
    assert shrink < 1, "the noise in v' should make the mean step shorter"
    print(f"adam_step == torch.optim.AdamW; over all {len(prob)} keep patterns: |E[step(g_hat)] - step(g)| = "
          f"{gap:.2f} |step(g)|, |E[step]| = {shrink:.2f} |step(g)|")


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    exercise_4()
    print("chapter 03b solutions: all checks passed")


if __name__ == "__main__":
    main()
