"""Exact expectations: the pruned loss and its gradient averaged over *every* draw, with its probability.

For small steps (a few candidate prompts, G = 3 completions of 0-4 tokens each, per-token log-probs as the
parameters θ), E[L̂(θ)] and E[∇L̂(θ)] are computed exactly, not sampled: the estimator's keep draws are
replaced by an enumeration of all their outcomes with their probabilities, and everything else runs the
package's own code, in ``DPPOTrainer.train_step``'s order through the trainer's own functions: ``select_prompts``
(the estimator's ``select``, drawing the candidates from a prompt source and looking ahead for dense prompts),
then after reward ``weigh`` (``group_advantages``, the history's ``observe``, then the estimator's ``weigh``), then
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
tests/helpers/mutants.py) must show a bias. The enumeration of every draw is tests/helpers/enumeration.py; the
same expectation through the embedded model's real update is tests/system/test_exact_expectation_model.py.
The machinery (the step, its exact expectation, the matrices) is tests/helpers/exact.py; the sampling matrix, whose
192 settings take minutes to enumerate, runs in tests/system/test_exact_sampling_matrix.py, the rest here.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch
from enumeration import outcomes, pivotal_outcomes
from exact import (
    ADAPTIVE,
    DESIGNS,
    LOSSES,
    PILOT,
    PILOT_IDS,
    REFUSED,
    REWARDS,
    SAMPLING,
    STEP,
    TOL,
    default_config,
    dppo_config,
    history_before,
    loss_settings,
    pilot_id,
    relative_bias,
)
from mutants import EXACT_MUTANTS, MUTANTS, PILOT_JOIN_MUTANTS, PILOT_MUTANTS, ProbsFromUpdatedHistory

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
)
from dppo_core.estimator import CONFIG_NAMES, ESTIMATORS, make_estimator
from dppo_core.grpo import group_advantages

# Not marked `numerics`: float64 on a few tokens, no matrix product, and every check either exact (≤ 1e-9, float64
# rounding is ~1e-16) or a bias far above it (> 1e-6), so the second kernel setting (Makefile) cannot change an
# outcome. The end-to-end check through a model's update, which can, is tests/system/test_exact_expectation_model.py.


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


@pytest.mark.parametrize("adaptive", [None, ADAPTIVE], ids=["fixed", "adaptive"])
def test_the_default_combination_is_exact_in_the_trainers_order(monkeypatch, adaptive):
    config = default_config(completion_target_ess=adaptive)
    assert (config.prompt_scheme, config.completion_scheme, config.fixed_size_design) == ("posterior", "length",
                                                                                         "sorted")
    loss_bias, grad_bias, n = relative_bias(monkeypatch, config)
    print(f"{n} outcomes: relative bias of the loss {loss_bias:.1e}, of the gradient {grad_bias:.1e}")
    assert loss_bias <= TOL and grad_bias <= TOL, f"{n} outcomes: loss bias {loss_bias:.2e}, gradient {grad_bias:.2e}"


@pytest.mark.parametrize("settings", PILOT, ids=pilot_id)
def test_the_pilot_is_exact_alone_and_composed(monkeypatch, settings):
    """Pilot, then continue: over every prompt draw, every continue draw after every pilot, and every completion
    draw, the expected loss and gradient are the full groups' (KL on, a PPO ratio ≠ 1)."""
    loss_bias, grad_bias, n = relative_bias(monkeypatch, dppo_config(**settings), ids=PILOT_IDS)
    print(f"{n} outcomes: relative bias of the loss {loss_bias:.1e}, of the gradient {grad_bias:.1e}")
    assert loss_bias <= TOL and grad_bias <= TOL, f"{n} outcomes: loss bias {loss_bias:.2e}, gradient {grad_bias:.2e}"


