"""DPPO's pruning: which prompts to roll out, which completions to train on, and the weights that keep it unbiased.

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
(1/C²) [Σ_q (1/π_q − 1) ‖S_q‖² + Σ_{q,i} (1 − p_{q,i})/(π_q p_{q,i}) ‖g_{q,i}‖²], g = ∇ℓ, S_q = Σ_i g_{q,i}: for a
budget on a group's expected count, completion keep probabilities proportional to each completion's gradient
size minimise it, and ``scheme="proportional"`` (∝ |A|) does when that size is proportional to |A|; for prompts
the optimum is π_q ∝ √(‖S_q‖² + V_q), V_q the completion stage's variance term (docs/estimator.md); floors
bound it.

Keep-probability schemes (``rate`` = r):

* ``"paper"`` — the DPPO paper's rule made random: items are ranked by score (|A| for completions,
  history for prompts); the lowest ``candidate_fraction`` of them (default: the lower half) are
  pruning candidates, each kept with probability ``max(1 - r, min_keep_prob)``; the rest are kept.
  The expected fraction pruned is therefore r × candidate_fraction.
* ``"proportional"`` — p_i = clip(c · score_i, min_keep_prob, 1) with c chosen so that the expected
  number kept is (1 - r) · n: r is the expected fraction pruned (up to the floors and to items forced
  to 1).

Biased baselines, for comparison only (the tests and chapter 06 show their bias):

* :func:`cppo_keep` — CPPO: keep the top-k completions of each group by |A|, deterministically,
  without weights.
* :func:`greso_keep_probs` — GRESO: skip prompts whose last group had zero reward variance with a
  probability, and train on the rest without weights.
* :func:`pods_keep` — PODS: keep the completions of each group whose rewards vary most, without weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dppo_core.config import SCHEMES

# --------------------------------------------------------------------------------------------------
# Prompt history
# --------------------------------------------------------------------------------------------------


@dataclass
class PromptRecord:
    """What the last rollout of one prompt showed."""

    mean_reward: float
    reward_std: float
    mean_abs_advantage: float
    step: int
    seen: int = 1

    @property
    def degenerate(self) -> bool:
        """All G rewards were equal: the group gave no learning signal (A = 0 everywhere)."""
        return self.reward_std == 0.0


class PromptHistory:
    """Per prompt id, the statistics of its most recent rollout group.

    ``update`` after each step's rewards; ``state_dict``/``from_state_dict`` for checkpoints (plain
    JSON-serialisable data); ``merge`` combines the histories of data-parallel ranks (the most recent
    record of each prompt wins, so every rank ends with the same history).
    """

    def __init__(self, records: dict[str, PromptRecord] | None = None):
        self.records: dict[str, PromptRecord] = dict(records or {})

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self.records

    def get(self, prompt_id: str) -> PromptRecord | None:
        return self.records.get(prompt_id)

    def update(self, prompt_ids: Sequence[str], rewards: torch.Tensor, advantages: torch.Tensor, step: int) -> None:
        """Record each prompt's group: ``rewards`` and ``advantages`` have shape (len(prompt_ids), G)."""
        rewards = torch.as_tensor(rewards, dtype=torch.float64)
        advantages = torch.as_tensor(advantages, dtype=torch.float64)
        if rewards.ndim != 2 or rewards.shape[0] != len(prompt_ids) or advantages.shape != rewards.shape:
            raise ValueError(f"rewards {tuple(rewards.shape)} and advantages {tuple(advantages.shape)} must both "
                             f"have shape ({len(prompt_ids)}, G), one row per prompt id")
        for pid, r, a in zip(prompt_ids, rewards, advantages, strict=True):
            prev = self.records.get(pid)
            self.records[pid] = PromptRecord(
                mean_reward=float(r.mean()), reward_std=float(r.std(unbiased=False)),
                mean_abs_advantage=float(a.abs().mean()), step=int(step), seen=(prev.seen + 1) if prev else 1)

    def score(self, prompt_id: str, step: int | None = None, max_age: int | None = None) -> float | None:
        """The prompt's expected learning signal (its last mean |A|), or None if unseen or too old."""
        rec = self.records.get(prompt_id)
        if rec is None or (max_age is not None and step is not None and step - rec.step > max_age):
            return None
        return rec.mean_abs_advantage

    def degenerate_fraction(self) -> float:
        return sum(r.degenerate for r in self.records.values()) / max(1, len(self.records))

    def state_dict(self) -> dict[str, Any]:
        return {"records": {k: asdict(v) for k, v in self.records.items()}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PromptHistory:
        try:
            return cls({k: PromptRecord(**v) for k, v in state["records"].items()})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a PromptHistory state (expected {{'records': {{id: record}}}}): {exc}") from exc

    @classmethod
    def merge(cls, histories: Iterable[PromptHistory]) -> PromptHistory:
        """One history from several (e.g. one per data-parallel rank): per prompt, the latest record wins.

        Ties on the step (two ranks rolled the same prompt out in one step) keep the record with more
        sightings, then the larger mean |A|, so the result does not depend on the ranks' order.
        """
        out: dict[str, PromptRecord] = {}
        for h in histories:
            for pid, rec in h.records.items():
                cur = out.get(pid)
                if cur is None or ((rec.step, rec.seen, rec.mean_abs_advantage)
                                   > (cur.step, cur.seen, cur.mean_abs_advantage)):
                    out[pid] = rec
        return cls(out)


# --------------------------------------------------------------------------------------------------
# Keep probabilities
# --------------------------------------------------------------------------------------------------


def _check(rate: float, min_keep_prob: float, scheme: str, candidate_fraction: float) -> None:
    if not 0 <= rate < 1:
        raise ValueError(f"prune rate {rate!r} must be in [0, 1): it is the (expected) fraction pruned")
    if not 0 < min_keep_prob <= 1:
        raise ValueError(f"min_keep_prob={min_keep_prob!r} must be in (0, 1]: a zero floor makes the "
                         "estimator biased for items with a non-zero loss")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}: choose one of {SCHEMES}")
    if not 0 < candidate_fraction <= 1:
        raise ValueError(f"candidate_fraction={candidate_fraction!r} must be in (0, 1]")


