"""The DPPO estimator is unbiased on a real model's gradient; the CPPO and GRESO baselines are not.

Setup: the embedded tiny model, a real batch of rollouts (8 prompts x 8 completions, transformers
``generate``), rewards and group advantages. The pruned loss is a weighted sum of per-completion
losses with a constant normaliser, so its gradient is the same weighted sum of per-completion
gradients: we compute each completion's gradient once (through ``dppo_core.grpo.policy_loss``), check
that a pruned micro-batch's gradient equals the weighted sum, and then draw many prunings through the
trainer's own ``select_prompts``, ``weigh`` and ``sequences``. Three statistics, each with a Bonferroni bound:
for every coordinate of a random subset of the gradient, the z-score of (mean of the draws - full-batch
gradient); and, sharper, for every completion with a non-zero gradient, the z-score of its coefficient's
mean - 1, and of the sum of those excesses. The real estimator must pass; the biased baselines and the
mutants of tests/helpers/mutants.py (weights of randomly kept completions only 5% too large, a floor ignored, π one
step stale, the normaliser a kept count) must fail. The power is stated, not assumed: each test prints, from
its own draws, the smallest common excess δ on the weights of every randomly included completion (by the prompt
or the completion draw) that the summed statistic sees at least half the time at its 1,000 draws (0.4-10% across
these settings, any δ > 0 where the draws keep the sum fixed; it must be at most ``DETECTABLE``); the exact
enumeration sees any bias of its small steps, mutants of 3% included.
"Two epochs" here means a gradient taken at parameters
moved away from the sampling policy, fixed before the draw (ratio ≠ 1, clipping active); a real second
epoch's parameters depend on the first epoch's draw, which no such test covers (docs/estimator.md).
tests/unit/test_exact_expectation.py computes the same expectations exactly on smaller steps.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from mutants import MUTANTS, StalePromptProbs
from run_helpers import parity_reward

from dppo_core.config import DPPOConfig
from dppo_core.data import prompt_key
from dppo_core.estimator import make_estimator
from dppo_core.grpo import group_advantages, policy_loss
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.pruning import PromptHistory
from dppo_core.rollout import HFRollout, RolloutBatch, SamplingConfig
from dppo_core.trainer import DPPOTrainer

pytestmark = pytest.mark.numerics  # compares computed numbers: run under both kernel settings (Makefile)

P, G, MAX_TOKENS = 8, 8, 16
NUM_COORDS = 2048
DRAWS = 1000
MUTANT_DRAWS = 4000
#: the power the real estimator's tests must have at DRAWS: a δ this large on the random weights is seen at least
#: half the time (``detectable_excess``; docs/estimator.md quotes what each setting measures)
DETECTABLE = 0.15
ALPHA = 1e-3  # false-rejection rate of each of the three statistics (Bonferroni within each)
CRIT = NormalDist().inv_cdf(1 - ALPHA / (2 * NUM_COORDS))
CRIT_ITEMS = NormalDist().inv_cdf(1 - ALPHA / (2 * (P * G + 1)))


class Setup:
    pass


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory) -> Setup:
    s = Setup()
    s.base = DPPOConfig(model=str(tiny_model_dir), output_dir=str(tmp_path_factory.mktemp("unbiased")),
                        prompts_per_step=P, num_generations=G, max_completion_length=MAX_TOKENS,
                        pruning="dppo", min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2)
    s.trainer = DPPOTrainer(s.base, reward_funcs=[parity_reward], progress=False)
    model, tok = s.trainer.model, s.trainer.tokenizer
    s.rows = s.trainer.prompts.sample(0, 0, P)
    s.batch = HFRollout(model, tok).generate([r["prompt"] for r in s.rows], G,
                                             SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0, seed=0))
    rewards = s.trainer.score(s.rows, s.batch)
    rewards[1] = 1.0  # two degenerate groups (all rewards equal), as real batches have
    rewards[5] = 0.0
    s.adv = group_advantages(rewards)
    assert (s.adv[1] == 0).all() and (s.adv[0] != 0).any()
    # a history in which half the prompts looked degenerate last time (some of them have signal now)
    ids = [prompt_key(r) for r in s.rows]
    past = torch.tensor([[0.0] * G if i % 2 == 0 else [1.0, 0.0] * (G // 2) for i in range(P)])
    s.trainer.history = PromptHistory()
    s.trainer.history.update(ids, past, group_advantages(past), step=-1)
    # gradients of the last decoder layer, the final norm and the output head (backward stops there,
    # which keeps 4 x 64 per-completion backward passes cheap); the coordinates are a random subset
    s.params = [p for n, p in model.named_parameters()
                if n.startswith(("lm_head", "model.norm", f"model.layers.{model.config.num_hidden_layers - 1}."))]
    g = torch.Generator().manual_seed(0)
    numel = sum(p.numel() for p in s.params)
    s.coords = torch.randperm(numel, generator=g)[:NUM_COORDS]
    s.grads = {}
    return s


def _flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def _perturbed(model, seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1.0))


def _loss_terms(s: Setup, beta: float, iterations: int):
    """Per completion: its policy-loss term's gradient (subset of coordinates), with normaliser P*G.

    ``iterations == 2``: the gradient is taken at parameters moved away from the sampling policy (as in a
    second PPO epoch), so the ratio is not 1 and clipping is active. ``beta > 0``: a reference policy
    different from the current one, so the KL term has a gradient.
    """
    key = (beta, iterations)
    if key in s.grads:
        return s.grads[key]
    model, pad = s.trainer.model, s.trainer.tokenizer.pad_token_id
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pids = [grp.prompt_ids for grp in s.batch.groups for _ in grp.completions]
    cids = [c.token_ids for grp in s.batch.groups for c in grp.completions]
    model.eval()
    chosen = {id(p) for p in s.params}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)

    def logps():
        return completion_logprobs_with_grad(model, pids, cids, 1.0, pad)

    with torch.no_grad():
        old = logps()[0] if iterations > 1 else None
        ref = None
        if beta > 0:
            _perturbed(model, 11, 0.3)
            ref = logps()[0]
            model.load_state_dict(state)
    if iterations > 1:
        _perturbed(model, 12, 0.3)
    grads = torch.zeros(P * G, NUM_COORDS, dtype=torch.float64)
    clip = []
    flat_adv = s.adv.flatten()
    for j in range(P * G):
        if not cids[j]:
            continue
        model.zero_grad(set_to_none=True)
        lp, mask = completion_logprobs_with_grad(model, [pids[j]], [cids[j]], 1.0, pad)
        n = len(cids[j])
        loss, st = policy_loss(lp, flat_adv[j : j + 1], mask, old_logprobs=None if old is None else old[j : j + 1, :n],
                               ref_logprobs=None if ref is None else ref[j : j + 1, :n], beta=beta,
                               num_sequences=P * G)
        loss.backward()
        grads[j] = _flat_grad(s.params)[s.coords].double()
        clip.append(st["clip_fraction"].item())
    # one pruned micro-batch at once equals the weighted sum of the per-completion gradients (linearity)
    keep = list(range(0, P * G, 3))
    w = torch.linspace(0.5, 4.0, len(keep))
    model.zero_grad(set_to_none=True)
    lp, mask = completion_logprobs_with_grad(model, [pids[j] for j in keep], [cids[j] for j in keep], 1.0, pad)
    t = mask.shape[1]
    loss, _ = policy_loss(lp, flat_adv[keep], mask, weights=w,
                          old_logprobs=None if old is None else old[keep, :t],
                          ref_logprobs=None if ref is None else ref[keep, :t], beta=beta, num_sequences=P * G)
    loss.backward()
    together = _flat_grad(s.params)[s.coords].double()
    summed = w.double() @ grads[keep]
    assert (together - summed).abs().max() <= 1e-4 * summed.abs().max()  # float32 accumulation order
    model.load_state_dict(state)
    model.requires_grad_(True)
    if iterations > 1:
        assert max(clip) > 0, "the second-epoch parameters should activate clipping"
    s.grads[key] = grads
    return grads


def _estimates(s: Setup, grads: torch.Tensor, draws: int = DRAWS, estimator=None, **overrides
               ) -> tuple[np.ndarray, np.ndarray]:
    """Gradient estimates of many independent prunings, through the trainer's selection and weighting.

    Also returns each draw's coefficient on every completion's gradient, (draws, P·G): the estimate is
    ``coefs @ grads``, and it is unbiased exactly when every coefficient has mean 1 (on the completions
    whose gradient is not zero). ``estimator``: use this one (a mutant) instead of the config's.
    """
    s.trainer.config = s.base.with_overrides(overrides)
    history = s.trainer.history  # the estimator is built from the config: rebuilt for these settings
    s.trainer.estimator = make_estimator(s.trainer.config) if estimator is None else estimator
    s.trainer.history = history
    coefs = np.zeros((draws, P * G))
    for m in range(draws):
        sel = s.trainer.select_prompts(m, candidates=s.rows)
        if not sel.rows:
            continue  # every prompt pruned: the estimate is 0
        sub = RolloutBatch(groups=[s.batch.groups[i] for i in sel.indices])
        lengths = torch.tensor(sub.lengths())
        seqs = s.trainer.sequences(sub, *s.trainer.weigh(sel, None, lengths, m, advantages=s.adv[sel.indices],
                                                         observe=False))
        if not len(seqs):
            continue
        rows = [sel.indices[gi] * G + ci for gi, ci in seqs.origin]
        coefs[m, rows] = (P * G / seqs.num_sequences) * seqs.weights.double().numpy()
    return coefs @ grads.numpy(), coefs


def _z(samples: np.ndarray, target: np.ndarray, scale: float) -> np.ndarray:
    """|mean - target| / standard error per column; a column without spread is 0 if on target, else inf."""
    diff = np.abs(samples.mean(0) - target)
    se = samples.std(0, ddof=1) / math.sqrt(len(samples))
    return np.where(se > 1e-12 * scale, diff / np.maximum(se, 1e-300), np.where(diff <= 1e-9 * scale, 0.0, np.inf))


def _max_z(estimates: np.ndarray, full: np.ndarray) -> float:
    return float(_z(estimates, full, np.abs(full).max()).max())


def _item_z(coefs: np.ndarray, grads: torch.Tensor) -> tuple[float, float]:
    """Sharper statistics on the coefficients of the completions with a non-zero gradient: the largest
    per-completion |z| of mean(coefficient) - 1, and the |z| of their summed excess (a small bias shared by
    many completions, such as weights 5% too large, adds up in the sum while its noise grows as a square root)."""
    live = grads.abs().amax(1).numpy() > 0
    c = coefs[:, live]
    per_item = float(_z(c, np.ones(c.shape[1]), 1.0).max())
    pooled = float(_z((c - 1).sum(1, keepdims=True), np.zeros(1), 1.0)[0])
    return per_item, pooled


def detectable_excess(coefs: np.ndarray, grads: torch.Tensor) -> float:
    """The power of the summed statistic on these draws: the excess δ that, added to the weight of every
    randomly included completion (weights × (1 + δ) wherever a completion's coefficient varies between draws, by
    the prompt or the completion draw; tests/helpers/mutants.py's ScaledRandomWeights scales only the latter, so it
    needs a larger δ), puts its expected z-score at the bound, so it is rejected about half the time; more, more often.
    From the draws' own spread: δ = bound × SE / n."""
    live = grads.abs().amax(1).numpy() > 0
    c = coefs[:, live]
    random = c.std(0) > 0
    if not random.any():
        return math.inf  # nothing is kept at random: no such mutant to see
    se = (c - 1).sum(1).std(ddof=1) / math.sqrt(len(c))  # 0 when the draws keep the sum fixed: any δ is seen
    return float(CRIT_ITEMS * se / c[:, random].mean(0).sum())


