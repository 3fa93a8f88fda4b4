"""The draws of pruning: given keep probabilities, which items a step keeps.

Every draw keeps item j with probability exactly p_j, the probability its weight 1 / p_j divides by
(:func:`dppo_core.pruning.importance_weights`), which is what keeps the pruned loss unbiased:

* independent Bernoulli(p_j) draws (:func:`sample_keep`), a random count;
* fixed-size designs with the same inclusion probabilities and a constant count Σp (when it is an integer):
  ``systematic`` (systematic PPS in a random order, :func:`systematic_draw`), ``sorted`` (the same along a
  score: a stratified sample) and ``pivotal`` (ordered pivotal sampling, :func:`pivotal_draw`).

:func:`step_generator` gives each step's draws a random stream that depends on (seed, step, stage) only, so a
resumed run draws what an uninterrupted one would. Importable from :mod:`dppo_core.pruning` too, where the
estimator and the tests look them up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch

from dppo_core.config_checks import FIXED_SIZE_DESIGNS

__all__ = ["pivotal_draw", "sample_keep", "step_generator", "systematic_draw"]


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


def pivotal_draw(p: torch.Tensor, order: torch.Tensor, coin: Callable[[float], bool]) -> torch.Tensor:
    """Ordered pivotal sampling (Deville and Tillé 1998) of a 1-D pool, given its randomness: the order and
    the coins.

    Walking ``order``, the unit still undecided ("the pivot", probability a) meets the next one (b): if
    a + b < 1 one of them drops to 0 and the other takes a + b (the pivot keeps it with probability
    a / (a + b)); otherwise one rises to 1 (kept) and the other carries a + b - 1 (the pivot is the one kept
    with probability (1 - b) / (2 - a - b)). Each duel keeps both units' expected values, so unit j is kept
    with probability exactly p_j, and Σp items are kept when Σp is an integer (⌊Σp⌋ or ⌈Σp⌉ otherwise).
    Neighbours in ``order`` compete, so sorting by a score spreads the kept set over the score's range (like
    a stratified sample) with a random, not periodic, pattern. ``coin(q)`` returns True with probability q.
    """
    keep = torch.zeros(p.numel(), dtype=torch.bool)
    pivot, a = None, 0.0
    for j in order.tolist():
        b = float(p[j])
        if b >= 1 - 1e-12:
            keep[j] = True
            continue
        if b <= 1e-12:
            continue
        if pivot is None:
            pivot, a = j, b
            continue
        total = a + b
        if total < 1 - 1e-12:  # one of the two drops out; the survivor is the new pivot with a + b
            pivot, a = (pivot, total) if coin(a / total) else (j, total)
        elif total > 1 + 1e-12:  # one is kept; the other goes on with a + b - 1
            if coin((1 - b) / (2 - total)):
                keep[pivot] = True
                pivot, a = j, total - 1
            else:
                keep[j] = True
                a = total - 1
        else:  # exactly 1: one of the two is kept, the other is out
            keep[pivot if coin(a) else j] = True
            pivot, a = None, 0.0
    if pivot is not None and coin(a):  # the last remainder (Σp not an integer)
        keep[pivot] = True
    return keep


def _fixed_size(p: torch.Tensor, generator: torch.Generator | None, design: str,
                order_key: torch.Tensor | None) -> torch.Tensor:
    """One row of a fixed-size design, its randomness drawn from ``generator``."""
    if p.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    if design == "systematic" or order_key is None:
        order = torch.randperm(p.numel(), generator=generator)
    else:  # ties broken at random, so equal scores do not always meet in the same order
        jitter = torch.rand(p.numel(), generator=generator, dtype=torch.float64)
        order = torch.from_numpy(np.lexsort((jitter.numpy(),
                                             torch.as_tensor(order_key, dtype=torch.float64).numpy())))
    if design == "pivotal":
        return pivotal_draw(p, order,
                            lambda q: bool(torch.rand((), generator=generator, dtype=torch.float64) < q))
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return systematic_draw(p, order, u)


def sample_keep(probs: torch.Tensor, generator: torch.Generator | None = None,
                fixed_size: bool = False, *, design: str = "systematic",
                order_key: torch.Tensor | None = None) -> torch.Tensor:
    """Draw which items to keep: a bool tensor shaped like ``probs`` (1-D, or 2-D sampled row by row).

    ``generator``: the random stream (default: torch's global one); the trainer passes
    :func:`step_generator` so a resumed run draws the same.

    ``fixed_size=False``: independent Bernoulli(p) draws. ``fixed_size=True``: a design with the same
    inclusion probabilities but a constant count, in each row: a row whose probabilities sum to an integer k
    keeps exactly k items every time (otherwise ⌊Σp⌋ or ⌈Σp⌉). ``design`` (one of ``FIXED_SIZE_DESIGNS``):
    ``systematic`` (:func:`systematic_draw` in a random order), ``sorted`` (the same in the order of
    ``order_key``, shaped like ``probs``: a stratified sample, lower variance when the key tracks the
    items' gradients, e.g. the signed advantage) or ``pivotal`` (:func:`pivotal_draw` in that order).
    Without ``order_key`` the order is random for every design.
    """
    p = torch.as_tensor(probs, dtype=torch.float64)
    if ((p < 0) | (p > 1) | torch.isnan(p)).any():
        raise ValueError("keep probabilities must lie in [0, 1]")
    if design not in FIXED_SIZE_DESIGNS:
        raise ValueError(f"design={design!r}: choose one of {FIXED_SIZE_DESIGNS}")
    if order_key is not None and torch.as_tensor(order_key).shape != p.shape:
        raise ValueError(f"order_key {tuple(torch.as_tensor(order_key).shape)} must have the shape of probs "
                         f"{tuple(p.shape)}")
    # generator None: torch's global random stream (seed it, or pass step_generator(...) to be resumable)
    if not fixed_size:
        return torch.rand(p.shape, generator=generator, dtype=torch.float64) < p
    if p.ndim == 1:
        return _fixed_size(p, generator, design, order_key)
    if p.ndim == 2:
        keys = [None] * p.shape[0] if order_key is None else list(torch.as_tensor(order_key))
        return torch.stack([_fixed_size(row, generator, design, key)
                            for row, key in zip(p, keys, strict=True)])
    raise ValueError(f"probs must be 1-D or 2-D, got shape {tuple(p.shape)}")
