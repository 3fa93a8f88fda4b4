"""Biased baselines, for comparison only (the tests and chapter 06 show their bias): the pruning rules of other
methods, unweighted, as :mod:`dppo_core.estimator`'s ``cppo``, ``greso`` and ``pods`` modes use them.

* :func:`cppo_keep` — CPPO: keep the top-k completions of each group by |A|, deterministically,
  without weights.
* :func:`greso_keep_probs` — GRESO: skip prompts whose last group had zero reward variance with a
  probability, and train on the rest without weights.
* :func:`pods_keep` — PODS: keep the completions of each group whose rewards vary most, without weights.

:func:`cppo_keep` and :func:`greso_keep_probs` are importable from :mod:`dppo_core.pruning` too.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        out.append(1 - rate if fresh and rec is not None and rec.degenerate else 1.0)  # fresh: rec is not None
    return torch.tensor(out, dtype=torch.float64)
