"""The rollout engine's mismatch corrected in the loss (``rollout_correction``): the weights, what they make
exact (by enumeration on a toy policy), the same end to end through the trainer's update with completion pruning and
the KL term (and the wrong lines of tests/helpers/mutants.py that this catches), and the trainer with the correction
off, on, and on a skewed engine."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from mutants import ENGINE_MUTANTS
from run_helpers import parity_reward, run_config

from dppo_core import pruning
from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.distributed import DistInfo
from dppo_core.estimator import full_selection, make_estimator
from dppo_core.grpo import group_advantages, policy_loss, truncated_importance_weights
from dppo_core.logprobs import Sequences, engine_weights
from dppo_core.metrics import unknown_keys
from dppo_core.rollout import Completion, HFRollout, RolloutBatch, RolloutGroup
from dppo_core.trainer import DPPOTrainer, micro_batch_loss

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others cannot (the toy policy's float64 enumerations, with no matrix product, exact to
# 1e-9 or off by far more; a few hand-computed weights; the config's checks).


# --- the weights ----------------------------------------------------------------------------------------
def test_token_and_sequence_weights_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    mu = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -1.1, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    token = truncated_importance_weights(logp, mu, 2.0)
    assert token[0].tolist() == pytest.approx([min(2.0, torch.e ** 0.5), torch.e ** -1.0, 1.0])
    seq = truncated_importance_weights(logp, mu, 2.0, level="sequence", mask=mask)
    assert seq[0].tolist() == pytest.approx([torch.e ** -0.5] * 3)  # exp(0.5 - 1 + 0)
    assert seq[1].tolist() == pytest.approx([min(2.0, torch.e ** 0.3)] * 3)  # the padded token ignored
    assert truncated_importance_weights(logp, mu, 1e9, level="sequence", mask=mask)[1, 0].item() == \
        pytest.approx(torch.e ** 0.3)
    with pytest.raises(ValueError, match="level"):
        truncated_importance_weights(logp, mu, level="group")


def test_the_config_checks_the_correction():
    assert DPPOConfig().rollout_correction == "auto"
    with pytest.raises(ConfigError, match="rollout_correction='tokens'.*auto, off, token, sequence"):
        DPPOConfig(rollout_correction="tokens")
    with pytest.raises(ConfigError, match="rollout_correction_cap=0.5"):
        DPPOConfig(rollout_correction_cap=0.5)


@pytest.mark.numerics
def test_weights_of_one_leave_the_loss_and_gradient_bit_for_bit():
    """An engine that is the policy (μ = π_old exactly) gives weights of exactly 1, and the loss and gradient are
    those without the correction, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, 7, generator=gen, dtype=torch.float32, requires_grad=True)
    logp = torch.log_softmax(theta, dim=-1)[:, :6]
    mask = torch.ones(5, 6)
    mask[2, 4:] = 0
    seqs = Sequences([[1]] * 5, [[2] * int(m.sum()) for m in mask], torch.randn(5, generator=gen),
                     torch.rand(5, generator=gen, dtype=torch.float64) + 1, num_sequences=8,
                     engine_logprobs=[row[: int(m.sum())].tolist() for row, m in zip(logp.detach(), mask, strict=True)])
    config = DPPOConfig(rollout_correction="token")
    idx = list(range(5))
    w, logged = engine_weights(config, "token", seqs, idx, logp, mask)
    assert torch.equal(w, torch.ones_like(w)) and logged["engine_logprob_diff_max"] == 0
    plain, _ = micro_batch_loss(config, seqs, idx, logp, mask)
    (g_plain,) = torch.autograd.grad(plain, theta, retain_graph=True)
    corrected, _ = micro_batch_loss(config, seqs, idx, logp, mask, engine_weights=w)
    (g_corrected,) = torch.autograd.grad(corrected, theta)
    assert torch.equal(plain, corrected) and torch.equal(g_plain, g_corrected)


# --- what the weights make exact: every completion enumerated on a toy policy -------------------------------
V = 3  # vocabulary of the toy policy


