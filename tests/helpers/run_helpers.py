"""What the tests that train share: a reward with signal even for an untrained model, and a short run's config.

Importable from every tier as ``from run_helpers import ...`` (tests/conftest.py puts tests/helpers on the path;
tests/helpers/ddp_worker.py, run as a script, finds it beside itself)."""

from __future__ import annotations

from pathlib import Path

from dppo_core.config import DPPOConfig


def parity_reward(prompts, completions, **columns):
    """1 for an even number of characters: a reward with signal even for an untrained model. (Its name is the
    logged metric's: ``reward_parity_reward``.)"""
    return [float(len(c) % 2 == 0) for c in completions]


def run_config(model_dir: str | Path, out: str | Path, **kw) -> DPPOConfig:
    """A two-step run on levels 2 and 3 (4 prompts x 4 completions of at most 12 tokens, a checkpoint each step, a
    small evaluation); ``kw`` overrides any field."""
    base = dict(model=str(model_dir), output_dir=str(out), prompts_per_step=4, num_generations=4,
                max_completion_length=12, max_steps=2, save_steps=1, eval_problems_per_level=4,
                eval_samples=1, train_levels=(2, 3), learning_rate=1e-3)
    return DPPOConfig(**(base | kw))
