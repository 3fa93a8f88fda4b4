"""Exact expectations: the pruned loss and its gradient averaged over *every* draw, with its probability.

For small steps (a few candidate prompts, G = 3 completions of 0-4 tokens each, per-token log-probs as the
parameters θ), E[L̂(θ)] and E[∇L̂(θ)] are computed exactly, not sampled: the estimator's keep draws are
replaced by an enumeration of all their outcomes with their probabilities, and everything else runs the
package's own code, in ``DPPOTrainer.train_step``'s order through the trainer's own functions: ``select_prompts``
(the estimator's ``select``, drawing the candidates from a prompt source and looking ahead for dense prompts),
then after reward ``weigh_groups`` (``group_advantages``, the history's ``observe``, then ``weigh``), then
``DPPOTrainer.sequences`` and ``trainer.micro_batch_loss``, the loss ``update`` backpropagates. The outcomes of
a draw:

* independent Bernoulli draws (``torch.rand(p.shape) < p``): every keep mask, probability Π p^k (1-p)^(1-k);
* systematic PPS sampling (``fixed_size_sampling``): every unit order (n! of them, equally likely) and every
  interval of the start u ∈ [0, 1) on which :func:`dppo_core.pruning.systematic_draw` keeps the same set;
* the sorted designs (``fixed_size_design``): every order the sort key allows (ties in a random order), and
  then every start u (``sorted``) or every path through the coins of :func:`dppo_core.pruning.pivotal_draw`
  (``pivotal``, each coin's two sides with their probabilities).

The full-batch reference is GRPO over the same candidate window (every prompt and completion, weight 1),
through the same code. The matrices below are generated from the config's own tuples (prompt and completion
schemes, designs, loss types, reward scalings), with dense prompts on and off and the adaptive completion rate
on and off, and every other estimator setting varied or held fixed for a stated reason
(``test_the_matrices_cover_every_setting`` fails when a new one is not). Every combination must give a
relative bias ≤ 1e-9 (float64 rounding) or be refused by :class:`DPPOConfig`; tiny-dppo's own combination is
enumerated whole; and mutants of the estimator (the mistakes an implementation is likely to make,
tests/mutants.py) must show a bias.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import fields

import pytest
import torch
from mutants import EXACT_MUTANTS, MUTANTS, ProbsFromUpdatedHistory

from dppo_core import history as history_module
from dppo_core import pruning
from dppo_core.config import (
    COMPLETION_SCHEMES,
    FIXED_SIZE_DESIGNS,
    LOSS_TYPES,
    PROMPT_SCHEMES,
    PRUNING_MODES,
    SCALE_REWARDS,
    ConfigError,
    DPPOConfig,
    preset,
)
from dppo_core.data import prompt_key
from dppo_core.estimator import CONFIG_NAMES, ESTIMATORS, make_estimator
from dppo_core.grpo import group_advantages
from dppo_core.pruning import PromptHistory
from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup
from dppo_core.trainer import DPPOTrainer, micro_batch_loss

pytestmark = pytest.mark.numerics  # compares computed numbers: run under both kernel settings (Makefile)

G = 3
STEP = 7
TOL = 1e-9
# rewards of each candidate prompt's G completions: degenerate groups (all equal) and informative ones
REWARDS = {"q0": [1.0, 0.0, 0.0], "q1": [1.0, 0.5, 0.0], "q5": [1.0, 1.0, 1.0], "q2": [0.0, 1.0, 0.5],
           "q3": [0.0, 0.0, 0.0], "q4": [1.0, 0.0, 1.0]}
LENGTHS = {"q0": [2, 3, 1], "q1": [1, 2, 2], "q5": [1, 3, 2], "q2": [3, 0, 2], "q3": [2, 1, 1], "q4": [4, 1, 2]}
PAST = {  # the rewards each prompt's group got at steps STEP - 2 and STEP - 1 (q5 was never rolled out)
    STEP - 2: {"q0": [0.0, 0.0, 0.0], "q1": [1.0, 0.0, 0.0], "q3": [1.0, 1.0, 1.0], "q4": [0.0, 0.5, 1.0]},
    STEP - 1: {"q0": [1.0, 0.0, 0.0], "q1": [0.0, 0.0, 0.0], "q2": [1.0, 1.0, 0.0], "q3": [0.0, 0.0, 0.0],
               "q4": [0.0, 1.0, 0.0]},
}


def _history(until: int = STEP) -> PromptHistory:
    """The history before step ``until``: q1 and q3 looked degenerate last time (q1 has signal now), q5 is unseen."""
    h = PromptHistory()
    for step, rows in PAST.items():
        if step < until:
            r = torch.tensor(list(rows.values()))
            h.update(list(rows), r, group_advantages(r), step)
    return h


class Params:
    """θ: one float64 leaf of per-token log-probs per completion, with fixed old and reference log-probs."""

    def __init__(self, ids: list[str], ratio: bool):
        g = torch.Generator().manual_seed(3)
        self.leaves, self.old, self.ref = {}, {}, {}
        for q in ids:
            for i, n in enumerate(LENGTHS[q]):
                lp = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.1
                self.leaves[q, i] = lp.requires_grad_(True)
                # old log-probs 0.3 apart from θ: ratios outside [0.8, 1.2], so the clip acts on some tokens
                self.old[q, i] = lp.detach() + (0.3 * torch.randn(n, generator=g, dtype=torch.float64) if ratio else 0)
                self.ref[q, i] = lp.detach() + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)

    def flat_grad(self, loss: torch.Tensor | None) -> torch.Tensor:
        leaves = list(self.leaves.values())
        if loss is None:
            return torch.zeros(sum(x.numel() for x in leaves), dtype=torch.float64)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return torch.cat([torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads, strict=True)])


def _pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(x.numel() for x in rows)
    mask = torch.zeros(len(rows), t)
    out = torch.stack([torch.cat([x, torch.zeros(t - x.numel(), dtype=torch.float64)]) for x in rows])
    for j, x in enumerate(rows):
        mask[j, : x.numel()] = 1
    return out, mask


class Candidates:
    """A prompt source holding the step's candidates, handed out as the trainer's ``prompts.sample`` does."""

    def __init__(self, ids: list[str]):
        self.rows = [{"id": q, "prompt": [{"role": "user", "content": q}]} for q in ids]

    def sample(self, seed: int, step: int, n: int) -> list[dict]:
        assert n <= len(self.rows), f"the step asks for {n} candidates; the test holds {len(self.rows)}"
        return self.rows[:n]


class StepParts:
    """``DPPOTrainer``'s own functions for the parts of ``train_step`` that choose and weigh, on a stand-in that
    holds only what they read (the config, the estimator, the prompt source): no model, no engine."""

    select_prompts = DPPOTrainer.select_prompts
    weigh_groups = DPPOTrainer.weigh_groups
    _weigh = DPPOTrainer._weigh

    def __init__(self, config: DPPOConfig, estimator, ids: list[str]):
        self.config, self.estimator, self.prompts = config, estimator, Candidates(ids)


def run_step(config: DPPOConfig, estimator, ids: list[str], theta: Params, scale: bool = False,
             observe: bool = True) -> tuple[float, torch.Tensor, int]:
    """One step's loss L̂(θ), its gradient and the window |B|, through the trainer's code in ``train_step``'s order
    (``observe=False``: the estimator's ``weigh`` right after ``select``, the history untouched)."""
    parts = StepParts(config, estimator, ids)
    sel = parts.select_prompts(STEP)  # the candidates from the prompt source, as train_step draws them
    kept = [ids[i] for i in sel.indices]
    rewards = torch.tensor([REWARDS[q] for q in kept]).view(len(kept), G)
    lengths = torch.tensor([LENGTHS[q] for q in kept]).view(len(kept), G)
    if observe:  # train_step's order: advantages, the history records this step's groups, then weigh
        adv, weighting = parts.weigh_groups(sel, rewards, lengths, STEP)
    else:
        adv = group_advantages(rewards, config.scale_rewards)
        weighting = parts._weigh(adv, sel, STEP, rewards, lengths)
    batch = RolloutBatch([RolloutGroup(q, [1, 2], [Completion(list(range(3, 3 + n)), "", [], "stop")
                                                   for n in LENGTHS[q]]) for q in kept])
    seqs = DPPOTrainer.sequences(batch, adv, weighting)
    if not len(seqs):
        return 0.0, theta.flat_grad(None), sel.window
    cells = [(kept[gi], ci) for gi, ci in seqs.origin]
    logp, mask = _pad([theta.leaves[c] for c in cells])
    old, _ = _pad([theta.old[c] for c in cells])
    ref, _ = _pad([theta.ref[c] for c in cells])
    old, ref = old if config.num_iterations > 1 else None, ref if config.beta > 0 else None
    loss, _ = micro_batch_loss(config, seqs, list(range(len(seqs))), logp, mask, old, ref)
    if scale:  # the loss's size: Σ |each completion's term| (the normalisers are the step's, so terms add up)
        return sum(abs(micro_batch_loss(config, seqs, [j], logp[j:j + 1], mask[j:j + 1],
                                        None if old is None else old[j:j + 1],
                                        None if ref is None else ref[j:j + 1])[0].item()) for j in range(len(seqs)))
    return loss.item(), theta.flat_grad(loss), sel.window


# --- every outcome of a draw, with its probability -------------------------------------------------------


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


def _pivotal_outcomes(p: torch.Tensor, order_key: torch.Tensor | None = None,
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
        return (_pivotal_outcomes if design == "pivotal" else _systematic_outcomes)(row, row_key)

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


def _memo(fn):
    """``fn`` of tensors (or None), remembered by their values: the paths through a step's draws share the
    completions' keep probabilities of each prompt outcome (with the adaptive rate, a search over rates)."""
    found: dict = {}

    def memo(*args):
        key = tuple(None if a is None else (a.numpy().tobytes(), tuple(a.shape), str(a.dtype)) for a in args)
        if key not in found:
            found[key] = fn(*args)
        return found[key].clone()

    return memo


def exact_expectation(monkeypatch, config: DPPOConfig, estimator, ids: list[str], theta: Params,
                      observe: bool = True):
    """E[L̂(θ)], E[∇L̂(θ)] over every draw, the number of outcomes, and the (draw-independent) window. Each path
    starts from the same history (``observe`` adds the step's groups to it)."""
    enum = Enumerator()
    monkeypatch.setattr(pruning, "sample_keep", enum.sample_keep)
    if hasattr(estimator, "completion_probs"):  # a function of its arguments: computed once per distinct step
        monkeypatch.setattr(estimator, "completion_probs", _memo(estimator.completion_probs))
    loss, grad, total, n, windows = 0.0, 0.0, 0.0, 0, set()
    before = copy.deepcopy(estimator.history)
    while True:
        enum.start()
        estimator.history = copy.deepcopy(before)
        lv, gv, window = run_step(config, estimator, ids, theta, observe=observe)
        loss, grad, total, n = loss + enum.prob * lv, grad + enum.prob * gv, total + enum.prob, n + 1
        windows.add(window)
        if not enum.advance():
            break
    monkeypatch.undo()
    estimator.history = before
    assert abs(total - 1) < 1e-12 and len(windows) == 1
    return loss, grad, n, windows.pop()


def full_batch(config: DPPOConfig, ids: list[str], window: int, theta: Params) -> tuple[float, torch.Tensor, float]:
    """Full-batch GRPO over the window (every candidate and completion, weight 1) through the same code: its
    loss, gradient and Σ |per-completion terms| (the loss itself may nearly cancel: advantages sum to 0)."""
    full = config.with_overrides({"pruning": "none", "prompt_prune_rate": 0.0, "completion_prune_rate": 0.0,
                                  "prompts_per_step": window, "dense_prompts": False})
    loss, grad, _ = run_step(full, make_estimator(full), ids[:window], theta)
    return loss, grad, run_step(full, make_estimator(full), ids[:window], theta, scale=True)


def relative_bias(monkeypatch, config: DPPOConfig, estimator=None, random: bool = True, observe: bool = True):
    """Relative bias of the loss (against the size of its terms) and of the gradient, and the number of outcomes.
    The candidates: ``prompts_per_step`` (times ``prompt_window_factor`` with dense prompts) from ``REWARDS``."""
    k = config.prompts_per_step
    ids = list(REWARDS)[: k * config.prompt_window_factor if config.dense_prompts else k]
    if estimator is None:
        estimator = make_estimator(config)
        estimator.history = _history()
    theta = Params(ids, ratio=config.num_iterations > 1)
    loss, grad, n, window = exact_expectation(monkeypatch, config, estimator, ids, theta, observe)
    full_loss, full_grad, scale = full_batch(config, ids, window, theta)
    assert full_grad.abs().max() > 0 and (n > 1 or not random), "the setting should have a gradient and random draws"
    return abs(loss - full_loss) / scale, float((grad - full_grad).norm() / full_grad.norm()), n


def dppo_config(**overrides) -> DPPOConfig:
    base = dict(model="unused", pruning="dppo", prompts_per_step=3, num_generations=G, max_completion_length=4,
                prompt_prune_rate=0.5, completion_prune_rate=0.5, min_prompt_keep_prob=0.2,
                min_completion_keep_prob=0.2, beta=0.04, num_iterations=2)
    return DPPOConfig(**(base | overrides))


# --- the matrices, generated from the config's tuples ------------------------------------------------------

DESIGNS = {"bernoulli": dict(fixed_size_sampling=False),
           **{name: dict(fixed_size_sampling=True, fixed_size_design=name) for name in FIXED_SIZE_DESIGNS}}
ADAPTIVE = 4.0  # completion_target_ess: the rate is chosen per step from the advantages and π (before the draw)


def window_settings(dense: bool) -> dict:
    """Dense prompts look ahead over 2 × 2 candidates for 2 prompts; otherwise the step's 3 candidates."""
    return dict(dense_prompts=True, prompts_per_step=2, prompt_window_factor=2) if dense else {}


# The other estimator settings, taken in turn by the sampling matrix's combinations (each setting meets every
# scheme and design): the KL term and zero-advantage dropping (β = 0: A = 0 completions get p = 0), a PPO ratio
# ≠ 1 (clipping active), the posterior's half-life, the length exponent, the floors, the history's age limit and
# the prune rates.
ROTATION = (
    dict(beta=0.0, drop_zero_advantage=True, num_iterations=1, posterior_half_life=20.0, length_exponent=0.5,
         min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2, history_max_age=None, prompt_prune_rate=0.5,
         completion_prune_rate=0.5),
    dict(beta=0.0, drop_zero_advantage=False, num_iterations=2, posterior_half_life=None, length_exponent=1.0,
         min_prompt_keep_prob=0.4, min_completion_keep_prob=0.3, history_max_age=1, prompt_prune_rate=0.3,
         completion_prune_rate=0.7),
    dict(beta=0.04, drop_zero_advantage=True, num_iterations=2, posterior_half_life=5.0, length_exponent=0.0,
         min_prompt_keep_prob=0.2, min_completion_keep_prob=0.5, history_max_age=None, prompt_prune_rate=0.6,
         completion_prune_rate=0.4),
)
SAMPLING = [dict(prompt_scheme=ps, completion_scheme=cs, completion_target_ess=ess, **DESIGNS[design],
                 **window_settings(dense), **ROTATION[i % len(ROTATION)])
            for i, (ps, cs, design, dense, ess) in enumerate(itertools.product(
                PROMPT_SCHEMES, COMPLETION_SCHEMES, DESIGNS, (False, True), (None, ADAPTIVE)))]


def _sampling_id(settings: dict) -> str:
    design = settings.get("fixed_size_design", "systematic") if settings["fixed_size_sampling"] else "bernoulli"
    return "-".join([settings["prompt_scheme"], settings["completion_scheme"], design,
                     "dense" if settings.get("dense_prompts") else "window",
                     "adaptive" if settings["completion_target_ess"] else "fixed"])


@pytest.mark.parametrize("settings", SAMPLING, ids=_sampling_id)
def test_every_scheme_design_and_rate_is_exact(monkeypatch, settings):
    """Every prompt scheme × completion scheme × design × dense or not × fixed or adaptive completion rate. The
    ``fitted`` scheme's prior is fitted to the enumeration's few prompts (the threshold lowered), not left uniform."""
    monkeypatch.setattr(history_module, "MIN_PRIOR_GROUPS", 1)
    config = dppo_config(**settings)
    loss_bias, grad_bias, n = relative_bias(monkeypatch, config)
    print(f"{n} outcomes: relative bias of the loss {loss_bias:.1e}, of the gradient {grad_bias:.1e}")
    assert loss_bias <= TOL and grad_bias <= TOL, f"{n} outcomes: loss bias {loss_bias:.2e}, gradient {grad_bias:.2e}"


LOSSES = list(itertools.product(LOSS_TYPES, SCALE_REWARDS, DESIGNS, (False, True)))
#: what DPPOConfig refuses with prompt pruning, because it depends on which prompts were kept (exact with
#: completion pruning only)
REFUSED = {"loss_type": {"dapo"}, "scale_rewards": {"batch"}}


def loss_settings(loss_type: str, scale_rewards: str, design: str, dense: bool) -> dict:
    settings = dict(loss_type=loss_type, scale_rewards=scale_rewards, **DESIGNS[design], **window_settings(dense))
    if loss_type in REFUSED["loss_type"] or scale_rewards in REFUSED["scale_rewards"]:
        settings["prompt_prune_rate"] = 0.0
    return settings


@pytest.mark.parametrize("loss_type,scale_rewards,design,dense", LOSSES,
                         ids=lambda v: {True: "dense", False: "window"}.get(v, v) if isinstance(v, bool) else v)
def test_every_combination_is_exact_or_refused(monkeypatch, loss_type, scale_rewards, design, dense):
    """Every loss type × reward scaling × design × dense or not, with KL on and a PPO ratio ≠ 1 (clipping active):
    the hardest case for each."""
    settings = loss_settings(loss_type, scale_rewards, design, dense)
    if settings.get("prompt_prune_rate") == 0.0:
        refused = "loss_type" if loss_type in REFUSED["loss_type"] else "scale_rewards"
        with pytest.raises(ConfigError, match=refused):
            dppo_config(**(settings | {"prompt_prune_rate": 0.5}))
    config = dppo_config(**settings)
    loss_bias, grad_bias, n = relative_bias(monkeypatch, config)
    print(f"{n} outcomes: relative bias of the loss {loss_bias:.1e}, of the gradient {grad_bias:.1e}")
    assert loss_bias <= TOL and grad_bias <= TOL, f"{n} outcomes: loss bias {loss_bias:.2e}, gradient {grad_bias:.2e}"


def default_config(**overrides) -> DPPOConfig:
    """tiny-dppo's own combination (posterior prompts, dense prompts, completions ∝ |A| / length, sorted
    systematic sampling, its rates, floors, β and half-life), at the enumeration's size."""
    return preset("tiny-dppo").with_overrides(
        dict(model="unused", num_generations=G, max_completion_length=4, **window_settings(True)) | overrides)


@pytest.mark.parametrize("adaptive", [None, ADAPTIVE], ids=["fixed", "adaptive"])
def test_the_default_combination_is_exact_in_the_trainers_order(monkeypatch, adaptive):
    config = default_config(completion_target_ess=adaptive)
    assert (config.prompt_scheme, config.completion_scheme, config.fixed_size_design) == ("posterior", "length",
                                                                                         "sorted")
    loss_bias, grad_bias, n = relative_bias(monkeypatch, config)
    print(f"{n} outcomes: relative bias of the loss {loss_bias:.1e}, of the gradient {grad_bias:.1e}")
    assert loss_bias <= TOL and grad_bias <= TOL, f"{n} outcomes: loss bias {loss_bias:.2e}, gradient {grad_bias:.2e}"


#: estimator settings every matrix holds fixed, and why
HELD = {"seed": "the draws are enumerated, not seeded",
        "num_generations": "G = 3 keeps the enumeration small; nothing in the estimator special-cases G",
        "prompt_window_factor": "it only bounds how far a dense window looks; 2 keeps the enumeration small"}
#: the pruning modes that are not unbiased, each shown biased below
BIASED = ("cppo", "greso", "pods")


def test_the_matrices_cover_every_setting():
    """Each estimator setting (a field of any estimator, by its config name) is varied by the matrices above, or
    held for a reason in ``HELD``; each member of the config's tuples of choices is enumerated; and each pruning
    mode is either exact (none, dppo) or shown biased. A new scheme, design or setting fails here until covered."""
    configs = [dppo_config(**s) for s in SAMPLING] + [dppo_config(**loss_settings(*c)) for c in LOSSES]
    configs += [default_config(completion_target_ess=a) for a in (None, ADAPTIVE)]
    settings = {CONFIG_NAMES.get(f.name, f.name) for cls in ESTIMATORS.values() for f in fields(cls)
                if f.init and f.name != "history"}
    for name in sorted(settings - set(HELD)):
        values = {getattr(c, name) for c in configs}
        assert len(values) >= 2, f"{name} takes only {values} in the exact matrices: vary it or say why in HELD"
    for name, choices in (("prompt_scheme", PROMPT_SCHEMES), ("completion_scheme", COMPLETION_SCHEMES),
                          ("fixed_size_design", FIXED_SIZE_DESIGNS), ("loss_type", LOSS_TYPES),
                          ("scale_rewards", SCALE_REWARDS)):
        enumerated = {getattr(c, name) for c in configs if c.fixed_size_sampling or name != "fixed_size_design"}
        assert enumerated == set(choices), f"{name}: {set(choices) - enumerated} never enumerated"
    assert set(PRUNING_MODES) == {"none", "dppo", *BIASED}


POOLS = ([0.5, 0.5, 1.0, 0.2, 0.8], [0.3, 0.45, 0.9, 0.15], [1 / 3, 2 / 3, 1.0, 0.0, 0.25], [0.6, 0.7, 0.3, 0.4, 0.5])
KEYS = ([3.0, -1.0, 0.5, 0.5, 2.0], [0.0, 1.0, -2.0, 1.0], None, [1.0, 1.0, 1.0, -1.0, -1.0])  # with ties


@pytest.mark.parametrize("design", ["systematic", "sorted", "pivotal"])
def test_each_fixed_size_design_keeps_each_unit_with_its_probability(design):
    """Inclusion probabilities of every fixed-size design, exactly, for pools with integral and fractional Σp,
    in a random order and sorted by a key with ties; and a constant count."""
    for p, key in zip(POOLS, KEYS, strict=True):
        p = torch.tensor(p, dtype=torch.float64)
        found = outcomes(p, True, design, None if key is None else torch.tensor(key))
        assert abs(sum(v for _, v in found) - 1) < 1e-12
        incl = sum(v * k.double() for k, v in found)
        assert (incl - p).abs().max() < 1e-12, f"{design}: {incl.tolist()} against {p.tolist()}"
        sizes = {int(k.sum()) for k, _ in found}
        assert sizes <= {math.floor(float(p.sum()) + 1e-9), math.ceil(float(p.sum()) - 1e-9)}


def test_the_enumeration_sees_a_wrong_pivotal_coin():
    """The power of the inclusion test: a pivotal step whose survivor is chosen 50:50 instead of a : b is off."""

    def fair_coin_pivotal(p, order, coin):
        return pruning.pivotal_draw(p, order, lambda q: coin(0.5 if q < 1 else q))

    p = torch.tensor([0.3, 0.45, 0.9, 0.15], dtype=torch.float64)
    found = _pivotal_outcomes(p, torch.tensor([0.0, 1.0, -2.0, 1.0]), draw=fair_coin_pivotal)
    incl = sum(v * k.double() for k, v in found)
    assert (incl - p).abs().max() > 0.05


def test_the_sorted_designs_spread_the_kept_set_over_the_key():
    """What the sorted designs are for: with half of a group kept, the kept set of a sorted design always holds
    both signs of the advantage; a random order sometimes keeps only one."""
    p = torch.full((6,), 0.5, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.2, 0.8, -1.0, -0.9, -1.1])
    for design, one_sided in (("systematic", True), ("sorted", False), ("pivotal", False)):
        found = outcomes(p, True, design, adv)
        mass = sum(v for k, v in found if bool((adv[k] > 0).all()) or bool((adv[k] < 0).all()))
        assert (mass > 0) == one_sided, f"{design}: P(one sign only) = {mass}"


# --- mutants: the mistakes an implementation is likely to make must show a bias --------------------------


VARIANCE_AWARE = dict(prompt_scheme="posterior", completion_scheme="length", length_exponent=1.0)
MUTANT_MIN = 1e3 * TOL  # a mutant's relative bias must be far above float64 rounding: the suite rejects it


def _mutant(mutant, config: DPPOConfig):
    est = mutant.from_config(config)
    est.history = _history()
    if hasattr(type(est), "stale"):  # the history one step before: what a stale π is computed from
        est.stale = _history(until=STEP - 1)
    return est


@pytest.mark.parametrize("mutant", [m for m in MUTANTS + EXACT_MUTANTS if not getattr(m, "dense_only", False)],
                         ids=lambda m: m.__name__)
@pytest.mark.parametrize("design", list(DESIGNS))
@pytest.mark.parametrize("schemes", [dict(beta=0.04), dict(beta=0.0, **VARIANCE_AWARE)],
                         ids=["paper-proportional-kl", "posterior-length"])
def test_mutants_are_biased(monkeypatch, mutant, design, schemes):
    """dppo_paper's schemes with the KL term (every kept group has a loss), and the variance-aware schemes
    with A = 0 completions dropped."""
    config = dppo_config(num_iterations=1, **DESIGNS[design], **schemes)
    _, grad_bias, _ = relative_bias(monkeypatch, config, estimator=_mutant(mutant, config))
    print(f"{mutant.__name__} ({design}, {config.prompt_scheme}/{config.completion_scheme}): relative bias of the "
          f"gradient {grad_bias:.3g}")  # shown with pytest -s (docs/estimator.md quotes them)
    assert grad_bias > MUTANT_MIN, f"{mutant.__name__}: gradient bias only {grad_bias:.2e}"
    # and the real estimator, same setting, passes
    loss_bias, grad_bias, _ = relative_bias(monkeypatch, config)
    assert grad_bias <= TOL


@pytest.mark.parametrize("mutant", MUTANTS + EXACT_MUTANTS, ids=lambda m: m.__name__)
def test_mutants_are_biased_in_the_default_combination(monkeypatch, mutant):
    """tiny-dppo's combination (dense prompts included), in the trainer's order: every mutant is rejected, those
    whose bias is too small for the Monte Carlo test (weights 3% off, π stale in dense windows only) too."""
    config = default_config()
    _, grad_bias, _ = relative_bias(monkeypatch, config, estimator=_mutant(mutant, config))
    print(f"{mutant.__name__} (tiny-dppo): relative bias of the gradient {grad_bias:.3g}")
    assert grad_bias > MUTANT_MIN, f"{mutant.__name__}: gradient bias only {grad_bias:.2e}"


def test_a_weigh_that_reads_the_history_is_caught_only_in_the_trainers_order(monkeypatch):
    """Why the exact tests call ``observe`` between ``select`` and ``weigh``, as ``train_step`` does: a ``weigh``
    that recomputes π_q from the history is exact when called right after ``select``, and biased once the
    history holds the step's own groups."""
    config = default_config()
    _, unobserved, _ = relative_bias(monkeypatch, config, estimator=_mutant(ProbsFromUpdatedHistory, config),
                                     observe=False)
    _, observed, _ = relative_bias(monkeypatch, config, estimator=_mutant(ProbsFromUpdatedHistory, config))
    print(f"relative bias of the gradient: {unobserved:.1e} without observe, {observed:.3g} in train_step's order")
    assert unobserved <= TOL and observed > MUTANT_MIN


@pytest.mark.parametrize("loss_type,scale_rewards", [("dapo", "group"), ("grpo", "batch")])
def test_the_refused_combinations_would_be_biased(monkeypatch, loss_type, scale_rewards):
    """Why DPPOConfig refuses them: forced past the check, their exact expectation is off."""
    config = dppo_config(beta=0.0, num_iterations=1)
    object.__setattr__(config, "loss_type", loss_type)  # past the config's check, for this demonstration only
    object.__setattr__(config, "scale_rewards", scale_rewards)
    _, grad_bias, _ = relative_bias(monkeypatch, config)
    print(f"{loss_type} / {scale_rewards} with prompt pruning: relative bias of the gradient {grad_bias:.3g}")
    assert grad_bias > 1e-3, f"{loss_type} / {scale_rewards}: gradient bias only {grad_bias:.2e}"


# --- end to end: the gradient that reaches the optimizer, through the trainer's update ---------------------


def test_the_gradient_reaching_the_optimizer_is_exact_in_expectation(monkeypatch, tiny_model_dir, tmp_path):
    """The embedded tiny model, real rollouts, ``trainer.update`` (micro-batches, KL to the reference): the
    expected gradient at ``optimizer.step`` over every draw equals full-batch GRPO's (float32 rounding)."""
    from dppo_core.rollout import HFRollout, SamplingConfig

    def parity(prompts, completions, **columns):
        return [float(len(c) % 2 == 0) for c in completions]

    config = DPPOConfig(model=str(tiny_model_dir), output_dir=str(tmp_path), pruning="dppo", prompts_per_step=2,
                        num_generations=2, max_completion_length=6, prompt_prune_rate=0.5, completion_prune_rate=0.5,
                        min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2, beta=0.04, max_grad_norm=0.0,
                        micro_batch_size=2)
    trainer = DPPOTrainer(config, reward_funcs=[parity], progress=False)
    rows = trainer.prompts.sample(0, 0, 2)
    batch = HFRollout(trainer.model, trainer.tokenizer).generate(
        [r["prompt"] for r in rows], 2, SamplingConfig(max_tokens=6, temperature=1.0, seed=1))
    rewards = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # both groups informative: every completion's draw matters
    history = PromptHistory()  # the first prompt unseen (kept for sure), the second degenerate last time
    history.update([prompt_key(rows[1])], torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2), STEP - 1)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads: list[torch.Tensor] = []
    monkeypatch.setattr(trainer.optimizer, "step", lambda *a, **k: grads.append(
        torch.cat([p.grad.flatten().double() if p.grad is not None else torch.zeros(p.numel()) for p in params])))

    def gradient(estimator_config) -> torch.Tensor:
        trainer.config = estimator_config
        trainer.estimator = make_estimator(estimator_config)
        trainer.estimator.history = copy.deepcopy(history)  # each draw from the same history
        sel = trainer.select_prompts(STEP, candidates=rows)
        if not sel.rows:
            return torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
        groups = [batch.groups[i] for i in sel.indices]
        lengths = torch.tensor([[c.length for c in g.completions] for g in groups])
        adv, weighting = trainer.weigh_groups(sel, rewards[sel.indices], lengths, STEP)  # observe, then weigh
        seqs = trainer.sequences(RolloutBatch(groups), adv, weighting)
        grads.clear()
        trainer.update(seqs)
        return grads[-1]

    enum, original = Enumerator(), pruning.sample_keep
    monkeypatch.setattr(pruning, "sample_keep", enum.sample_keep)
    expected, n = 0.0, 0
    while True:
        enum.start()
        g = gradient(config)  # (this sets enum.prob: read it after)
        expected, n = expected + enum.prob * g, n + 1
        if not enum.advance():
            break
    monkeypatch.setattr(pruning, "sample_keep", original)
    full = gradient(config.with_overrides({"pruning": "none", "prompt_prune_rate": 0.0,
                                           "completion_prune_rate": 0.0}))
    assert n == 20 and full.norm() > 0  # 4 draws of the first group's completions, and 16 with both prompts
    bias = float((expected - full).norm() / full.norm())
    assert bias < 1e-5, f"over {n} outcomes: relative bias of the update's gradient {bias:.2e}"


