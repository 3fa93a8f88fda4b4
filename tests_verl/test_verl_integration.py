"""dppo_core.integrations.verl against verl's real functions, on CPU (``make test-verl``; skipped without verl).

verl's functions used as they are: ``DataProto`` (select_idxs, repeat), ``core_algos`` (its registries,
``compute_grpo_outcome_advantage``, ``compute_policy_loss_vanilla``, ``agg_loss``), ``ray_trainer.compute_advantage``
(the registry path verl's trainer takes), ``ActorConfig`` and the hydra config with ``validate_config``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: `make test-verl` builds .venv-verl with it")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import validate_config  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from dppo_core import grpo  # noqa: E402
from dppo_core.estimator import DPPOEstimator, Estimator  # noqa: E402
from dppo_core.integrations import verl as dv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "verl"
# Tiny but not trivial: 4 candidate prompts, G = 4 completions each, responses of 1..T tokens (padding after)
P, G, T = 4, 4, 6


@pytest.fixture(autouse=True)
def _no_installed_estimator():
    yield
    dv._INSTALLED.estimator = None  # each test installs what it needs


def actor_config(global_batch_size: int | None, loss_scale_factor: int | None = None) -> ActorConfig:
    """verl's ActorConfig (clip 0.2, dual clip c = 3) with the global batch info verl's v1 engine sets."""
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=G)
    config.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=global_batch_size,
                                    loss_scale_factor=loss_scale_factor)
    return config


def masks(n: int, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    return (torch.arange(T)[None, :] < lengths[:, None]).long()  # (n, T)


def test_registered_under_names_that_are_not_divergence_ppo():
    assert core_algos.get_policy_loss_fn(dv.POLICY_LOSS) is dv.dynamic_pruning_policy_loss
    assert core_algos.get_adv_estimator_fn(dv.ADV_ESTIMATOR) is dv.dynamic_pruning_advantage
    assert not dv.POLICY_LOSS.startswith("dppo") and "dppo_tv" in core_algos.POLICY_LOSS_REGISTRY


def test_adapter_imports_no_heavy_module_of_dppo_core():
    """Beyond what verl itself loads, the adapter brings only dppo_core's torch-level modules."""
    code = ("import sys; import verl.trainer.ppo.core_algos; before = set(sys.modules); "
            "import dppo_core.integrations.verl; print(sorted(set(sys.modules) - before))")
    new = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert {m.split(".")[0] for m in new} == {"dppo_core"}, new
    assert set(new) <= {"dppo_core", "dppo_core.config", "dppo_core.config_checks", "dppo_core.config_files",
                        "dppo_core.estimator", "dppo_core.grpo", "dppo_core.history", "dppo_core.pruning",
                        "dppo_core.posterior", "dppo_core.biased_baselines", "dppo_core.integrations",
                        "dppo_core.integrations.verl", "dppo_core.registry", "dppo_core.draws"}, new