@pytest.mark.parametrize("scheme", ["constant", "posterior"])
def test_the_pilot_is_exact_in_the_default_combination(monkeypatch, scheme):
    """tiny-dppo's combination (dense prompts, posterior prompts, length-aware sorted completions) with a pilot."""
    config = default_config(pilot_size=2, continue_scheme=scheme, continue_probability=0.1)
    loss_bias, grad_bias, n = relative_bias(monkeypatch, config, ids=PILOT_IDS)
    print(f"{n} outcomes: relative bias of the loss {loss_bias:.1e}, of the gradient {grad_bias:.1e}")
    assert loss_bias <= TOL and grad_bias <= TOL, f"{n} outcomes: loss bias {loss_bias:.2e}, gradient {grad_bias:.2e}"


#: estimator settings every matrix holds fixed, and why
HELD = {"seed": "the draws are enumerated, not seeded",
        "num_generations": "G = 3 keeps the enumeration small; nothing in the estimator special-cases G",
        "prompt_window_factor": "it only bounds how far a dense window looks; 2 keeps the enumeration small",
        "greso_target_zero_variance": "GRESO's adaptive rule is a biased baseline (no weights): test_greso.py"}
#: the pruning modes that are not unbiased, each shown biased below
BIASED = ("cppo", "greso", "pods")


def test_the_matrices_cover_every_setting():
    """Each estimator setting (a field of any estimator, by its config name) is varied by the matrices above, or
    held for a reason in ``HELD``; each member of the config's tuples of choices is enumerated; and each pruning
    mode is either exact (none, dppo) or shown biased. A new scheme, design or setting fails here until covered."""
    configs = [dppo_config(**s) for s in SAMPLING] + [dppo_config(**loss_settings(*c)) for c in LOSSES]
    configs += [default_config(completion_target_ess=a) for a in (None, ADAPTIVE)]
    configs += [dppo_config(**s) for s in PILOT]
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
    found = pivotal_outcomes(p, torch.tensor([0.0, 1.0, -2.0, 1.0]), draw=fair_coin_pivotal)
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
    est.history = history_before()
    if hasattr(type(est), "stale"):  # the history one step before: what a stale π is computed from
        est.stale = history_before(until=STEP - 1)
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


PILOT_MUTANT_SETTINGS = [dict(beta=0.0, num_iterations=1), dict(beta=0.04, num_iterations=2, completion_prune_rate=0.0)]


@pytest.mark.parametrize("mutant", PILOT_MUTANTS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("settings", PILOT_MUTANT_SETTINGS, ids=["prune-both", "kl-prompts"])
def test_pilot_mutants_are_biased(monkeypatch, mutant, settings):
    """The pilot's likely mistakes (k = 2, so some pilots are mixed and q6's all-equal pilot has an informative
    group): each shows a bias where the real estimator shows none."""
    config = dppo_config(pilot_size=2, continue_probability=0.4, **settings)
    _, grad_bias, _ = relative_bias(monkeypatch, config, estimator=_mutant(mutant, config), ids=PILOT_IDS)
    print(f"{mutant.__name__}: relative bias of the gradient {grad_bias:.3g}")
    assert grad_bias > MUTANT_MIN, f"{mutant.__name__}: gradient bias only {grad_bias:.2e}"
    assert relative_bias(monkeypatch, config, ids=PILOT_IDS)[1] <= TOL


@pytest.mark.parametrize("install", PILOT_JOIN_MUTANTS, ids=lambda m: m.__name__)
def test_a_pilot_left_out_of_the_advantages_is_caught(monkeypatch, install):
    config = dppo_config(pilot_size=2, continue_probability=0.4, beta=0.0, num_iterations=1)
    install(monkeypatch)
    _, grad_bias, _ = relative_bias(monkeypatch, config, ids=PILOT_IDS)
    print(f"{install.__name__}: relative bias of the gradient {grad_bias:.3g}")
    assert grad_bias > MUTANT_MIN, f"{install.__name__}: gradient bias only {grad_bias:.2e}"
