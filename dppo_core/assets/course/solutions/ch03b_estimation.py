"""Chapter 03b exercises, solved and checked: the leave-one-out (RLOO) baseline, whose group estimator is
unbiased for the policy gradient; the Horvitz-Thompson estimator over two stages (prompts, then completions)
and its variance; PPO's clipped per-token objective with an asymmetric clip range (DAPO's clip-higher); and
one AdamW step with decoupled weight decay.

Each check compares the piece with autograd, with ``dppo_core.grpo.policy_loss``, with ``torch.optim.AdamW``,
or with an exact sum over every outcome (every group of answers, every keep pattern: few enough to list): no
sampling decides a check.

Run: python dppo_core/assets/course/solutions/ch03b_estimation.py   (seconds, no model;
tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import itertools
import math

import torch

from dppo_core.grpo import policy_loss

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Leave r_i out of its own baseline: subtract the mean of the other G - 1 rewards of its group, not "
        "the group mean that includes it."),
    2: ("Weight each kept y by 1 / (pi_q p_qi); in the variance the prompt coin acts on the squared group "
        "total Y_q, and the completion term is divided by pi_q."),
    3: ("Clip the ratio, not the product, into [1 - eps_low, 1 + eps_high] and take the minimum with the "
        "unclipped ratio * adv: for A < 0 it clips the low side."),
    4: ("Shrink the parameters by (1 - lr * weight_decay) outside the moments, update m and v with the "
        "gradient alone, and bias-correct both with t from 1."),
}

# --------------------------------------------------------------------------------------------------
# Exercise 1: the leave-one-out (RLOO) baseline
# --------------------------------------------------------------------------------------------------


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantages of groups of G rewards (last dimension): r_i minus the mean of the group's
    *other* G - 1 rewards, a baseline that does not depend on o_i. Shaped like ``rewards`` (G >= 2)."""
    g = rewards.shape[-1]
    others = (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)
    return rewards - others


def _group_expectation(pi: torch.Tensor, r: torch.Tensor, g: int, advantages) -> torch.Tensor:
    """E over every group of g answers from pi of (1/g) Σ_i A_i ∇log π(o_i), exactly (K^g groups)."""
    k = len(pi)
    groups = torch.tensor(list(itertools.product(range(k), repeat=g)))            # (K^g, g)
    prob = pi[groups].prod(1)                                                     # (K^g,)
    adv = advantages(r[groups])                                                   # (K^g, g)
    score = torch.nn.functional.one_hot(groups, k).to(pi.dtype) - pi              # (K^g, g, K)
    return prob @ (adv[:, :, None] * score).mean(1)


def exercise_1(rloo_advantages=rloo_advantages) -> None:
    gen = torch.Generator().manual_seed(0)
    for k, g in ((6, 3), (5, 4), (4, 5)):
        logits = torch.randn(k, generator=gen, dtype=torch.float64)
        r = (torch.rand(k, generator=gen, dtype=torch.float64) < 0.5).double()
        r[0], r[1] = 1.0, 0.0                                                     # some right, some wrong
        theta = logits.clone().requires_grad_(True)
        exact, = torch.autograd.grad((torch.softmax(theta, 0) * r).sum(), theta)
        pi = torch.softmax(logits, 0)
        rloo = _group_expectation(pi, r, g, rloo_advantages)
        assert torch.allclose(rloo, exact, rtol=1e-9, atol=1e-12), \
            f"K={k}, G={g}: E[(1/G) Σ A_i ∇log π(o_i)] is not ∇J: the baseline depends on o_i (or is off)"
        centred = _group_expectation(pi, r, g, lambda x: x - x.mean(-1, keepdim=True))
        assert torch.allclose(centred, (g - 1) / g * exact, rtol=1e-9, atol=1e-12)   # §1: a factor short
    # per group: the mean-centred advantage, rescaled by G/(G-1), on any rewards (not only 0/1)
    rewards = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    assert torch.allclose(rloo_advantages(rewards), 5 / 4 * (rewards - rewards.mean(-1, keepdim=True))), \
        "per group, the leave-one-out advantage is G/(G-1) times r_i - mean(r)"
    print("RLOO: E[(1/G) Σ_i (r_i - mean of the others) ∇log π(o_i)] = ∇J exactly, over every group "
          f"(up to {k}^{g} = {k ** g}); the group mean alone gives (G-1)/G ∇J")


# --------------------------------------------------------------------------------------------------
# Exercise 2: Horvitz-Thompson over two stages, checked over every keep pattern
# --------------------------------------------------------------------------------------------------


def two_stage_estimate(y: torch.Tensor, pi: torch.Tensor, p: torch.Tensor, keep_prompt: torch.Tensor,
                       keep_completion: torch.Tensor) -> torch.Tensor:
    """Σ over kept prompts q and kept completions i of y_qi / (π_q p_qi): y, p, keep_completion (P, G);
    pi, keep_prompt (P,) (0/1 or bool). A scalar tensor."""
    z = keep_prompt.to(y.dtype)[:, None] * keep_completion.to(y.dtype)
    return (z * y / (pi[:, None] * p)).sum()