# --- every keep probability 1: verl's own GRPO -------------------------------------------------------------
def rollout_batch(gen: torch.Generator, n_prompts: int = P) -> DataProto:
    """A rolled-out batch as verl's trainer has it at compute_advantage: G rows per prompt (uid), shuffled."""
    rewards = torch.randint(0, 2, (n_prompts * G,), generator=gen).float()
    mask = masks(n_prompts * G, gen)
    scores = torch.zeros(n_prompts * G, T)
    scores[torch.arange(n_prompts * G), mask.sum(-1) - 1] = rewards  # the outcome reward on the last token
    uid = np.array([f"u{i // G}" for i in range(n_prompts * G)], dtype=object)
    perm = torch.randperm(n_prompts * G, generator=gen)
    return DataProto.from_dict({"token_level_rewards": scores[perm], "response_mask": mask[perm]},
                               non_tensors={"uid": uid[perm.numpy()]})


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_keep_all_advantages_are_verls_grpo(norm_by_std):
    """Through verl's compute_advantage and registry: with nothing pruned (rates 0; the default estimator drops
    only A = 0 rows, whose advantage is 0 either way) the advantages are verl's GRPO advantages, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    batch = rollout_batch(gen)
    algo = {"norm_adv_by_std_in_grpo": norm_by_std}
    want = compute_advantage(copy.deepcopy(batch), "grpo", norm_adv_by_std_in_grpo=norm_by_std).batch["advantages"]
    for estimator in (Estimator(), DPPOEstimator()):
        dv.install(estimator, group_size=G)
        got = compute_advantage(copy.deepcopy(batch), dv.ADV_ESTIMATOR, config=algo).batch["advantages"]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert want.abs().sum() > 0


def policy_inputs(gen: torch.Generator, n: int):
    mask = masks(n, gen)
    old = -torch.rand(n, T, generator=gen) * 2
    logp = (old + 0.3 * torch.randn(n, T, generator=gen)).requires_grad_()  # ratios within and beyond the clip
    adv = torch.randn(n, generator=gen)[:, None] * mask
    return old, logp, adv, mask


@pytest.mark.parametrize("mode", dv.SUPPORTED_LOSS_AGG_MODES)
def test_keep_all_loss_and_gradient_are_verls(mode):
    """Weights 1, C = rows: the loss and its gradient are verl's vanilla surrogate under verl's own aggregation of
    the same name (which divides by global_batch_size = C), to float64 rounding."""
    gen = torch.Generator().manual_seed(1)
    old, logp, adv, mask = policy_inputs(gen, P * G)
    adv, old, logp = adv.double(), old.double(), logp.detach().double().requires_grad_()
    horizon = T + 3 if mode == "seq-mean-token-sum-norm" else None
    config = actor_config(P * G, horizon)
    ours, ours_metrics = dv.dynamic_pruning_policy_loss(old, logp, adv, mask, mode, config)
    (g_ours,) = torch.autograd.grad(ours, logp)
    theirs, theirs_metrics = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, mode, config)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-12, atol=1e-14)
    assert ours_metrics == pytest.approx(theirs_metrics)


def test_keep_all_loss_is_dppo_cores_grpo_loss():
    """And it is dppo_core's loss_type grpo (where verl's dual clip is inactive: ratios below 3)."""
    gen = torch.Generator().manual_seed(2)
    old, logp, adv, mask = policy_inputs(gen, P * G)
    c = 2 * P * G  # a window twice the rows present
    ours, _ = dv.dynamic_pruning_policy_loss(old, logp, adv, mask, "seq-mean-token-mean", actor_config(c))
    (g_ours,) = torch.autograd.grad(ours, logp)
    ref, _ = grpo.policy_loss(logp, adv[:, 0], mask, old_logprobs=old, epsilon=0.2, num_sequences=c)
    (g_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(g_ours, g_ref)


def test_loss_refuses_a_kept_set_normaliser():
    gen = torch.Generator().manual_seed(3)
    old, logp, adv, mask = policy_inputs(gen, 4)
    with pytest.raises(ValueError, match="token-mean"):
        dv.dynamic_pruning_policy_loss(old, logp, adv, mask, "token-mean", actor_config(4))
    with pytest.raises(ValueError, match="global_batch_size"):
        dv.dynamic_pruning_policy_loss(old, logp, adv, mask, "seq-mean-token-mean", actor_config(None))
    with pytest.raises(ValueError, match="loss_scale_factor"):
        dv.dynamic_pruning_policy_loss(old, logp, adv, mask, "seq-mean-token-sum-norm", actor_config(4))


def test_dataproto_hooks_keep_all_change_nothing():
    """select_prompts and weigh_rollouts with no pruning: every row, advantages as verl computed them, C = P·G."""
    gen = torch.Generator().manual_seed(4)
    prompts = DataProto.from_dict({"input_ids": torch.arange(P * 3).view(P, 3)},
                                  non_tensors={"index": np.arange(P), "uid": np.array([f"u{q}" for q in range(P)],
                                                                                      dtype=object)})
    kept, selection = dv.select_prompts(prompts, Estimator(), step=0)
    assert selection.indices == list(range(P)) and len(kept) == P
    batch = kept.repeat(G, interleave=True)
    batch.batch["response_mask"] = masks(P * G, gen)
    batch.batch["token_level_rewards"] = torch.randint(0, 2, (P * G, T), generator=gen).float() * batch.batch[
        "response_mask"]
    batch = compute_advantage(batch, "grpo")
    out, weights = dv.weigh_rollouts(batch, Estimator(), step=0, group_size=G)
    assert len(out) == P * G and weights.num_sequences == P * G
    torch.testing.assert_close(out.batch["advantages"], batch.batch["advantages"], rtol=0, atol=0)


# --- with pruning: E[L̂(θ)] = L(θ), loss and gradient --------------------------------------------------------
REWARDS = torch.tensor([[1., 1., 1., 1.], [1., 0., 0., 0.], [0., 1., 1., 0.], [1., 0., 1., 1.]])  # (P, G) now
PAST = torch.tensor([[1., 1., 1., 1.], [0., 0., 0., 0.], [1., 1., 0., 0.], [1., 1., 1., 1.]])  # (P, G) last step


class TinyPolicy(torch.nn.Module):
    """Per-token log-probs old + θ·x: the loss's gradient at θ = 0 is a fixed linear map of the advantages."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
        torch.nn.init.zeros_(self.linear.weight)

    def forward(self, old: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return old + self.linear(x).squeeze(-1)


def base_estimator(completion_prune_rate: float = 0.5) -> DPPOEstimator:
    est = DPPOEstimator(seed=0, prompt_prune_rate=0.5, completion_prune_rate=completion_prune_rate,
                        min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2)
    est.observe([str(q) for q in range(P)], PAST, grpo.group_advantages(PAST), step=0)
    return est


def one_step(estimator: DPPOEstimator, step: int, fixed, bias: float = 1.0) -> tuple[float, torch.Tensor]:
    """One DPPO step through the adapter and verl's functions: the loss and its gradient at θ = 0.
    ``bias`` multiplies the weight of every randomly kept row (the companion check)."""
    old, x, mask, policy = fixed
    prompts = DataProto.from_dict({"prompt": torch.arange(P)[:, None]}, non_tensors={"index": np.arange(P)})
    kept, selection = dv.select_prompts(prompts, estimator, step)
    batch = kept.repeat(G, interleave=True)
    q = batch.batch["prompt"][:, 0]  # (rows,) the prompt of each row
    i = torch.arange(len(batch)) % G
    batch.batch["completion"] = i
    batch.batch["response_mask"] = mask[q, i]
    batch.batch["token_level_rewards"] = REWARDS[q, i][:, None] * torch.nn.functional.one_hot(
        mask[q, i].sum(-1) - 1, T)
    batch.non_tensor_batch["uid"] = batch.non_tensor_batch["index"]
    batch = compute_advantage(batch, "grpo")
    batch, weights = dv.weigh_rollouts(batch, estimator, step, group_size=G)
    if len(batch) == 0:
        return 0.0, torch.zeros(3, dtype=torch.float64)
    q, i = batch.batch["prompt"][:, 0], batch.batch["completion"]  # the kept rows
    adv = batch.batch["advantages"].double()
    if bias != 1.0:
        random_rows = weights.weights[weights.keep] > 1
        adv = adv * torch.where(random_rows, bias, 1.0)[:, None]
    logp = policy(old[q, i], x[q, i])
    loss, _ = core_algos.get_policy_loss_fn(dv.POLICY_LOSS)(old[q, i], logp, adv, batch.batch["response_mask"],
                                                            "seq-mean-token-mean", actor_config(P * G))
    (grad,) = torch.autograd.grad(loss, policy.linear.weight)
    return loss.item(), grad.flatten()


def fixed_rollouts(seed: int):
    gen = torch.Generator().manual_seed(seed)
    mask = masks(P * G, gen).view(P, G, T)
    old = (-torch.rand(P, G, T, generator=gen, dtype=torch.float64) * 2)
    x = torch.randn(P, G, T, 3, generator=gen, dtype=torch.float64)
    return old, x, mask, TinyPolicy()


def full_step(fixed) -> tuple[float, torch.Tensor]:
    """Full-batch GRPO with verl's functions: every prompt and completion, weight 1, C = P·G."""
    old, x, mask, policy = fixed
    rows = torch.arange(P * G)
    q, i = rows // G, rows % G
    scores = REWARDS[q, i][:, None] * torch.nn.functional.one_hot(mask[q, i].sum(-1) - 1, T)
    adv, _ = core_algos.compute_grpo_outcome_advantage(scores, mask[q, i], np.array([str(v) for v in q.tolist()]))
    logp = policy(old[q, i], x[q, i])
    loss, _ = core_algos.compute_policy_loss_vanilla(old[q, i], logp, adv.double(), mask[q, i],
                                                     "seq-mean-token-mean", actor_config(P * G))
    (grad,) = torch.autograd.grad(loss, policy.linear.weight)
    return loss.item(), grad.flatten()


DRAWS = 3000
#: the 0.999 quantile of chi-square with 4 degrees of freedom: Hotelling's T² of the mean of (loss, 3 gradient
#: components) over DRAWS draws is about chi-square(4) when the estimate is unbiased
T2_LIMIT = 18.47


def monte_carlo(bias: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The draws (loss and gradient at θ = 0, one row each), the full-batch values, and Hotelling's T²."""
    fixed = fixed_rollouts(5)
    base = base_estimator()
    draws = [one_step(copy.deepcopy(base), step, fixed, bias) for step in range(1, DRAWS + 1)]
    values = torch.tensor([[loss, *grad.tolist()] for loss, grad in draws], dtype=torch.float64)  # (draws, 4)
    full_loss, full_grad = full_step(fixed)
    full = torch.tensor([full_loss, *full_grad.tolist()], dtype=torch.float64)
    d = values.mean(0) - full
    return values, full, float(DRAWS * d @ torch.linalg.solve(torch.cov(values.T), d))


@pytest.fixture(scope="module")
def unbiased_draws():
    return monte_carlo()


def test_pruning_really_prunes_prompts_with_a_loss_and_completions():
    est = base_estimator()
    probs = est.prompt_probs([str(q) for q in range(P)], step=1)
    assert (probs[1:] < 1).any(), probs  # a prompt whose group now has a loss may be pruned
    a = grpo.group_advantages(REWARDS)
    assert (est.completion_probs(a) < 1).logical_and(a != 0).any()


def test_pruned_loss_and_gradient_are_unbiased(unbiased_draws):
    """Seeded Monte Carlo over 3000 draws (prompt and completion pruning, Bernoulli; each draw through select_prompts,
    verl's compute_advantage, weigh_rollouts and the registered loss): the mean of the pruned loss and of its
    gradient at θ = 0 (4 numbers) matches full-batch GRPO computed with verl's GRPO advantage and verl's vanilla loss
    under its own seq-mean-token-mean: Hotelling's T² below chi-square(4)'s 0.999 quantile (measured: 2.2), and
    each component within 4 standard errors."""
    values, full, t2 = unbiased_draws
    mean, se = values.mean(0), values.std(0) / DRAWS**0.5
    assert (se > 0).all() and t2 < T2_LIMIT, (t2, mean, full, se)
    assert ((mean - full).abs() <= 4 * se).all(), (mean, full, se)


def test_the_same_check_catches_a_five_percent_bias():
    """Companion: the weight of each randomly kept row times 1.05 (a 5% error on the randomly kept items only) puts
    T² above the same limit (measured: 34), so the check above can fail."""
    _, _, t2 = monte_carlo(bias=1.05)
    assert t2 > T2_LIMIT, t2


def test_weigh_rollouts_drops_rows_and_scales_the_rest():
    fixed = fixed_rollouts(6)
    est = base_estimator()
    old, x, mask, _ = fixed
    prompts = DataProto.from_dict({"prompt": torch.arange(P)[:, None]}, non_tensors={"index": np.arange(P)})
    for step in range(1, 40):
        e = copy.deepcopy(est)
        kept, selection = dv.select_prompts(prompts, e, step)
        batch = kept.repeat(G, interleave=True)
        q = batch.batch["prompt"][:, 0]
        i = torch.arange(len(batch)) % G
        batch.batch["response_mask"] = mask[q, i]
        batch.batch["token_level_rewards"] = REWARDS[q, i][:, None] * mask[q, i]
        batch.non_tensor_batch["uid"] = batch.non_tensor_batch["index"]
        batch = compute_advantage(batch, "grpo")
        out, w = dv.weigh_rollouts(batch, e, step, group_size=G)
        assert len(out) == int(w.keep.sum()) and out.meta_info["dppo_num_sequences"] == P * G
        want = batch.batch["advantages"][w.keep] * w.weights[w.keep].float()[:, None]
        torch.testing.assert_close(out.batch["advantages"], want)
        assert (w.weights[w.keep] >= 1).all() and (w.weights[~w.keep] == 0).all()


# --- the recipe's config, loaded and validated by verl's own config code ---------------------------------
def recipe_config(*overrides: str):
    with initialize_config_dir(config_dir=str(RECIPE), version_base=None):
        return compose("dppo_grpo", overrides=["actor_rollout_ref.model.path=tiny-model", "trainer.n_gpus_per_node=8",
                                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                                               *overrides])


def test_recipe_config_passes_verls_validation_and_ours():
    config = recipe_config()
    with pytest.warns(UserWarning, match="critic"):
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert dv.check_config(config) == config.data.train_batch_size * config.actor_rollout_ref.rollout.n == 256 * 8
    assert core_algos.get_policy_loss_fn(config.actor_rollout_ref.actor.policy_loss.loss_mode)
    assert core_algos.get_adv_estimator_fn(config.algorithm.adv_estimator)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.loss_agg_mode=token-mean", "loss_agg_mode"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.use_kl_loss=true", "use_kl_loss"),
    ("algorithm.adv_estimator=grpo", "adv_estimator"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", "loss_mode"),
])
def test_check_config_refuses_biased_settings(override, message):
    with pytest.raises(ValueError, match=message):
        dv.check_config(recipe_config(override))


