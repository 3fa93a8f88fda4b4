"""Mutants of the DPPO estimator: the mistakes an implementation is likely to make.

Each must be caught by the unbiasedness tests (tests/test_exact_expectation.py by exact enumeration,
tests/test_unbiased.py by Monte Carlo through the trainer), which shows that those tests have the power to
see a small bias, not only a large one.
"""

from __future__ import annotations

import torch

from dppo_core.estimator import DPPOEstimator, Weighting
from dppo_core.pruning import PromptHistory


class ScaledRandomWeights(DPPOEstimator):
    """Weights of the randomly kept completions (p < 1) 5% too large."""

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        w = super().weigh(advantages, selection, step, **kwargs)
        probs = self.completion_probs(advantages, kwargs.get("lengths"), None if selection is None else selection.probs)
        random = (probs < 1) & w.keep
        return Weighting(w.keep, torch.where(random, w.weights * 1.05, w.weights), w.num_sequences)


class NoPromptFloor(DPPOEstimator):
    """The floor ignored: prompts whose last group was degenerate get keep probability 0 (never rolled out)."""

    def prompt_probs(self, ids, step, budget=None):
        p = super().prompt_probs(ids, step, budget)
        scores = torch.tensor([self.history.score(i, step, self.history_max_age) or 0.0 for i in ids])
        return torch.where((scores == 0) & (p < 1), torch.zeros_like(p), p)


class StalePromptProbs(DPPOEstimator):
    """π taken one step stale: the prompts are drawn with today's π, but weighted by the previous step's."""

    stale: PromptHistory | None = None

    def select(self, candidate_ids, step, size=None):
        sel = super().select(candidate_ids, step, size)
        now, self.history = self.history, self.stale
        try:
            sel.probs = self.prompt_probs([candidate_ids[i] for i in sel.indices], step)
        finally:
            self.history = now
        return sel


class KeptCountNormaliser(DPPOEstimator):
    """C = the number of completions kept (a ratio), instead of the constant |B|·G."""

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        w = super().weigh(advantages, selection, step, **kwargs)
        return Weighting(w.keep, w.weights, max(1, int(w.keep.sum())))


MUTANTS = (ScaledRandomWeights, NoPromptFloor, StalePromptProbs, KeptCountNormaliser)