def _rejected(s: Setup, grads: torch.Tensor, est: np.ndarray, coefs: np.ndarray) -> tuple[bool, str]:
    z = _max_z(est, grads.sum(0).numpy())
    item, pooled = _item_z(coefs, grads)
    report = f"max |z| {z:.2f} over {NUM_COORDS} coordinates (bound {CRIT:.2f}), per completion {item:.2f}, " \
             f"summed {pooled:.2f} (bound {CRIT_ITEMS:.2f}); sees a δ ≥ {detectable_excess(coefs, grads):.3f} on " \
             "the random weights at least half the time"
    return z > CRIT or item > CRIT_ITEMS or pooled > CRIT_ITEMS, report


@pytest.mark.parametrize("beta,iterations", [(0.0, 1), (0.0, 2), (0.05, 1), (0.05, 2)])
@pytest.mark.parametrize("scheme", ["paper", "proportional"])
@pytest.mark.parametrize("fixed_size", [False, True])
def test_dppo_gradient_is_unbiased(setup, beta, iterations, scheme, fixed_size):
    grads = _loss_terms(setup, beta, iterations)
    est, coefs = _estimates(setup, grads, beta=beta, num_iterations=iterations, prompt_prune_rate=0.5,
                            completion_prune_rate=0.5, prompt_scheme=scheme, completion_scheme=scheme,
                            fixed_size_sampling=fixed_size)
    rejected, report = _rejected(setup, grads, est, coefs)
    print(f"dppo {scheme} fixed_size={fixed_size} beta={beta} ratio={'≠' if iterations > 1 else '='}1: {report}")
    assert not rejected, report
    assert detectable_excess(coefs, grads) <= DETECTABLE, report
    # and it did prune: fewer than all completions were trained on average
    assert (coefs == 0).any() and (est != 0).any()


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("design", ["sorted", "pivotal"])
def test_the_variance_aware_default_is_unbiased(setup, beta, design):
    """tiny-dppo's schemes: prompts by the posterior, completions ∝ |A| / length, a sorted or pivotal design;
    through ``weigh``, which hands the completions' lengths to the estimator. (No dense prompts: the
    step's candidates are given, so they are the window.)"""
    grads = _loss_terms(setup, beta, 1)
    est, coefs = _estimates(setup, grads, beta=beta, num_iterations=1, prompt_prune_rate=0.5,
                            completion_prune_rate=0.5, prompt_scheme="posterior", completion_scheme="length",
                            length_exponent=1.0, fixed_size_sampling=True, fixed_size_design=design)
    rejected, report = _rejected(setup, grads, est, coefs)
    print(f"dppo posterior/length {design} beta={beta}: {report}")
    assert not rejected, report
    assert detectable_excess(coefs, grads) <= DETECTABLE, report
    assert (coefs == 0).any() and (est != 0).any()