@pytest.mark.parametrize("installed_g, settings, message", [
    (4, {}, r"rollout.n=8, but the estimator was installed with group_size=4: every group of 8 completions would be "
            r"dropped as failed .* set rollout.n=4 or install\(estimator, group_size=rollout.n\)"),
    (8, {"prompt_prune_rate": 0.5, "prompt_scheme": "posterior", "group_size": 4},
     r"rollout.n=8, but the estimator's group_size=4: its posterior prompt scheme .* group_size=8"),
])
def test_check_config_refuses_a_rollout_n_other_than_the_group_size(installed_g, settings, message):
    """issue #52: with rollout.n (8 in the recipe) other than install's G, every group would be dropped as failed and
    the run would train on nothing; a posterior prompt scheme's own group_size would score groups of the wrong size."""
    dv.install(DPPOEstimator(**settings), group_size=installed_g)
    with pytest.raises(ValueError, match=message):
        dv.check_config(recipe_config())


def test_check_config_compares_rollout_n_with_the_group_sizes_in_use():
    dv.install(DPPOEstimator(), group_size=4)
    assert dv.check_config(recipe_config("actor_rollout_ref.rollout.n=4")) == 256 * 4
    assert dv.check_config(recipe_config(), DPPOEstimator()) == 256 * 8  # not the installed one: no G of install's
    dv._INSTALLED.estimator = None
    assert dv.check_config(recipe_config()) == 256 * 8  # nothing installed (verl's own trainer, a check beforehand)
    posterior = {"prompt_prune_rate": 0.5, "prompt_scheme": "posterior"}
    assert dv.check_config(recipe_config(), DPPOEstimator(**posterior, group_size=8)) == 256 * 8
    # group_size is read by the posterior scheme only, and only when it prunes prompts
    assert dv.check_config(recipe_config(), DPPOEstimator(prompt_prune_rate=0.5, group_size=4)) == 256 * 8
    assert dv.check_config(recipe_config(), DPPOEstimator(prompt_scheme="posterior", group_size=4)) == 256 * 8