def fit_budget(scores: torch.Tensor, budget: float, min_prob: float) -> torch.Tensor:
    """p_i = clip(c · s_i, min_prob, 1) with c such that Σ p_i = budget (as close as the bounds allow).

    Scores must be >= 0; an item with score 0 gets ``min_prob``; if every score is 0 the budget is
    spread evenly. Σ p is piecewise linear and non-decreasing in c, with breakpoints at min_prob/s_i and
    1/s_i, so c is found exactly: evaluate the sum at every breakpoint and interpolate on the segment
    where it crosses the budget. Returns float64.
    """
    s = np.clip(torch.as_tensor(scores, dtype=torch.float64).numpy(), 0, None)
    n = s.size
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    budget = min(max(float(budget), min_prob * n), float(n))
    if s.max() > 0:  # scale-free; scores below 1e-12 of the largest count as 0 (they get the floor)
        s = s / s.max()
        s[s < 1e-12] = 0.0
    pos = s[s > 0]
    if pos.size == 0:
        return torch.full((n,), min(1.0, max(min_prob, budget / n)), dtype=torch.float64)
    cuts = np.unique(np.concatenate([[0.0], min_prob / pos, 1.0 / pos]))
    sums = np.clip(cuts[:, None] * s[None, :], min_prob, 1).sum(axis=1)  # non-decreasing in c
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
                           budget: float | None = None) -> torch.Tensor:
    """Keep probabilities for a 1-D pool of items from non-negative scores (higher = more useful).

    Args:
        rate: r in [0, 1); see the module docstring for what it means under each scheme.
        forced: bool mask of items that must be kept (probability 1), e.g. unseen prompts.
        zero: bool mask of items whose loss is identically zero; they get probability 0.
        budget: if given, the free items' probabilities are rescaled (clip(c·p, floor, 1)) so that the
            expected number kept over the whole pool is ``budget`` — the dense-prompt mode.

    Returns float64 probabilities: 1 for ``forced``, 0 for ``zero``, in [min_keep_prob, 1] otherwise.
    """
    _check(rate, min_keep_prob, scheme, candidate_fraction)
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    n = scores.numel()
    forced = torch.zeros(n, dtype=torch.bool) if forced is None else forced.reshape(-1).bool()
    zero = torch.zeros(n, dtype=torch.bool) if zero is None else zero.reshape(-1).bool() & ~forced
    if torch.isnan(scores).any() or (scores < 0).any():
        raise ValueError("scores must be finite and >= 0 (e.g. |advantage|)")
    probs = torch.ones(n, dtype=torch.float64)
    probs[zero] = 0.0
    free = ~forced & ~zero
    idx = free.nonzero().flatten()
    if idx.numel() and rate > 0:
        s = scores[idx]
        if scheme == "proportional":
            target = (1 - rate) * n - int(forced.sum())
            probs[idx] = fit_budget(s, target, min_keep_prob)
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
                          candidate_fraction: float = 0.5) -> torch.Tensor:
    """Per completion keep probabilities p_{q,i}, from |A| within each group; shape (P, G) like ``advantages``.

    Each group of G gets its own budget (``proportional``: (1 - r)·G expected kept), so every prompt
    keeps completions. With ``beta == 0`` a completion with A = 0 has an identically zero loss and,
    if ``drop_zero``, probability 0 (whole degenerate groups vanish from the update at no bias). With
    ``beta > 0`` its KL term is not zero, so it keeps the floor.
    """
    adv = torch.as_tensor(advantages, dtype=torch.float64)
    if adv.ndim != 2:
        raise ValueError(f"advantages must have shape (num_prompts, G), got {tuple(adv.shape)}")
    _check(rate, min_keep_prob, scheme, candidate_fraction)
    out = torch.empty_like(adv)
    for q in range(adv.shape[0]):
        zero = (adv[q] == 0) if (drop_zero and beta == 0) else None
        out[q] = keep_probs_from_scores(adv[q].abs(), rate, scheme=scheme, min_keep_prob=min_keep_prob,
                                        candidate_fraction=candidate_fraction, zero=zero)
    return out