def _toy(length: int, seed: int = 0):
    """An autoregressive toy policy over V tokens (logits of token t given token t-1), a skewed engine (its
    logits at temperature 1.6, plus an offset), and a fixed advantage per completion."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(V + 1, V, generator=gen, dtype=torch.float64)  # row V: the first token's logits
    skew = torch.randn(V + 1, V, generator=gen, dtype=torch.float64) * 0.3
    completions = list(itertools.product(range(V), repeat=length))
    advantage = {y: float(torch.randn((), generator=gen, dtype=torch.float64)) for y in completions}
    return theta, theta.detach() / 1.6 + skew, completions, advantage


def _token_logprobs(logits: torch.Tensor, y: tuple[int, ...]) -> torch.Tensor:
    prev = (V, *y[:-1])
    return torch.stack([torch.log_softmax(logits[p], dim=-1)[t] for p, t in zip(prev, y, strict=True)])


def _expected_gradient(length: int, correction: str | None, cap: float = 1e9) -> tuple[torch.Tensor, ...]:
    """(on-policy gradient E_π[∇ loss], the estimate's expectation when an engine μ samples, the truncation
    bound Σ_y μ(y) (ρ(y) - C)+ |∇ loss(y)| of the sequence weights): every completion enumerated, float64."""
    theta, engine, completions, advantage = _toy(length)
    theta = theta.clone().requires_grad_(True)

    def grad(y, token_weights=None):
        logp = _token_logprobs(theta, y)[None]  # (1, T)
        loss, _ = policy_loss(logp, torch.tensor([advantage[y]], dtype=torch.float64), torch.ones_like(logp),
                              token_weights=token_weights, num_sequences=1)
        return torch.autograd.grad(loss, theta)[0]

    on = torch.zeros_like(theta)
    est = torch.zeros_like(theta)
    bound = torch.zeros(())
    for y in completions:
        logp = _token_logprobs(theta, y).detach()
        mu = _token_logprobs(engine, y)
        p, q = logp.sum().exp(), mu.sum().exp()
        on += p * grad(y)
        w = None if correction is None else truncated_importance_weights(logp[None], mu[None], cap, level=correction)
        est += q * grad(y, w)
        rho = (logp.sum() - mu.sum()).exp()
        bound += q * (rho - cap).clamp(min=0) * grad(y).abs().sum()
    return on, est, bound


def test_the_sequence_weight_makes_the_engine_s_samples_exact():
    on, uncorrected, _ = _expected_gradient(2, None)
    assert (uncorrected - on).abs().max() > 1e-2, "the skewed engine must bias the uncorrected gradient"
    on, corrected, _ = _expected_gradient(2, "sequence")
    torch.testing.assert_close(corrected, on, rtol=0, atol=1e-12)


def test_the_token_weight_is_exact_for_one_token_and_only_closer_for_more():
    on, corrected, _ = _expected_gradient(1, "token")
    torch.testing.assert_close(corrected, on, rtol=0, atol=1e-12)
    on, uncorrected, _ = _expected_gradient(3, None)
    _, token, _ = _expected_gradient(3, "token")
    # the prefix is still the engine's: not exact, and only part of the bias goes (here 0.038 of 0.058)
    assert 1e-3 < (token - on).norm() < 0.8 * (uncorrected - on).norm()


def test_truncation_bias_stays_within_its_bound():
    on, exact, _ = _expected_gradient(2, "sequence")
    on, truncated, bound = _expected_gradient(2, "sequence", cap=1.2)
    assert (truncated - on).abs().sum() > 1e-6, "the cap must be reached in this example"
    assert (truncated - on).abs().sum() <= bound + 1e-12


# --- in the trainer -----------------------------------------------------------------------------------------
def _config(model_dir, out, **kw):
    return run_config(model_dir, out, **({"save_steps": 0} | kw))  # no checkpoints


class SkewedEngine:
    """The transformers engine sampling at another temperature than the trainer's: μ ≠ π on purpose."""

    name = "skewed"

    def __init__(self, model, tokenizer, temperature: float):
        self.inner, self.temperature = HFRollout(model, tokenizer), temperature

    def generate(self, prompts, num_generations=1, sampling=None):
        skewed = dataclasses.replace(sampling, temperature=self.temperature)
        return self.inner.generate(prompts, num_generations, skewed)

    def sync(self, model):
        self.inner.sync(model)


