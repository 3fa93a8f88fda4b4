"""Pilot, then continue: joining each continued group's first k completions (its pilot) with the G - k rolled out
after the continue draw, so that the group's advantages, weights and loss are those of one group of G.

The step (:meth:`dppo_core.trainer.DPPOTrainer.roll_out`): roll out k completions for every kept prompt, reward
them, draw which groups continue (:meth:`dppo_core.estimator.DPPOEstimator.continue_groups`: every group whose
pilot's rewards differ, each other one with probability c_q), roll out and reward the rest of the continued groups
in a second engine call, then :func:`join` pilot and rest. A stopped group's pilot is recorded in the prompt history
and the group log, generated but not trained on. Why it is exact: docs/estimator.md ("Pilot, then continue").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dppo_core.rollout import RolloutBatch, RolloutGroup


def join(pilot: torch.Tensor, rest: torch.Tensor, continued: Sequence[int]) -> torch.Tensor:
    """The continued groups' (P', G) rows: each continued group's pilot row (of ``pilot``, (P, k)) followed by its
    row of ``rest`` ((P', G - k), in the order of ``continued``). The pilot's rewards are the group's too: the
    group's advantages are over all G."""
    return torch.cat([pilot[list(continued)], rest], dim=1)


def join_batches(pilot: RolloutBatch, rest: RolloutBatch, continued: Sequence[int]) -> RolloutBatch:
    """The continued groups of ``pilot`` (positions ``continued``), each with its completions of ``rest`` after
    its pilot's."""
    groups = [pilot.groups[j] for j in continued]
    if len(groups) != len(rest.groups):
        raise ValueError(f"{len(groups)} continued groups but {len(rest.groups)} groups rolled out after the pilot")
    return RolloutBatch([RolloutGroup(p.prompt, p.prompt_ids, p.completions + r.completions)
                         for p, r in zip(groups, rest.groups, strict=True)])


def join_means(first: dict[str, float], n_first: int, second: dict[str, float], n_second: int) -> dict[str, float]:
    """The mean of each reward function over both rounds' completions (``n_first`` and ``n_second`` of them)."""
    total = max(1, n_first + n_second)
    return {k: (first.get(k, 0.0) * n_first + second.get(k, 0.0) * n_second) / total for k in {*first, *second}}