@pytest.mark.parametrize("baseline", [dict(pruning="cppo", completion_prune_rate=0.5),
                                      dict(pruning="greso", prompt_prune_rate=0.5)])
def test_biased_baselines_are_rejected_by_the_same_test(setup, baseline):
    grads = _loss_terms(setup, 0.0, 1)
    est, coefs = _estimates(setup, grads, **baseline)
    rejected, report = _rejected(setup, grads, est, coefs)
    print(f"{baseline['pruning']}: {report}")
    assert rejected, f"{baseline['pruning']}: {report}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_small_mistakes_are_rejected_by_the_same_test(setup, mutant):
    """The estimator's likely mistakes (tests/helpers/mutants.py), weights only 5% off included, fail the test."""
    grads = _loss_terms(setup, 0.0, 1)
    settings = dict(prompt_prune_rate=0.5, completion_prune_rate=0.5, prompt_scheme="paper",
                    completion_scheme="proportional")
    est = mutant.from_config(setup.base.with_overrides(settings))
    est.history = setup.trainer.history
    if isinstance(est, StalePromptProbs):
        est.stale = PromptHistory()  # the history before the only past step: nothing seen yet
    estimates, coefs = _estimates(setup, grads, draws=MUTANT_DRAWS, estimator=est, **settings)
    rejected, report = _rejected(setup, grads, estimates, coefs)
    print(f"{mutant.__name__}: {report}")  # shown with pytest -s
    assert rejected, f"{mutant.__name__}: {report}"