def _steps(config, engine=None, steps=2):
    trainer = DPPOTrainer(config, reward_funcs=[parity_reward], progress=False)
    trainer.engine = engine(trainer) if engine else trainer.make_engine()
    records = [trainer.train_step() for _ in range(steps)]
    return trainer, records


@pytest.mark.numerics
def test_auto_is_off_on_the_transformers_engine_and_token_logs_weights_near_one(small_model_dir, tmp_path):
    trainer, auto = _steps(_config(small_model_dir, tmp_path))
    assert trainer.rollout_correction_level() is None and "engine_weight_mean" not in auto[0]
    on_trainer, on = _steps(_config(small_model_dir, tmp_path, rollout_correction="token"))
    assert unknown_keys([*auto, *on]) == []  # every key the step writes is in metrics.jsonl's schema
    for r in on:  # the engine is the model: weights within rounding of 1, none truncated
        assert r["engine_logprob_diff_max"] < 1e-4 and r["engine_weight_mean"] == pytest.approx(1, abs=1e-4)
        assert r["engine_weight_truncated"] == 0
    for a, b in zip(auto, on, strict=True):  # the same steps: the loss and gradient within the weights' rounding
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


@pytest.mark.numerics
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_skewed_engine_is_seen_logged_and_corrected(small_model_dir, tmp_path, level):
    skewed = lambda t: SkewedEngine(t.model, t.tokenizer, temperature=2.0)  # noqa: E731
    on_trainer, on = _steps(_config(small_model_dir, tmp_path / "on", rollout_correction=level,
                                    rollout_correction_cap=1.1), skewed, steps=1)
    off_trainer, off = _steps(_config(small_model_dir, tmp_path / "off", rollout_correction="off"), skewed, steps=1)
    r = on[0]
    assert r["engine_logprob_diff_max"] > 0.1, r
    assert 0 < r["engine_weight_truncated"] < 1 and 0 < r["engine_weight_mean"] <= 1.1
    assert "engine_weight_mean" not in off[0] and off[0]["tokens_trained"] == r["tokens_trained"]
    moved = max((a - b).abs().max().item() for a, b in zip(on_trainer.model.parameters(),
                                                          off_trainer.model.parameters(), strict=True))
    assert moved > 1e-6, "the weights must change the update"
    assert json.loads(json.dumps(r))["engine_weight_mean"] == r["engine_weight_mean"]  # logged as plain floats


@pytest.mark.numerics
def test_two_epochs_weigh_against_the_same_engine_log_probs(small_model_dir, tmp_path):
    """With two PPO epochs π_old is the sampling policy in both: each micro-batch is weighed once, and the logged
    weights are those of one epoch (per trained token, not counted twice)."""
    skewed = lambda t: SkewedEngine(t.model, t.tokenizer, temperature=2.0)  # noqa: E731
    kw = dict(rollout_correction="token", rollout_correction_cap=1.1)
    _, one = _steps(_config(small_model_dir, tmp_path / "one", **kw), skewed, steps=1)
    _, two = _steps(_config(small_model_dir, tmp_path / "two", num_iterations=2, **kw), skewed, steps=1)
    for key in ("engine_weight_mean", "engine_weight_truncated", "engine_logprob_diff_max"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key
    assert 0 < two[0]["engine_weight_truncated"] < 1


def test_the_kl_term_carries_the_engine_weight():
    """``policy_loss(token_weights=w)``: each token's whole term, the surrogate and β·k3 alike, times its weight."""
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 4, generator=gen, dtype=torch.float64) - 0.1
    ref = logp + 0.4 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    w = torch.rand(3, 4, generator=gen, dtype=torch.float64) + 0.5
    adv, mask, beta = torch.tensor([1.0, -0.5, 0.0], dtype=torch.float64), torch.ones(3, 4), 0.3
    mask[1, 2:] = 0
    loss, _ = policy_loss(logp, adv, mask, ref_logprobs=ref, beta=beta, token_weights=w, num_sequences=5)
    d = ref - logp
    per_token = w * (-adv[:, None] + beta * (d.exp() - d - 1))  # one epoch: the ratio is 1
    by_hand = ((per_token * mask).sum(1) / mask.sum(1)).sum() / 5
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-12)


