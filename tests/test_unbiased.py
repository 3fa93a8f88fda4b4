"""The DPPO estimator is unbiased on a real model's gradient; the CPPO and GRESO baselines are not.

Setup: the embedded tiny model, a real batch of rollouts (8 prompts x 8 completions, transformers
``generate``), rewards and group advantages. The pruned loss is a weighted sum of per-completion
losses with a constant normaliser, so its gradient is the same weighted sum of per-completion
gradients: we compute each completion's gradient once (through ``dppo_core.grpo.policy_loss``), check
that a pruned micro-batch's gradient equals the weighted sum, and then draw many prunings through the
trainer's own ``select_prompts`` and ``build_sequences``. For every coordinate of a random subset of
the gradient, the z-score of (mean of the draws - full-batch gradient) must stay under a Bonferroni
bound; the biased baselines must exceed it (negative controls).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from dppo_core.config import DPPOConfig
from dppo_core.data import prompt_key
from dppo_core.estimator import make_estimator
from dppo_core.grpo import group_advantages, policy_loss
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.pruning import PromptHistory
from dppo_core.rollout import HFRollout, RolloutBatch, SamplingConfig
from dppo_core.trainer import DPPOTrainer

P, G, MAX_TOKENS = 8, 8, 16
NUM_COORDS = 2048
DRAWS = 1000
ALPHA = 1e-3  # family-wise false-rejection rate of the coordinate-wise test
CRIT = NormalDist().inv_cdf(1 - ALPHA / (2 * NUM_COORDS))


def parity_reward(prompts, completions, **columns):
    return [float(len(c) % 2 == 0) for c in completions]


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


def _estimates(s: Setup, grads: torch.Tensor, draws: int = DRAWS, **overrides) -> np.ndarray:
    """Gradient estimates of many independent prunings, through the trainer's selection and weighting."""
    s.trainer.config = s.base.with_overrides(overrides)
    history = s.trainer.history  # the estimator is built from the config: rebuilt for these settings
    s.trainer.estimator = make_estimator(s.trainer.config)
    s.trainer.history = history
    out = np.zeros((draws, grads.shape[1]))
    g = grads.numpy()
    for m in range(draws):
        sel = s.trainer.select_prompts(m, candidates=s.rows)
        if not sel.rows:
            continue  # every prompt pruned: the estimate is 0
        sub = RolloutBatch(groups=[s.batch.groups[i] for i in sel.indices])
        seqs = s.trainer.build_sequences(sub, s.adv[sel.indices], sel, step=m)
        if not len(seqs):
            continue
        rows = [sel.indices[gi] * G + ci for gi, ci in seqs.origin]
        out[m] = (P * G / seqs.num_sequences) * (seqs.weights.double().numpy() @ g[rows])
    return out


def _max_z(estimates: np.ndarray, full: np.ndarray) -> float:
    diff = estimates.mean(0) - full
    se = estimates.std(0, ddof=1) / math.sqrt(len(estimates))
    scale = np.abs(full).max()
    z = np.where(se > 1e-12 * scale, np.abs(diff) / np.maximum(se, 1e-300),
                 np.where(np.abs(diff) <= 1e-9 * scale, 0.0, np.inf))
    return float(z.max())


@pytest.mark.parametrize("beta,iterations", [(0.0, 1), (0.0, 2), (0.05, 1), (0.05, 2)])
@pytest.mark.parametrize("scheme", ["paper", "proportional"])
@pytest.mark.parametrize("fixed_size", [False, True])
def test_dppo_gradient_is_unbiased(setup, beta, iterations, scheme, fixed_size):
    grads = _loss_terms(setup, beta, iterations)
    est = _estimates(setup, grads, beta=beta, num_iterations=iterations, prompt_prune_rate=0.5,
                     completion_prune_rate=0.5, prompt_scheme=scheme, completion_scheme=scheme,
                     fixed_size_sampling=fixed_size)
    full = grads.sum(0).numpy()
    z = _max_z(est, full)
    assert z < CRIT, f"max |z| = {z:.2f} over {NUM_COORDS} coordinates (bound {CRIT:.2f})"
    # and it did prune: fewer than all completions were trained on average
    assert (est != 0).any()


@pytest.mark.parametrize("baseline", [dict(pruning="cppo", completion_prune_rate=0.5),
                                      dict(pruning="greso", prompt_prune_rate=0.5)])
def test_biased_baselines_are_rejected_by_the_same_test(setup, baseline):
    grads = _loss_terms(setup, 0.0, 1)
    est = _estimates(setup, grads, **baseline)
    z = _max_z(est, grads.sum(0).numpy())
    assert z > CRIT, f"{baseline['pruning']}: max |z| = {z:.2f} should exceed {CRIT:.2f}"
