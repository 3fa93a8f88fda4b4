"""The exact expectation end to end (tests/unit/test_exact_expectation.py computes it on plain tensors): the
gradient that reaches the optimizer, through the embedded tiny model, real rollouts and the trainer's update,
averaged over every draw of the estimator (tests/helpers/enumeration.py), equals full-batch GRPO's."""

from __future__ import annotations

import copy

import pytest
import torch
from enumeration import Enumerator
from run_helpers import parity_reward

from dppo_core import pruning
from dppo_core.config import DPPOConfig
from dppo_core.data import prompt_key
from dppo_core.estimator import make_estimator
from dppo_core.pruning import PromptHistory
from dppo_core.rollout import RolloutBatch
from dppo_core.trainer import DPPOTrainer

STEP = 7  # the step the estimator draws at (any step: the history below is one step older)


@pytest.mark.numerics  # a model's forward and backward in float32
def test_the_gradient_reaching_the_optimizer_is_exact_in_expectation(monkeypatch, tiny_model_dir, tmp_path):
    """The embedded tiny model, real rollouts, ``trainer.update`` (micro-batches, KL to the reference): the
    expected gradient at ``optimizer.step`` over every draw equals full-batch GRPO's (float32 rounding)."""
    from dppo_core.rollout import HFRollout, SamplingConfig

    config = DPPOConfig(model=str(tiny_model_dir), output_dir=str(tmp_path), pruning="dppo", prompts_per_step=2,
                        num_generations=2, max_completion_length=6, prompt_prune_rate=0.5, completion_prune_rate=0.5,
                        min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2, beta=0.04, max_grad_norm=0.0,
                        micro_batch_size=2)
    trainer = DPPOTrainer(config, reward_funcs=[parity_reward], progress=False)
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
        adv, weighting = trainer.weigh(sel, rewards[sel.indices], lengths, STEP)  # observe, then weigh
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
