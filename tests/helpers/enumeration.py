"""Every outcome of the estimator's keep draws, with its probability: what the exact-expectation tests
(tests/unit/test_exact_expectation.py, and its model run in tests/system/test_exact_expectation_model.py) put in
place of ``pruning.sample_keep`` to average over *every* draw instead of sampling."""

from __future__ import annotations

import itertools
import math

import torch

from dppo_core import pruning


def _bernoulli_outcomes(p: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
    free = [j for j in range(p.numel()) if 0 < p[j] < 1]
    out = []
    for bits in itertools.product((False, True), repeat=len(free)):
        keep, prob = p >= 1, 1.0
        for j, b in zip(free, bits, strict=True):
            keep[j] = b
            prob *= float(p[j]) if b else 1 - float(p[j])
        out.append((keep.clone(), prob))
    return out


def _orders(n: int, order_key: torch.Tensor | None) -> list[tuple[torch.Tensor, float]]:
    """Every unit order a fixed-size design can walk, with its probability: all n! (random order), or those
    sorted by ``order_key`` with ties in every order (the design breaks them at random)."""
    if order_key is None:
        return [(torch.tensor(perm), 1 / math.factorial(n)) for perm in itertools.permutations(range(n))]
    key = torch.as_tensor(order_key, dtype=torch.float64).tolist()
    ties = [[j for j in range(n) if key[j] == v] for v in sorted(set(key))]
    out = []
    for combo in itertools.product(*[itertools.permutations(t) for t in ties]):
        out.append((torch.tensor([j for t in combo for j in t]), 1 / math.prod(math.factorial(len(t)) for t in ties)))
    return out


def _systematic_outcomes(p: torch.Tensor, order_key: torch.Tensor | None = None) -> list[tuple[torch.Tensor, float]]:
    found: dict[tuple[bool, ...], float] = {}
    for order, weight in _orders(p.numel(), order_key):
        cum = torch.cumsum(p[order], 0)
        cum = torch.where((cum - cum.round()).abs() < 1e-9, cum.round(), cum)  # as systematic_draw snaps
        cuts = sorted({0.0, 1.0, *[float(c - math.floor(c)) for c in cum]})
        for a, b in itertools.pairwise(cuts):
            if b > a:  # the kept set is constant for u in (a, b)
                keep = pruning.systematic_draw(p, order, (a + b) / 2)
                key = tuple(keep.tolist())
                found[key] = found.get(key, 0.0) + (b - a) * weight
    return [(torch.tensor(k, dtype=torch.bool), v) for k, v in found.items()]


def pivotal_outcomes(p: torch.Tensor, order_key: torch.Tensor | None = None,
                      draw=pruning.pivotal_draw) -> list[tuple[torch.Tensor, float]]:
    """Every path through the coins of ``draw`` (the package's pivotal_draw), for every order."""
    found: dict[tuple[bool, ...], float] = {}
    for order, weight in _orders(p.numel(), order_key):
        path: list[bool] = []
        while True:
            pos, prob = 0, weight

            def coin(q, path=path):
                nonlocal pos, prob
                if pos == len(path):
                    path.append(True)
                side = path[pos]
                prob *= q if side else 1 - q
                pos += 1
                return side

            keep = draw(p, order, coin)
            del path[pos:]
            if prob > 0:
                key = tuple(keep.tolist())
                found[key] = found.get(key, 0.0) + prob
            while path and not path[-1]:  # next path: the last True side becomes False
                path.pop()
            if not path:
                break
            path[-1] = False
    return [(torch.tensor(k, dtype=torch.bool), v) for k, v in found.items()]


def outcomes(probs: torch.Tensor, fixed_size: bool, design: str = "systematic",
             order_key: torch.Tensor | None = None) -> list[tuple[torch.Tensor, float]]:
    """Every result of ``pruning.sample_keep(probs, ..., fixed_size, design=, order_key=)`` with its probability
    (rows independent)."""
    p = torch.as_tensor(probs, dtype=torch.float64)
    key = None if order_key is None or design == "systematic" else torch.as_tensor(order_key, dtype=torch.float64)

    def one(row, row_key):
        if not fixed_size:
            return _bernoulli_outcomes(row)
        return (pivotal_outcomes if design == "pivotal" else _systematic_outcomes)(row, row_key)

    if p.ndim == 1:
        return one(p, key)
    out = []
    rows = [one(row, None if key is None else key[q]) for q, row in enumerate(p)]
    for combo in itertools.product(*rows):
        out.append((torch.stack([k for k, _ in combo]), math.prod(v for _, v in combo)))
    return out


class Enumerator:
    """Stands in for ``pruning.sample_keep``: replays one path through the tree of the step's draws."""

    def __init__(self):
        self.path: list[int] = []
        self.arity: list[int] = []
        self.cache: dict = {}  # the same probabilities come back on every path: enumerate them once

    def start(self):
        self.pos, self.prob = 0, 1.0

    def sample_keep(self, probs, generator=None, fixed_size=False, *, design="systematic", order_key=None):
        p = torch.as_tensor(probs, dtype=torch.float64)
        okey = None if order_key is None else torch.as_tensor(order_key, dtype=torch.float64)
        okey_bytes = None if okey is None else okey.numpy().tobytes()
        key = (p.numpy().tobytes(), tuple(p.shape), fixed_size, design, okey_bytes)
        if key not in self.cache:
            self.cache[key] = outcomes(p, fixed_size, design, okey)
            assert abs(sum(v for _, v in self.cache[key]) - 1) < 1e-12
        dist = self.cache[key]
        if self.pos == len(self.path):
            self.path.append(0)
            self.arity.append(len(dist))
        keep, prob = dist[self.path[self.pos]]
        self.pos += 1
        self.prob *= prob
        return keep

    def advance(self) -> bool:
        """Next path (an odometer whose later digits depend on the earlier ones); False when all are done."""
        del self.path[self.pos:], self.arity[self.pos:]
        while self.path:
            self.path[-1] += 1
            if self.path[-1] < self.arity[-1]:
                return True
            self.path.pop()
            self.arity.pop()
        return False
