"""The rollout engine's mismatch corrected in the loss (``rollout_correction``): the weights, what they make
exact (by enumeration on a toy policy), and the trainer with the correction off, on, and on a skewed engine."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.grpo import policy_loss, truncated_importance_weights
from dppo_core.logprobs import Sequences, engine_weights
from dppo_core.rollout import HFRollout
from dppo_core.trainer import DPPOTrainer, micro_batch_loss

pytestmark = pytest.mark.numerics


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
    base = dict(model=str(model_dir), output_dir=str(out), prompts_per_step=4, num_generations=4,
                max_completion_length=12, max_steps=2, save_steps=0, eval_problems_per_level=4,
                eval_samples=1, train_levels=(2, 3), learning_rate=1e-3)
    return DPPOConfig(**{**base, **kw})


def parity_reward(prompts, completions, **columns):
    return [float(len(c) % 2 == 0) for c in completions]


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


def test_auto_is_off_on_the_transformers_engine_and_token_logs_weights_near_one(small_model_dir, tmp_path):
    trainer, auto = _steps(_config(small_model_dir, tmp_path))
    assert trainer.rollout_correction_level() is None and "engine_weight_mean" not in auto[0]
    on_trainer, on = _steps(_config(small_model_dir, tmp_path, rollout_correction="token"))
    for r in on:  # the engine is the model: weights within rounding of 1, none truncated
        assert r["engine_logprob_diff_max"] < 1e-4 and r["engine_weight_mean"] == pytest.approx(1, abs=1e-4)
        assert r["engine_weight_truncated"] == 0
    for a, b in zip(auto, on, strict=True):  # the same steps: the loss and gradient within the weights' rounding
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


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
