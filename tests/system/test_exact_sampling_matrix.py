"""The sampling matrix of the exact expectation (tests/unit/test_exact_expectation.py says what it checks and how):
every prompt scheme × completion scheme × design × dense prompts or not × fixed or adaptive completion rate, each
step's loss and gradient averaged over every draw, against full-batch GRPO. Plain tensors, no model; here rather
than in tests/unit because enumerating every draw of its 192 settings takes minutes (the Bernoulli designs with dense
prompts most of it)."""

from __future__ import annotations

import pytest
from exact import SAMPLING, TOL, dppo_config, relative_bias, sampling_id

from dppo_core import history as history_module

# Not marked `numerics`: float64 on a few tokens, no matrix product, exact to 1e-9 (the Makefile's second kernel setting
# cannot change an outcome).


@pytest.mark.parametrize("settings", SAMPLING, ids=sampling_id)
def test_every_scheme_design_and_rate_is_exact(monkeypatch, settings):
    """Every prompt scheme × completion scheme × design × dense or not × fixed or adaptive completion rate. The
    ``fitted`` scheme's prior is fitted to the enumeration's few prompts (the threshold lowered), not left uniform."""
    monkeypatch.setattr(history_module, "MIN_PRIOR_GROUPS", 1)
    config = dppo_config(**settings)
    loss_bias, grad_bias, n = relative_bias(monkeypatch, config)
    print(f"{n} outcomes: relative bias of the loss {loss_bias:.1e}, of the gradient {grad_bias:.1e}")
    assert loss_bias <= TOL and grad_bias <= TOL, f"{n} outcomes: loss bias {loss_bias:.2e}, gradient {grad_bias:.2e}"
