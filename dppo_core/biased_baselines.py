"""Biased baselines, for comparison only (the tests and chapter 06 show their bias): the pruning rules of
other methods, unweighted, as :mod:`dppo_core.estimator`'s ``cppo``, ``greso`` and ``pods`` modes use them.

* :func:`cppo_keep` — CPPO: keep the top-k completions of each group by |A|, deterministically,
  without weights.
* :func:`greso_keep_probs` — GRESO: skip prompts whose last group had zero reward variance with a
  probability, and train on the rest without weights; :func:`greso_streak_keep_probs` is GRESO's own rule (a
  probability that falls with the run of such groups, per side) and :class:`GRESOExploration` its adaptation.
* :func:`pods_keep` — PODS: keep the completions of each group whose rewards vary most, without weights.

:func:`cppo_keep` and :func:`greso_keep_probs` are importable from :mod:`dppo_core.pruning` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dppo_core.history import PromptHistory


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
        raise ValueError(f"rewards must be (P, G) and num_keep in [1, G]; got {tuple(r.shape)} and "
                         f"{num_keep}")
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
    """BIASED baseline (GRESO): prompts whose last group was all-equal are skipped with probability r.

    The caller trains on the rest *without* weights, so prompts that were uninformative last time but
    informative now are under-represented. Returns keep probabilities (1 or 1 - r) per prompt.
    """
    if not 0 <= rate < 1:
        raise ValueError(f"prune rate {rate!r} must be in [0, 1)")
    out = []
    for pid in prompt_ids:
        rec = history.get(pid)
        fresh = rec is not None and not (max_age is not None and step is not None
                                         and step - rec.step > max_age)
        # fresh: rec is not None
        out.append(1 - rate if fresh and rec is not None and rec.all_equal else 1.0)
    return torch.tensor(out, dtype=torch.float64)


#: GRESO's floor on a keep probability, and the range and step of its exploration probabilities (the authors'
#: code).
GRESO_MIN_KEEP, GRESO_P_RANGE, GRESO_P_STEP = 0.01, (0.05, 0.95), 0.01


def greso_streak_keep_probs(history: PromptHistory, prompt_ids: Sequence[str], p_solved: float,
                            p_unsolved: float, *, step: int | None = None,
                            max_age: int | None = None) -> torch.Tensor:
    """BIASED baseline, GRESO's own rule (Zheng et al. 2025, arXiv 2506.02177; its ``all_probabilistic``
    filter): a prompt whose last z groups in a row were all solved (all unsolved) is kept with probability
    max(p^z, 0.01), p the exploration probability of its side (``p_solved``, ``p_unsolved``); every other
    prompt with probability 1. An all-equal group at a reward of 0.5 or more counts as solved."""
    out = []
    for pid in prompt_ids:
        rec = history.get(pid)
        fresh = rec is not None and not (max_age is not None and step is not None
                                         and step - rec.step > max_age)
        z = rec.equal_streak if fresh and rec is not None else 0
        if z == 0 or rec is None:
            out.append(1.0)
            continue
        p = p_solved if rec.mean_reward >= 0.5 else p_unsolved
        out.append(max(p ** z, GRESO_MIN_KEEP))
    return torch.tensor(out, dtype=torch.float64)


@dataclass
class GRESOExploration:
    """GRESO's exploration probabilities, adapted once a step toward a target share of zero-variance groups:
    the solved side's toward a third of ``target``, the unsolved side's toward two thirds (the authors' split:
    hard prompts are more likely to change as the model improves). After each step, each p moves by 0.01
    within [0.05, 0.95]: down (skip more) while its side's share of every group rolled out so far is at or
    above its target, up otherwise. Both start at 0.5, as the authors' published run script sets them."""

    target: float
    p_solved: float = 0.5
    p_unsolved: float = 0.5
    groups: int = 0
    solved: int = 0
    unsolved: int = 0
    adapted_at: int = -1

    def count(self, rewards: torch.Tensor) -> None:
        """Count a step's rolled-out groups (rewards (P, G)): how many came out all solved, all unsolved."""
        r = torch.as_tensor(rewards, dtype=torch.float64)
        if r.numel() == 0:
            return
        equal = (r == r[:, :1]).all(dim=1)
        self.groups += r.shape[0]
        self.solved += int((equal & (r[:, 0] >= 0.5)).sum())
        self.unsolved += int((equal & (r[:, 0] < 0.5)).sum())

    def adapt(self, step: int) -> None:
        """Move both probabilities once for ``step`` (a later call for the same step does nothing), from the
        groups counted so far."""
        if step <= self.adapted_at or self.groups == 0:
            return
        self.adapted_at = step
        low, high = GRESO_P_RANGE
        for side, share, target in (("p_solved", self.solved / self.groups, self.target / 3),
                                    ("p_unsolved", self.unsolved / self.groups, 2 * self.target / 3)):
            p = getattr(self, side)
            setattr(self, side,
                    max(p - GRESO_P_STEP, low) if share >= target else min(p + GRESO_P_STEP, high))