def two_stage_variance(y: torch.Tensor, pi: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The variance of two_stage_estimate when prompt q is kept with probability π_q and, given that,
    completion i with probability p_qi, all coins independent: Σ_q [(1 - π_q)/π_q Y_q² + (1/π_q) Σ_i (1 -
    p_qi)/p_qi y_qi²], with Y_q = Σ_i y_qi (the variance of the conditional mean plus the mean of the
    conditional variance)."""
    between = (1 - pi) / pi * y.sum(1) ** 2
    within = ((1 - p) / p * y**2).sum(1) / pi
    return (between + within).sum()


def exercise_2(two_stage_estimate=two_stage_estimate, two_stage_variance=two_stage_variance) -> None:
    gen = torch.Generator().manual_seed(2)
    for n_prompts, g in ((2, 3), (3, 2)):
        y = torch.randn(n_prompts, g, generator=gen, dtype=torch.float64) * 3
        pi = 0.1 + 0.9 * torch.rand(n_prompts, generator=gen, dtype=torch.float64)
        p = 0.1 + 0.9 * torch.rand(n_prompts, g, generator=gen, dtype=torch.float64)
        mean = second = 0.0
        for zq in itertools.product([0, 1], repeat=n_prompts):          # every prompt pattern ...
            zq_t = torch.tensor(zq, dtype=torch.float64)
            p_prompts = float(torch.where(zq_t == 1, pi, 1 - pi).prod())
            for zc in itertools.product([0, 1], repeat=n_prompts * g):   # ... and every completion pattern
                zc_t = torch.tensor(zc, dtype=torch.float64).view(n_prompts, g)
                # completions of a pruned prompt are never drawn: their coins do not matter, so enumerate
                # them anyway with their probabilities (they sum to 1 for each prompt pattern)
                prob = p_prompts * float(torch.where(zc_t == 1, p, 1 - p).prod())
                value = float(two_stage_estimate(y, pi, p, zq_t, zc_t))
                mean += prob * value
                second += prob * value**2
        assert math.isclose(mean, float(y.sum()), rel_tol=1e-9, abs_tol=1e-9), \
            "E[estimate] is not Σ y: biased"
        assert math.isclose(second - mean**2, float(two_stage_variance(y, pi, p)), rel_tol=1e-7), \
            "two_stage_variance does not match the variance over every keep pattern"
        one_stage = float(((1 - pi[:, None] * p) / (pi[:, None] * p) * y**2).sum())
        assert not math.isclose(second - mean**2, one_stage, rel_tol=1e-3), \
            "(the set-up should tell them apart)"
    # the two single-stage limits: every prompt kept (π = 1), every completion kept (p = 1)
    ones_p, ones_g = torch.ones(n_prompts, dtype=torch.float64), torch.ones(n_prompts, g, dtype=torch.float64)
    assert torch.isclose(two_stage_variance(y, ones_p, p), ((1 - p) / p * y**2).sum())
    assert torch.isclose(two_stage_variance(y, pi, ones_g), ((1 - pi) / pi * y.sum(1) ** 2).sum())
    print("two-stage Horvitz-Thompson: E = Σ y and Var = Σ_q [(1-π)/π Y_q² + (1/π) Σ_i (1-p)/p y²] over "
          f"every pattern (last case: Var = {float(two_stage_variance(y, pi, p)):.3f}, one coin per "
          f"completion would say {one_stage:.3f})")


# --------------------------------------------------------------------------------------------------
# Exercise 3: the clipped per-token objective, clip-higher
# --------------------------------------------------------------------------------------------------


def clip_higher_objective(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float = 0.2,
                          eps_high: float = 0.28) -> torch.Tensor:
    """Per token: min(ρ A, clip(ρ, 1 - eps_low, 1 + eps_high) A), shaped like ``ratio`` (``adv`` broadcasts).
    It is maximised; the loss is its negative."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def exercise_3(clip_higher_objective=clip_higher_objective) -> None:
    ratios = torch.tensor([0.5, 0.75, 0.85, 1.0, 1.1, 1.25, 1.3, 1.6, 0.6, 0.75, 0.95, 1.05, 1.25, 2.0],
                          dtype=torch.float64)
    advs = torch.tensor([1.0] * 8 + [-1.5, -1.5, -1.5, -1.5, -1.5, -0.5], dtype=torch.float64)
    for eps_low, eps_high in ((0.2, 0.28), (0.1, 0.3), (0.2, 0.2)):
        for rho, a in zip(ratios, advs, strict=True):  # one token at a time, value and gradient
            logp = rho.log().reshape(1, 1).requires_grad_(True)
            mine = clip_higher_objective(logp.exp(), a, eps_low, eps_high)
            package, _ = policy_loss(logp, a.reshape(1), torch.ones(1, 1, dtype=torch.float64),
                                     old_logprobs=torch.zeros(1, 1, dtype=torch.float64), epsilon=eps_low,
                                     epsilon_high=eps_high)
            where = f"rho={rho:.2f}, A={a:+.1f}, eps_low={eps_low}, eps_high={eps_high}"
            assert torch.allclose(mine.sum(), -package), f"{where}: value"
            g_mine, = torch.autograd.grad(mine.sum(), logp)
            g_package, = torch.autograd.grad(-package, logp)
            assert torch.allclose(g_mine, g_package), f"{where}: gradient"
    # the flat regions, exactly: no gradient beyond 1 + eps_high when A > 0 and below 1 - eps_low when A < 0
    logr = ratios.log().requires_grad_(True)
    grad, = torch.autograd.grad(clip_higher_objective(logr.exp(), advs, 0.2, 0.28).sum(), logr)
    flat = ((ratios > 1.28) & (advs > 0)) | ((ratios < 0.8) & (advs < 0))
    assert bool((grad[flat] == 0).all()) and bool((grad[~flat] != 0).all()), \
        "the gradient vanishes in the wrong places"
    # where clip-higher differs from the symmetric clip: a positive-advantage token at 1.25 still learns
    assert grad[5] != 0 and advs[5] > 0 and ratios[5] == 1.25
    print("clip-higher objective == -policy_loss(epsilon, epsilon_high) per token (values and gradients); "
          f"flat on {int(flat.sum())} of {len(ratios)} tokens at (0.2, 0.28), where (0.2, 0.2) would flatten "
          f"{int((((ratios > 1.2) & (advs > 0)) | ((ratios < 0.8) & (advs < 0))).sum())}")


# --------------------------------------------------------------------------------------------------
# Exercise 4: one AdamW step, with decoupled weight decay
# --------------------------------------------------------------------------------------------------


def adamw_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int,
               lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
               weight_decay: float = 0.01) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW's t-th step (t >= 1): returns (the new parameters, new m, new v).
    The decay is decoupled: the parameters shrink by lr · weight_decay times themselves, outside the moments
    (θ ← θ (1 - lr λ)); then m' = β1 m + (1 - β1) g, v' = β2 v + (1 - β2) g², and
    θ ← θ - lr · (m'/(1 - β1^t)) / (√(v'/(1 - β2^t)) + eps)."""
    b1, b2 = betas
    decayed = param * (1 - lr * weight_decay)
    m_new = b1 * m + (1 - b1) * grad
    v_new = b2 * v + (1 - b2) * grad**2
    step = lr * (m_new / (1 - b1**t)) / ((v_new / (1 - b2**t)).sqrt() + eps)
    return decayed - step, m_new, v_new


def exercise_4(adamw_step=adamw_step) -> None:
    gen = torch.Generator().manual_seed(4)
    D = 10
    start = torch.randn(D, generator=gen, dtype=torch.float64) * 2
    history = torch.randn(8, D, generator=gen, dtype=torch.float64)
    for lr, betas, wd in ((1e-2, (0.9, 0.99), 0.1), (3e-3, (0.8, 0.999), 0.5), (1e-3, (0.9, 0.99), 0.0)):
        param = start.clone().requires_grad_(True)
        opt = torch.optim.AdamW([param], lr=lr, betas=betas, eps=1e-8, weight_decay=wd)
        coupled = start.clone().requires_grad_(True)  # Adam with an L2 term in the gradient: not AdamW
        l2 = torch.optim.Adam([coupled], lr=lr, betas=betas, eps=1e-8, weight_decay=wd)
        mine, m, v = start.clone(), torch.zeros(D, dtype=torch.float64), torch.zeros(D, dtype=torch.float64)
        for t, g in enumerate(history, start=1):
            param.grad, coupled.grad = g.clone(), g.clone()
            opt.step()
            l2.step()
            mine, m, v = adamw_step(mine, g, m, v, t, lr=lr, betas=betas, eps=1e-8, weight_decay=wd)
            assert torch.allclose(mine, param.detach(), rtol=1e-9, atol=1e-12), \
                f"lr={lr}, betas={betas}, weight_decay={wd}, step {t}: not torch.optim.AdamW's parameters"
        if wd > 0:   # the decoupled decay is a different optimizer from L2 inside Adam's moments
            assert not torch.allclose(param.detach(), coupled.detach(), rtol=1e-6), \
                "(the set-up tells them apart)"
    # a zero gradient still moves the parameters: the decay does not pass through m and v
    m0 = v0 = torch.zeros(D, dtype=torch.float64)
    moved, _, _ = adamw_step(start, torch.zeros(D, dtype=torch.float64), m0, v0, 1, lr=1e-2, weight_decay=0.1)
    assert torch.allclose(moved, start * (1 - 1e-2 * 0.1)), "with g = 0 the step is the decay alone"
    print(f"adamw_step == torch.optim.AdamW over {len(history)} steps (weight decay 0.1, 0.5 and 0); "
          f"Adam with L2 in the gradient ends elsewhere")


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    exercise_4()
    print("chapter 03b solutions: all checks passed")


if __name__ == "__main__":
    main()