def prompt_keep_probs(history: PromptHistory, prompt_ids: Sequence[str], rate: float, *, scheme: str = "paper",
                      min_keep_prob: float = 0.1, step: int | None = None, max_age: int | None = None,
                      budget: float | None = None, candidate_fraction: float = 0.5) -> torch.Tensor:
    """Inclusion probability π_q for each candidate prompt, from its history; shape (len(prompt_ids),).

    Unseen prompts (and, with ``max_age``, prompts last seen more than ``max_age`` steps before
    ``step``) get 1. Seen prompts are scored by the mean |A| of their last group (0 for a degenerate
    group) and get probabilities by ``scheme``, floored at ``min_keep_prob`` — never 0, because a
    prompt that gave no signal last time may give some now. ``budget`` rescales them so that the
    expected number of prompts kept is ``budget`` (see :func:`dense_window`).
    """
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
# Inclusion sampling and weights
# --------------------------------------------------------------------------------------------------


def step_generator(seed: int, step: int, stage: str) -> torch.Generator:
    """A generator for one step's pruning draws, a function of (seed, step, stage) only (resumable)."""
    digest = hashlib.sha256(f"prune:{seed}:{step}:{stage}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def systematic_draw(p: torch.Tensor, order: torch.Tensor, u: float) -> torch.Tensor:
    """Randomised systematic PPS sampling of a 1-D pool, given its randomness: the unit order and the start u.

    Units in ``order`` get consecutive intervals of length p_j on [0, Σp); the points u, u+1, ... select the
    units whose interval holds one. Every p_j <= 1, so no unit is hit twice; exactly ⌈Σp - u⌉ units are kept:
    Σp of them when Σp is an integer. With ``order`` a uniformly random permutation and u ~ U[0, 1), unit j is
    kept with probability exactly p_j (:func:`sample_keep` draws both; the tests enumerate them exactly).
    """
    keep = torch.zeros(p.numel(), dtype=torch.bool)
    if p.numel() == 0:
        return keep
    cum = torch.cumsum(p[order], 0)
    # snap sums that are integers up to rounding, so an integral total keeps exactly that many
    cum = torch.where((cum - cum.round()).abs() < 1e-9, cum.round(), cum)
    prev = torch.cat([torch.zeros(1, dtype=torch.float64), cum[:-1]])
    hits = torch.ceil(cum - u) - torch.ceil(prev - u)
    keep[order] = hits > 0
    return keep


def _systematic(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """:func:`systematic_draw` with a random order and start drawn from ``generator``."""
    if p.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    order = torch.randperm(p.numel(), generator=generator)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return systematic_draw(p, order, u)


def sample_keep(probs: torch.Tensor, generator: torch.Generator | None = None,
                fixed_size: bool = False) -> torch.Tensor:
    """Draw which items to keep: a bool tensor shaped like ``probs`` (1-D, or 2-D sampled row by row).

    ``generator``: the random stream (default: torch's global one); the trainer passes
    :func:`step_generator` so a resumed run draws the same.

    ``fixed_size=False``: independent Bernoulli(p) draws. ``fixed_size=True``: systematic PPS sampling
    (:func:`_systematic`) in each row, with the same inclusion probabilities but a constant count: a row
    whose probabilities sum to an integer k keeps exactly k items every time (otherwise ⌊Σp⌋ or ⌈Σp⌉).
    """
    p = torch.as_tensor(probs, dtype=torch.float64)
    if ((p < 0) | (p > 1) | torch.isnan(p)).any():
        raise ValueError("keep probabilities must lie in [0, 1]")
    # generator None: torch's global random stream (seed it, or pass step_generator(...) to be resumable)
    if not fixed_size:
        return torch.rand(p.shape, generator=generator, dtype=torch.float64) < p
    if p.ndim == 1:
        return _systematic(p, generator)
    if p.ndim == 2:
        return torch.stack([_systematic(row, generator) for row in p])
    raise ValueError(f"probs must be 1-D or 2-D, got shape {tuple(p.shape)}")


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


# --------------------------------------------------------------------------------------------------
# Biased baselines (named as such)
# --------------------------------------------------------------------------------------------------


def cppo_keep(advantages: torch.Tensor, rate: float) -> torch.Tensor:
    """BIASED baseline (CPPO): keep the ``G - round(r·G)`` completions of each group with the largest |A|.

    Deterministic and unweighted: the kept set over-represents large-|A| completions, so the expected
    update is not GRPO's. Returns a bool mask shaped like ``advantages``; ties go to the lower index.
    """
    adv = torch.as_tensor(advantages, dtype=torch.float64)
    if not 0 <= rate < 1:
        raise ValueError(f"prune rate {rate!r} must be in [0, 1)")
    g = adv.shape[1]
    k = max(1, g - round(rate * g))
    order = torch.argsort(-adv.abs(), dim=1, stable=True)[:, :k]
    keep = torch.zeros_like(adv, dtype=torch.bool)
    keep.scatter_(1, order, True)
    return keep


def pods_keep(rewards: torch.Tensor, num_keep: int) -> torch.Tensor:
    """BIASED baseline (PODS, Xu et al. 2025, max-variance down-sampling): in each group, the ``num_keep``
    completions whose rewards have the largest variance.

    A subset of given size with the largest variance is made of the i lowest and the num_keep - i highest
    rewards for some i (the paper's lemma), so each row tries every i (ties go to the smallest i). Returns a
    bool mask shaped like ``rewards`` (P, G).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 2 or not 1 <= num_keep <= r.shape[1]:
        raise ValueError(f"rewards must be (P, G) and num_keep in [1, G]; got {tuple(r.shape)} and {num_keep}")
    keep = torch.zeros_like(r, dtype=torch.bool)
    for q in range(r.shape[0]):
        order = torch.argsort(r[q], stable=True)
        best, best_var = None, -1.0
        for i in range(num_keep + 1):
            idx = torch.cat([order[:i], order[r.shape[1] - (num_keep - i):]])
            var = float(r[q, idx].var(unbiased=False))
            if var > best_var + 1e-12:
                best, best_var = idx, var
        keep[q, best] = True
    return keep


def greso_keep_probs(history: PromptHistory, prompt_ids: Sequence[str], rate: float, *,
                     step: int | None = None, max_age: int | None = None) -> torch.Tensor:
    """BIASED baseline (GRESO): prompts whose last group was degenerate are skipped with probability r.

    The caller trains on the rest *without* weights, so prompts that were uninformative last time but
    informative now are under-represented. Returns keep probabilities (1 or 1 - r) per prompt.
    """
    if not 0 <= rate < 1:
        raise ValueError(f"prune rate {rate!r} must be in [0, 1)")
    out = []
    for pid in prompt_ids:
        rec = history.get(pid)
        fresh = rec is not None and not (max_age is not None and step is not None and step - rec.step > max_age)
        out.append(1 - rate if fresh and rec.degenerate else 1.0)
    return torch.tensor(out, dtype=torch.float64)