# --- end to end: the correction in the trainer's update, with completion pruning and the KL term on -------------
# Every completion of the toy policy above (length T: V^T of them) in each of a group's E2E_G slots, drawn by the
# policy or by the skewed engine, and every outcome of the completion keep draw, with their probabilities. Each
# outcome runs DPPOTrainer's own functions from the keep draw to the gradient at ``optimizer.step``: ``weigh`` (the
# estimator's ``weigh``: p_qi from the advantages, the keep mask, 1/(π_q p_qi), C), ``sequences`` (the kept completions
# with their engine log-probs) and ``update`` (micro-batches of one sequence, the reference's forward,
# ``engine_weights`` per micro-batch, ``micro_batch_loss``, backward), on the toy policy as a float64 model.
E2E_G = 2
BETA = 0.25
SCORES = (1.0, -0.5, 0.0, 0.75, -1.25, 0.25, -0.75, 1.5, -0.25)  # completion j's advantage (or reward), exact in fp32
MUTANT_MIN = 1e-6  # a mutant's relative bias must be far above float64 rounding (exact ones are ≤ 1e-9)


class BigramLM(torch.nn.Module):
    """The toy policy as a causal LM ``update`` can run: a position's logits are its token's row of a (V + 1, V)
    float64 table (row V: the prompt token, also the padding)."""

    def __init__(self, table: torch.Tensor, trainable: bool = True):
        super().__init__()
        self.table = torch.nn.Parameter(table.detach().clone(), requires_grad=trainable)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids])


class GradientAtStep:
    """Stands in for the optimizer: records the gradient ``update`` would step with."""

    def __init__(self, params):
        self.params, self.param_groups, self.grads = list(params), [{}], []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.params]))


class UpdateParts:
    """``DPPOTrainer``'s own functions from the keep draw to the optimizer step, on a stand-in that holds only what
    they read (the config, the estimator, the toy model and reference, a pad id, an engine name)."""

    weigh = DPPOTrainer.weigh
    update = DPPOTrainer.update
    _reference = DPPOTrainer._reference
    _lr = DPPOTrainer._lr
    rollout_correction_level = DPPOTrainer.rollout_correction_level

    def __init__(self, config: DPPOConfig, policy: torch.Tensor, reference: torch.Tensor):
        self.config, self.estimator = config, make_estimator(config)
        self.model, self.ref_model = BigramLM(policy), BigramLM(reference, trainable=False)
        self.tokenizer, self.engine = SimpleNamespace(pad_token_id=V), SimpleNamespace(name="skewed")
        self.optimizer, self.dist, self.step = GradientAtStep(self.model.parameters()), DistInfo(), 0


class KeepDraw:
    """Stands in for ``pruning.sample_keep``: returns the keep mask ``bits`` and records its probability."""

    def __init__(self):
        self.bits: tuple[bool, ...] = ()
        self.prob: float | None = None

    def __call__(self, probs, generator=None, fixed_size=False, **kwargs):
        assert not fixed_size, "Bernoulli draws only"
        p = torch.as_tensor(probs, dtype=torch.float64)
        keep = torch.tensor(self.bits).view(p.shape)
        self.prob = float(torch.where(keep, p, 1 - p).prod())
        return keep


def _e2e_config(correction: str, pruned: bool = True) -> DPPOConfig:
    return DPPOConfig(model="unused", pruning="dppo" if pruned else "none", prompts_per_step=1,
                      num_generations=E2E_G, max_completion_length=4, prompt_prune_rate=0.0,
                      completion_prune_rate=0.5 if pruned else 0.0, min_completion_keep_prob=0.2,
                      fixed_size_sampling=False, beta=BETA, temperature=1.0, micro_batch_size=1, max_grad_norm=0.0,
                      rollout_correction=correction, rollout_correction_cap=1e9)


