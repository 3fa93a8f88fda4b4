"""DPPO's pruning: which prompts to roll out, which completions to train on, and the weights that keep it
unbiased.

Pure functions and one small data structure (:class:`PromptHistory`); no trainer state, so other
frameworks (TRL, verl, OpenRLHF) can call them.

The estimator (docs/architecture.md, "The estimator: mathematics"). For a step over candidate prompts B
with G completions each, full-batch GRPO minimises

    L(θ) = (1/C) Σ_{q∈B} Σ_{i=1..G} ℓ_{q,i}(θ)            (C constant, e.g. |B|·G)

DPPO keeps prompt q with probability π_q (decided *before* rollout, from the prompt's history) and
completion (q,i) with probability p_{q,i} (decided *after* reward, from |A_{q,i}|), and trains on

    L̂(θ) = (1/C) Σ_{kept} ℓ_{q,i}(θ) / (π_q p_{q,i}).

Because the draws do not depend on θ, E[L̂(θ)] = L(θ) for every θ fixed before the draw — so the loss and
its gradient at the step's parameters are unbiased, ratio clipping and KL included, for loss types ``grpo``
and ``dr_grpo`` (``dapo`` under completion pruning only) and reward scalings ``group`` and ``none``
(``batch`` only without prompt pruning); docs/estimator.md has the proof. The optimizer's update
is not: AdamW and gradient-norm clipping are not linear in the gradient, and from a second PPO epoch on the
parameters depend on the draw. Two conditions make this exact:

1. every item with a non-zero loss has a positive keep probability (floors ``min_keep_prob``); an item
   may get 0 only where ℓ ≡ 0 for every θ (A = 0 and β = 0);
2. the weights use the probabilities the sampler actually used: independent Bernoulli draws
   (:func:`sample_keep`), or a fixed-size design with the same first-order inclusion probabilities
   (systematic PPS sampling), so that exactly Σp items are kept each time.

For independent draws the variance of the gradient estimate (trace of its covariance) is
(1/C²) [Σ_q (1/π_q − 1) ‖S_q‖² + Σ_{q,i} (1 − p_{q,i})/(π_q p_{q,i}) ‖g_{q,i}‖²], g = ∇ℓ, S_q = Σ_i g_{q,i}:
for a budget on a group's expected count, completion keep probabilities proportional to each completion's
gradient size minimise it, and ``scheme="proportional"`` (∝ |A|) does when that size is proportional to |A|;
for prompts the optimum is π_q ∝ √(‖S_q‖² + V_q), V_q the completion stage's variance term
(docs/estimator.md); floors bound it.

Keep-probability schemes (``rate`` = r):

* ``"paper"`` — the DPPO paper's rule made random: items are ranked by score (|A| for completions,
  history for prompts); the lowest ``candidate_fraction`` of them (default: the lower half) are
  pruning candidates, each kept with probability ``max(1 - r, min_keep_prob)``; the rest are kept.
  The expected fraction pruned is therefore r × candidate_fraction.
* ``"proportional"`` — p_i = clip(c · score_i, min_keep_prob, 1) with c chosen so that the expected
  number kept is (1 - r) · n: r is the expected fraction pruned (up to the floors and to items forced
  to 1).
* ``"posterior"`` (prompts) — ``proportional`` on :func:`~dppo_core.posterior.posterior_scores`: √P(the next
  group is informative) from the prompt's whole (discounted) history (:mod:`dppo_core.posterior`); it needs
  rewards in [0, 1]. The other schemes read the rewards only through |A|, so they take any finite rewards
  (rewards a·r + b, a > 0, give the same probabilities up to the eps of group scaling).
* ``"fitted"`` (prompts) — ``proportional`` on P(informative) itself (the square of ``posterior``'s score),
  the prior fitted to the pool (:meth:`PromptHistory.fitted_prior`): sharper, where history can see
  (issue #50's sweep).
* ``"streak"`` (prompts) — ``proportional`` on ``fitted``'s P(informative), recalibrated, for a prompt whose
  last groups were all equal, by how often this run's prompts with as long a run of all-equal groups and a
  like prediction were informative next (:class:`~dppo_core.posterior.StreakCalibration`; GRESO's idea, made
  exact by 1/π): ``fitted`` until the run has counted enough.
* ``"length"`` (completions) — ``proportional`` on |A| / len^γ with a budget on the expected tokens kept:
  the variance-minimising shape per token trained for independent draws when a completion's gradient size is
  ∝ |A|·len^(1/2−γ) (docs/estimator.md); near-optimal where that holds only roughly.

The draws that keep each item with its probability (:func:`sample_keep`: independent, or the fixed-size
designs ``systematic``, ``sorted`` and ``pivotal``) and the per-step seeded generators are in
:mod:`dppo_core.draws`, importable from here. :func:`adaptive_rate` chooses a completion rate per step that
holds a predicted effective sample size.

Biased baselines, for comparison only: CPPO, GRESO and PODS, in :mod:`dppo_core.biased_baselines`
(:func:`cppo_keep` and :func:`greso_keep_probs` are importable from here too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from dppo_core import posterior, registry
from dppo_core.biased_baselines import cppo_keep, greso_keep_probs
from dppo_core.config import COMPLETION_SCHEMES, PROMPT_SCHEMES, SCHEMES
from dppo_core.draws import pivotal_draw, sample_keep, step_generator, systematic_draw
from dppo_core.history import PromptHistory

__all__ = [  # defined elsewhere and importable from here: PromptHistory, cppo_keep, greso_keep_probs and the
             # draws (sample_keep, step_generator, systematic_draw, pivotal_draw)
    "PromptHistory", "adaptive_rate", "completion_keep_probs", "cppo_keep", "dense_window",
    "effective_sample_size", "expected_ess", "fit_budget", "greso_keep_probs", "importance_weights",
    "keep_probs_from_scores", "pivotal_draw", "prompt_keep_probs", "sample_keep", "step_generator",
    "systematic_draw",
]

# --------------------------------------------------------------------------------------------------
# Keep probabilities
# --------------------------------------------------------------------------------------------------


def _check(rate: float, min_keep_prob: float, scheme: str, candidate_fraction: float,
           schemes: tuple[str, ...] = SCHEMES) -> None:
    if not 0 <= rate < 1:
        raise ValueError(f"prune rate {rate!r} must be in [0, 1): it is the (expected) fraction pruned")
    if not 0 < min_keep_prob <= 1:
        raise ValueError(f"min_keep_prob={min_keep_prob!r} must be in (0, 1]: a zero floor makes the "
                         "estimator biased for items with a non-zero loss")
    if scheme not in schemes:
        raise ValueError(f"scheme={scheme!r}: choose one of {schemes}")
    if not 0 < candidate_fraction <= 1:
        raise ValueError(f"candidate_fraction={candidate_fraction!r} must be in (0, 1]")


def fit_budget(scores: torch.Tensor, budget: float, min_prob: float,
               costs: torch.Tensor | None = None) -> torch.Tensor:
    """p_i = clip(c · s_i, min_prob, 1) with c such that Σ p_i = budget (as close as the bounds allow).

    With ``costs`` (> 0, e.g. token counts) the budget is on the expected cost instead: Σ p_i cost_i = budget.
    Scores must be >= 0; an item with score 0 gets ``min_prob``; if every score is 0 the budget is
    spread evenly. Σ p is piecewise linear and non-decreasing in c, with breakpoints at min_prob/s_i and
    1/s_i, so c is found exactly: evaluate the sum at every breakpoint and interpolate on the segment
    where it crosses the budget. Returns float64.
    """
    s = np.clip(torch.as_tensor(scores, dtype=torch.float64).numpy(), 0, None)
    n = s.size
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    w = np.ones(n) if costs is None else torch.as_tensor(costs, dtype=torch.float64).numpy().reshape(-1)
    if w.size != n or not (w > 0).all():
        raise ValueError(f"costs must be {n} positive numbers, one per score")
    budget = min(max(float(budget), min_prob * w.sum()), float(w.sum()))
    if s.max() > 0:  # scale-free; scores below 1e-12 of the largest count as 0 (they get the floor)
        s = s / s.max()
        s[s < 1e-12] = 0.0
    pos = s[s > 0]
    if pos.size == 0:
        return torch.full((n,), min(1.0, max(min_prob, budget / w.sum())), dtype=torch.float64)
    cuts = np.unique(np.concatenate([[0.0], min_prob / pos, 1.0 / pos]))
    sums = (np.clip(cuts[:, None] * s[None, :], min_prob, 1) * w[None, :]).sum(axis=1)  # non-decreasing in c
    j = int(np.searchsorted(sums, budget - 1e-12))
    if j >= cuts.size:  # unreachable (zero-score items stay at the floor): keep every positive item
        c = cuts[-1]
    elif j == 0:
        c = cuts[0]
    else:
        c0, c1, f0, f1 = cuts[j - 1], cuts[j], sums[j - 1], sums[j]
        c = c1 if f1 == f0 else c0 + (budget - f0) * (c1 - c0) / (f1 - f0)
    return torch.from_numpy(np.clip(c * s, min_prob, 1))


def keep_probs_from_scores(scores: torch.Tensor, rate: float, *, scheme: str = "proportional",
                           min_keep_prob: float = 0.1, candidate_fraction: float = 0.5,
                           forced: torch.Tensor | None = None, zero: torch.Tensor | None = None,
                           budget: float | None = None, costs: torch.Tensor | None = None) -> torch.Tensor:
    """Keep probabilities for a 1-D pool of items from non-negative scores (higher = more useful).

    Args:
        rate: r in [0, 1); see the module docstring for what it means under each scheme.
        scheme: ``"proportional"`` or ``"paper"`` (the stage schemes ``posterior`` and ``length`` are
            ``proportional`` on their own scores: :func:`prompt_keep_probs`, :func:`completion_keep_probs`).
        forced: bool mask of items that must be kept (probability 1), e.g. unseen prompts.
        zero: bool mask of items whose loss is identically zero; they get probability 0.
        budget: if given, the free items' probabilities are rescaled (clip(c·p, floor, 1)) so that the
            expected number kept over the whole pool is ``budget`` — the dense-prompt mode.
        costs: ``proportional`` only: the rate is then a fraction of the pool's total cost (e.g. tokens):
            Σ p_i cost_i = (1 - r) Σ cost_i, both sums over the whole pool (zero-loss items count in the total
            and are kept with probability 0).

    Returns float64 probabilities: 1 for ``forced``, 0 for ``zero``, in [min_keep_prob, 1] otherwise.
    """
    _check(rate, min_keep_prob, scheme, candidate_fraction)
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    n = scores.numel()
    forced = torch.zeros(n, dtype=torch.bool) if forced is None else forced.reshape(-1).bool()
    zero = torch.zeros(n, dtype=torch.bool) if zero is None else zero.reshape(-1).bool() & ~forced
    if torch.isnan(scores).any() or (scores < 0).any():
        raise ValueError("scores must be finite and >= 0 (e.g. |advantage|)")
    cost = (torch.ones(n, dtype=torch.float64) if costs is None
            else torch.as_tensor(costs, dtype=torch.float64))
    cost = cost.reshape(-1)
    if cost.numel() != n or not (cost > 0).all():
        raise ValueError(f"costs must be {n} positive numbers, one per item (e.g. token counts, at least 1)")
    probs = torch.ones(n, dtype=torch.float64)
    probs[zero] = 0.0
    free = ~forced & ~zero
    idx = free.nonzero().flatten()
    if idx.numel() and rate > 0:
        s = scores[idx]
        if scheme == "proportional":
            target = (1 - rate) * float(cost.sum()) - float(cost[forced].sum())
            probs[idx] = fit_budget(s, target, min_keep_prob, None if costs is None else cost[idx])
        else:  # paper: the lowest-scoring candidate_fraction of the free items are kept with 1 - r
            m = math.ceil(candidate_fraction * idx.numel() - 1e-9)
            low = idx[torch.argsort(s, stable=True)[:m]]
            probs[low] = max(1 - rate, min_keep_prob)
    if budget is not None and idx.numel():
        target = budget - int(forced.sum())
        probs[idx] = fit_budget(probs[idx], target, min_keep_prob)
    return probs


def completion_keep_probs(advantages: torch.Tensor, rate: float, *, scheme: str = "proportional",
                          min_keep_prob: float = 0.1, beta: float = 0.0, drop_zero: bool = True,
                          candidate_fraction: float = 0.5, lengths: torch.Tensor | None = None,
                          length_exponent: float = 0.5) -> torch.Tensor:
    """Per completion keep probabilities p_{q,i}, from |A| within each group; shape (P, G) like
    ``advantages``.

    Each group of G gets its own budget, so every prompt keeps completions:

    * ``proportional``: p ∝ |A|, (1 - r)·G completions kept in expectation;
    * ``length``: p ∝ |A| / len^γ (γ = ``length_exponent``), (1 - r) of the group's tokens kept in
      expectation (needs ``lengths``, shape (P, G), the completions' token counts). Under a token budget the
      variance-optimal p is ∝ ‖g‖ / √len (docs/estimator.md): γ = 0.5 if a completion's gradient size is
      ∝ |A| whatever its length, γ = 1 if it shrinks like 1 / √len (a per-sequence token mean of
      independent token gradients); benchmarks/variance_cost.py measures which;
    * ``paper``: the lower ``candidate_fraction`` by |A| kept with 1 - r.

    With ``beta == 0`` a completion with A = 0 has an identically zero loss and, if ``drop_zero``,
    probability 0 (whole all-equal groups vanish from the update at no bias). With ``beta > 0`` its KL
    term is not zero, so it keeps the floor.
    """
    adv = torch.as_tensor(advantages, dtype=torch.float64)
    if adv.ndim != 2:
        raise ValueError(f"advantages must have shape (num_prompts, G), got {tuple(adv.shape)}")
    _check(rate, min_keep_prob, scheme, candidate_fraction, COMPLETION_SCHEMES)
    costs = None
    if scheme == "length":
        if lengths is None:
            raise ValueError("completion scheme 'length' needs the completions' token counts "
                             "(lengths=, shape (P, G))")
        costs = torch.as_tensor(lengths, dtype=torch.float64).clamp(min=1.0)
        if costs.shape != adv.shape:
            raise ValueError(f"lengths {tuple(costs.shape)} must have the advantages' shape "
                             f"{tuple(adv.shape)}")
        if length_exponent < 0:
            raise ValueError(f"length_exponent={length_exponent!r} must be >= 0 "
                             "(0: p ∝ |A| under a token budget)")
    out = torch.empty_like(adv)
    for q in range(adv.shape[0]):
        zero = (adv[q] == 0) if (drop_zero and beta == 0) else None
        if costs is None:
            out[q] = keep_probs_from_scores(adv[q].abs(), rate, scheme=scheme, min_keep_prob=min_keep_prob,
                                            candidate_fraction=candidate_fraction, zero=zero)
        else:
            out[q] = keep_probs_from_scores(adv[q].abs() / costs[q] ** length_exponent, rate,
                                            scheme="proportional", min_keep_prob=min_keep_prob, zero=zero,
                                            costs=costs[q])
    return out


def expected_ess(prompt_probs: torch.Tensor, completion_probs: torch.Tensor) -> float:
    """The completion stage's effective sample size, predicted before its draw: (Σ 1/π_q)² / Σ 1/(π_q² p_qi).

    Conditional on the prompts being rolled out: ``prompt_probs`` (P,) and ``completion_probs`` (P, G) are
    those of prompts already kept (the estimator calls it after prompt selection), and the sums run over their
    completions with p_qi > 0. It is the ratio of E[Σ w]² to E[Σ w²] over the completion draw alone, for the
    weights w = 1/(π_q p_qi) of the kept completions: Kish's effective sample size
    (:func:`effective_sample_size`) with expectations in place of sums. Fed every candidate prompt, it
    overstates the ESS where prompts are pruned (it counts a pruned prompt's completions as drawn). Before the
    prompt draw too, over the N completions that can be kept, E[Σ w] = N and E[Σ w²] = Σ 1/(π_q p_qi), so the
    unconditional ratio is N² / Σ 1/(π_q p_qi).
    """
    pi = torch.as_tensor(prompt_probs, dtype=torch.float64)[:, None].expand_as(
        torch.as_tensor(completion_probs))
    p = torch.as_tensor(completion_probs, dtype=torch.float64)
    live = p > 0
    if not live.any():
        return 0.0
    return float((1 / pi[live]).sum() ** 2 / (1 / (pi[live] ** 2 * p[live])).sum())


def adaptive_rate(prompt_probs: torch.Tensor, target_ess: float, max_rate: float,
                  probs_at: Callable[[float], torch.Tensor], step_size: float = 0.05) -> float:
    """The largest completion prune rate in {0, step_size, ..., max_rate} whose predicted ESS reaches
    ``target_ess``.

    ``probs_at(r)`` gives the completion keep probabilities at rate r (the scheme's own, from the step's
    advantages). The rate is a function of the step's advantages and the prompts' probabilities only, both
    fixed before the completion draw, so the loss and its gradient at parameters fixed before the draw stay
    unbiased (the estimator's claim, unchanged); it prunes more when many completions carry
    signal and less when signal is scarce (a step whose ESS is below the target even unpruned is not pruned).
    Returns 0 when no rate reaches it.
    """
    if target_ess <= 0:
        raise ValueError(f"target_ess={target_ess!r} must be > 0 "
                         "(an effective number of completions per step)")
    rates = [round(k * step_size, 10) for k in range(int(max_rate / step_size + 1e-9) + 1)]
    best = 0.0
    for r in rates:
        if expected_ess(prompt_probs, probs_at(r)) >= target_ess - 1e-9:
            best = r
        else:
            break  # the predicted ESS falls as the rate rises
    return best


def prompt_keep_probs(history: PromptHistory, prompt_ids: Sequence[str], rate: float, *,
                      scheme: str = "paper", min_keep_prob: float = 0.1, step: int | None = None,
                      max_age: int | None = None,
                      budget: float | None = None, candidate_fraction: float = 0.5, group_size: int = 8,
                      scale_rewards: str = "group",
                      calibration: posterior.StreakCalibration | None = None) -> torch.Tensor:
    """Inclusion probability π_q for each candidate prompt, from its history; shape (len(prompt_ids),).

    ``paper`` and ``proportional``: unseen prompts (and, with ``max_age``, prompts last seen more than
    ``max_age`` steps before ``step``) get 1; seen prompts are scored by the mean |A| of their last group
    (0 for an all-equal group). ``posterior``: every prompt is scored by
    :func:`~dppo_core.posterior.posterior_scores` (all its history, unseen ones by the prior) and kept with
    probability ∝ its score, (1 - r) of the candidates in expectation; ``fitted`` and ``streak`` likewise
    (module docstring), ``streak`` with the run's ``calibration`` (None: an empty one, which is ``fitted``).
    Floored at ``min_keep_prob``: never 0, because a prompt that gave no signal last time may give some now.
    ``budget`` rescales them so that the expected number of prompts kept is ``budget`` (see
    :func:`dense_window`).
    """
    _check(rate, min_keep_prob, scheme, candidate_fraction, PROMPT_SCHEMES)
    rule = registry.PROMPT_SCHEMES[scheme]
    if rule.calibrated:  # streak
        informative = posterior.fitted_informative(history, prompt_ids, group_size, step=step,
                                                   max_age=max_age)
        if calibration is not None:
            informative = calibration.predict(history, prompt_ids, informative, step=step, max_age=max_age)
        return keep_probs_from_scores(informative, rate, scheme="proportional", min_keep_prob=min_keep_prob,
                                      budget=budget)
    # posterior: √P(informative); fitted: P itself, under the pool's fitted prior
    if "pass_counts" in rule.reads:
        prior = history.fitted_prior(group_size) if rule.prior == "fitted" else (1.0, 1.0)
        scored = posterior.posterior_scores(history, prompt_ids, group_size, step=step, max_age=max_age,
                                            prior=prior, scale_rewards=scale_rewards)
        values = scored ** round(2 * rule.power)  # the scores are √P(informative)
        return keep_probs_from_scores(values, rate, scheme="proportional", min_keep_prob=min_keep_prob,
                                      budget=budget)
    scores = [history.score(pid, step, max_age) for pid in prompt_ids]
    forced = torch.tensor([s is None for s in scores], dtype=torch.bool)
    values = torch.tensor([0.0 if s is None else s for s in scores], dtype=torch.float64)
    return keep_probs_from_scores(values, rate, scheme=scheme, min_keep_prob=min_keep_prob,
                                  candidate_fraction=candidate_fraction, forced=forced, budget=budget)


def dense_window(stream_probs: torch.Tensor, target: int) -> int:
    """Dense prompts: the shortest prefix of a candidate stream whose expected kept count reaches ``target``.

    The prompt selector looks ahead in the dataset: candidate prompts are taken in order until the sum
    of their keep probabilities is at least ``target`` (the generation batch), so that about ``target``
    prompts go to the rollout engine even when many are pruned. The window is fixed before the
    inclusion draw and does not depend on θ, so the estimator stays unbiased for the full-batch loss over
    it (with C = W·G). Over many steps this is not fixed-size GRPO's objective: a prompt counts 1/(W·G) in
    its step, less where it shares the window with many low-probability prompts.
    Returns W (the whole stream if the target cannot be reached).
    """
    cum = torch.cumsum(torch.as_tensor(stream_probs, dtype=torch.float64), 0)
    hit = (cum >= target - 1e-9).nonzero()
    return int(hit[0]) + 1 if hit.numel() else int(cum.numel())


# --------------------------------------------------------------------------------------------------
# Weights (the draws that use them: dppo_core.draws)
# --------------------------------------------------------------------------------------------------


def importance_weights(prompt_probs: torch.Tensor, completion_probs: torch.Tensor,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """w_{q,i} = 1 / (π_q p_{q,i}), shape (P, G); 0 where not kept (or where the probability is 0)."""
    pi = torch.as_tensor(prompt_probs, dtype=torch.float64)[:, None]
    p = torch.as_tensor(completion_probs, dtype=torch.float64)
    joint = pi * p
    w = torch.where(joint > 0, 1.0 / joint.clamp(min=1e-300), torch.zeros_like(joint))
    return w if keep is None else w * keep.to(w.dtype)


def effective_sample_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size (Σw)² / Σw² of the kept items' weights (the count if all equal)."""
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    w = w[w > 0]
    return float(w.sum() ** 2 / (w**2).sum()) if w.numel() else 0.0