BASELINES = [dict(pruning="cppo", prompt_prune_rate=0.0, completion_prune_rate=0.5),
             dict(pruning="greso", prompt_prune_rate=0.5, completion_prune_rate=0.0),
             dict(pruning="pods", prompt_prune_rate=0.0, completion_prune_rate=0.5)]


@pytest.mark.parametrize("baseline", BASELINES, ids=lambda b: b["pruning"])
def test_the_biased_baselines_are_biased(monkeypatch, baseline):
    """The negative controls' exact bias on the same steps (CPPO and PODS draw nothing: one outcome)."""
    assert {b["pruning"] for b in BASELINES} == set(BIASED)
    config = dppo_config(beta=0.0, num_iterations=1, **baseline)
    _, grad_bias, n = relative_bias(monkeypatch, config, random=baseline["pruning"] == "greso")
    print(f"{baseline['pruning']}: {n} outcomes, relative bias of the gradient {grad_bias:.3g}")
    assert grad_bias > 0.01


def test_grpo_skip_trains_on_fewer_completions_with_grpos_exact_gradient(monkeypatch):
    """The bench's grpo_skip: nothing pruned but the completions whose loss is identically zero (A = 0, β = 0)."""
    config = dppo_config(prompt_prune_rate=0.0, completion_prune_rate=0.0, beta=0.0, num_iterations=1)
    loss_bias, grad_bias, n = relative_bias(monkeypatch, config, random=False)
    assert n == 1 and loss_bias <= 1e-12 and grad_bias <= 1e-12
    est = make_estimator(config)
    ids = list(REWARDS)[:3]
    rewards = torch.tensor([REWARDS[q] for q in ids])
    w = est.weigh(group_advantages(rewards), est.select(ids, STEP), STEP)
    # skipped: q5's whole group (all rewards equal) and q1's middle completion (its reward is the group's mean)
    assert w.keep.sum() == 5 and w.weights[w.keep].eq(1).all()