def _rollouts(length: int, sampler: str, group_rewards: bool):
    """Every group of E2E_G completions with its probability under ``sampler`` (``policy`` or ``engine``), as the
    trainer receives it (the engine's log-probs on each completion) with its (1, G) advantages: the fixed ones of
    ``SCORES``, or (``group_rewards``) ``group_advantages`` of the rewards ``SCORES``."""
    theta, engine, completions, _ = _toy(length)
    lp = {y: _token_logprobs(theta, y) for y in completions}
    mu = {y: _token_logprobs(engine, y) for y in completions}
    prob = {y: float((lp if sampler == "policy" else mu)[y].sum().exp()) for y in completions}
    score = {y: SCORES[j % len(SCORES)] for j, y in enumerate(completions)}
    for ys in itertools.product(completions, repeat=E2E_G):
        batch = RolloutBatch([RolloutGroup("q", [V], [Completion(list(y), "", mu[y].tolist(), "length")
                                                      for y in ys])])
        scores = torch.tensor([[score[y] for y in ys]])
        adv = group_advantages(scores, "group") if group_rewards else scores
        yield math.prod(prob[y] for y in ys), batch, adv


def _reference_table(length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return _toy(length)[0] + 0.7 * torch.randn(V + 1, V, generator=gen, dtype=torch.float64)


def _keep_expectation(parts: UpdateParts, draw: KeepDraw, batch, adv) -> tuple[float, torch.Tensor]:
    """E[loss], E[gradient at optimizer.step] over the step's completion keep draw, given its rollouts."""
    loss, grad = 0.0, torch.zeros((V + 1) * V, dtype=torch.float64)
    for bits in itertools.product((True, False), repeat=E2E_G):  # all kept first: the outcome when none is drawn
        draw.bits, draw.prob = bits, None
        _, weighting = parts.weigh(full_selection(1), None, None, 0, advantages=adv, observe=False)
        prob = 1.0 if draw.prob is None else draw.prob
        if prob > 0:
            seqs = DPPOTrainer.sequences(batch, adv, weighting)
            if len(seqs):
                stats = parts.update(seqs)
                loss, grad = loss + prob * stats["loss"], grad + prob * parts.optimizer.grads[-1]
        if draw.prob is None:  # nothing drawn (nothing pruned): one outcome
            break
    return loss, grad


def expected_update(length: int, correction: str, sampler: str = "engine", pruned: bool = True,
                    group_rewards: bool = False) -> tuple[float, torch.Tensor]:
    """E[loss], E[gradient at optimizer.step] over every group ``sampler`` draws and every keep draw."""
    parts = UpdateParts(_e2e_config(correction, pruned), _toy(length)[0], _reference_table(length))
    loss, grad = 0.0, 0.0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pruning, "sample_keep", draw := KeepDraw())
        for prob, batch, adv in _rollouts(length, sampler, group_rewards):
            lv, gv = _keep_expectation(parts, draw, batch, adv)
            loss, grad = loss + prob * lv, grad + prob * gv
    return loss, grad


reference_update = functools.cache(expected_update)  # the real code's (never called with a mutant installed)


def on_policy(length: int, group_rewards: bool = False) -> tuple[float, torch.Tensor]:
    """Full-batch GRPO's expected loss and gradient with the policy sampling: every completion, weight 1, no engine
    weight."""
    return reference_update(length, "off", sampler="policy", pruned=False, group_rewards=group_rewards)


def _bias(got: tuple[float, torch.Tensor], want: tuple[float, torch.Tensor]) -> tuple[float, float]:
    """Relative bias of the loss and of the gradient."""
    assert abs(want[0]) > 1e-2 and want[1].norm() > 1e-2, "the reference step must have a loss and a gradient"
    return abs(got[0] - want[0]) / abs(want[0]), float((got[1] - want[1]).norm() / want[1].norm())


@pytest.mark.parametrize("length", [1, 2])
def test_the_sequence_weight_makes_the_trainers_pruned_step_with_kl_exact(length):
    """Asserted exactly (float64, relative 1e-9): with advantages fixed per completion (each completion's term then
    depends on its own draw only, and the keep probabilities still on its group's advantages), a KL term (β > 0),
    completion pruning (dppo, Bernoulli, p ∝ |A| with a floor) and the sequence engine weight (cap 1e9: never
    reached), the expected loss and gradient of the trainer's step over the skewed engine's draws and the keep draws
    are full-batch GRPO's with the policy sampling. Without the correction they are off (relative > 1e-2)."""
    want = on_policy(length)
    loss_bias, grad_bias = _bias(reference_update(length, "sequence"), want)
    assert loss_bias <= 1e-9 and grad_bias <= 1e-9, (loss_bias, grad_bias)
    loss_bias, grad_bias = _bias(reference_update(length, "off"), want)
    print(f"uncorrected, {length} tokens: relative bias of the loss {loss_bias:.3g}, of the gradient {grad_bias:.3g}")
    assert loss_bias > 1e-2 and grad_bias > 1e-2


def test_the_token_weight_in_the_trainer_is_exact_for_one_token_and_closer_for_two():
    """The same step with the token weight: exact for one-token completions (relative 1e-9); for two tokens the
    second token's prefix is still the engine's, so asserted only: not exact (> 1e-6), and a smaller gradient bias
    than without the correction (a property of this example, not a theorem)."""
    loss_bias, grad_bias = _bias(reference_update(1, "token"), on_policy(1))
    assert loss_bias <= 1e-9 and grad_bias <= 1e-9, (loss_bias, grad_bias)
    want = on_policy(2)
    _, token = _bias(reference_update(2, "token"), want)
    _, off = _bias(reference_update(2, "off"), want)
    print(f"two tokens: relative gradient bias {token:.3g} with the token weight, {off:.3g} without")
    assert 1e-6 < token < off


def test_with_group_advantages_the_keep_draw_stays_exact_given_the_engines_rollouts(monkeypatch):
    """Advantages from the group's rewards (``group_advantages``, as ``train_step``): for every group the engine drew,
    the keep draw's expected loss and gradient are exactly (relative 1e-9) the full group's engine-corrected step
    (the keep weight's Horvitz–Thompson argument holds whatever engine sampled). Over the engine's draws the corrected
    step is not on-policy GRPO's: A_qi depends on the other G − 1 draws, which a per-completion weight does not
    correct; asserted only as measurably off (> 1e-6), as docs/estimator.md says."""
    draw = KeepDraw()
    monkeypatch.setattr(pruning, "sample_keep", draw)
    table, reference = _toy(1)[0], _reference_table(1)
    pruned = UpdateParts(_e2e_config("sequence"), table, reference)
    full = UpdateParts(_e2e_config("sequence", pruned=False), table, reference)
    worst = 0.0
    for _, batch, adv in _rollouts(1, "engine", group_rewards=True):
        got, want = _keep_expectation(pruned, draw, batch, adv), _keep_expectation(full, draw, batch, adv)
        scale = max(abs(want[0]), float(want[1].norm()), 1e-3)  # a degenerate group: the KL term only
        worst = max(worst, abs(got[0] - want[0]) / scale, float((got[1] - want[1]).norm()) / scale)
    monkeypatch.undo()
    assert worst <= 1e-9, worst
    _, grad_bias = _bias(reference_update(1, "sequence", group_rewards=True), on_policy(1, group_rewards=True))
    print(f"group advantages, sequence weight: relative gradient bias {grad_bias:.3g} against on-policy GRPO")
    assert grad_bias > 1e-6


@pytest.mark.parametrize("mutant", ENGINE_MUTANTS, ids=lambda m: m.__name__)
def test_engine_weight_mutants_are_caught(monkeypatch, mutant):
    """Each wrong line of tests/helpers/mutants.py's engine section, installed in the trainer's path, gives the exact
    check of ``test_the_sequence_weight_makes_the_trainers_pruned_step_with_kl_exact`` (one-token completions: every
    mutant shows there, in a tenth of the time) a bias far above rounding."""
    want = on_policy(1)
    mutant(monkeypatch)
    loss_bias, grad_bias = _bias(expected_update(1, "sequence"), want)
    print(f"{mutant.__name__}: relative bias of the loss {loss_bias:.3g}, of the gradient {grad_bias:.3g}")
    assert grad_bias > MUTANT_MIN, f"{mutant.__name__}: gradient bias only {grad_bias:.2e}"
