"""GRESO's own rule (issue #64): a prompt kept with max(p^z, 0.01) after z all-equal groups in a row, per side, with
exploration probabilities adapted once a step toward a target share of zero-variance groups (a third of it for the
solved side, two thirds for the unsolved), as the authors' code runs it. A BIASED baseline: no weights."""

from __future__ import annotations

import pytest
import torch

from dppo_core.biased_baselines import GRESOExploration, greso_streak_keep_probs
from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.estimator import GRESOEstimator, make_estimator
from dppo_core.history import PromptHistory


def _observe(h: PromptHistory, pid: str, rewards: list[float], step: int) -> None:
    r = torch.tensor([rewards], dtype=torch.float64)
    h.update([pid], r, r - r.mean(), step)


def test_the_history_counts_all_equal_groups_of_one_value_in_a_row():
    h = PromptHistory()
    seen = []
    for step, r in enumerate([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1]]):
        _observe(h, "q", [float(x) for x in r], step)
        seen.append(h.get("q").equal_streak)
    assert seen == [1, 2, 3, 0, 1, 2, 1]  # a mixed group resets it; a change of side starts again at 1
    h2 = PromptHistory()
    _observe(h2, "q", [1.0, 1.0], 0)
    _observe(h2, "q", [1.0, 1.0], 30)
    assert h2.get("q").equal_streak == 2
    h2.update(["q"], torch.ones(1, 2), torch.zeros(1, 2), 90, max_age=10)  # stale: starts afresh
    assert h2.get("q").equal_streak == 1


def test_keep_probabilities_fall_with_the_streak_per_side_to_the_floor():
    h = PromptHistory()
    for step in range(3):
        _observe(h, "solved3", [1.0] * 4, step)
    for step in range(2):
        _observe(h, "unsolved2", [0.0] * 4, step)
    for step in range(12):
        _observe(h, "solved12", [1.0] * 4, step)
    _observe(h, "mixed", [1.0, 0.0, 1.0, 1.0], 0)
    p = greso_streak_keep_probs(h, ["solved3", "unsolved2", "solved12", "mixed", "unseen"], 0.5, 0.4, step=12)
    assert p.tolist() == pytest.approx([0.5 ** 3, 0.4 ** 2, 0.01, 1.0, 1.0])
    assert greso_streak_keep_probs(h, ["solved3"], 0.5, 0.4, step=40, max_age=10).tolist() == [1.0]  # too old


def test_exploration_moves_toward_the_targets_once_a_step_within_its_range():
    x = GRESOExploration(target=0.3)
    x.adapt(1)
    assert (x.p_solved, x.p_unsolved, x.adapted_at) == (0.5, 0.5, -1)  # nothing counted: nothing to adapt from
    # 10 groups: 2 all solved (20% >= 10%: skip more), 1 all unsolved (10% < 20%: skip less), 7 mixed
    x.count(torch.tensor([[1.0, 1.0]] * 2 + [[0.0, 0.0]] + [[1.0, 0.0]] * 7))
    x.adapt(1)
    assert (x.p_solved, x.p_unsolved) == pytest.approx((0.49, 0.51))
    x.adapt(1)  # the same step again: unchanged
    assert (x.p_solved, x.p_unsolved) == pytest.approx((0.49, 0.51))
    for step in range(2, 200):
        x.adapt(step)
    assert (x.p_solved, x.p_unsolved) == pytest.approx((0.05, 0.95))  # clamped to [0.05, 0.95]


def test_the_estimator_from_a_config_adapts_resumes_and_skips():
    config = DPPOConfig(pruning="greso", greso_target_zero_variance=0.25)
    est = make_estimator(config)
    assert isinstance(est, GRESOEstimator) and est.exploration is not None and est.prunes_prompts()
    ids = [f"q{i}" for i in range(40)]
    est.observe(ids, torch.ones(40, 4), torch.zeros(40, 4), 0)  # every group all solved: 100% >= 8.3%
    sel = est.select(ids, 1, size=40)
    assert est.exploration.p_solved == pytest.approx(0.49) and est.exploration.p_unsolved == pytest.approx(0.51)
    assert sel.probs.tolist() == pytest.approx([0.49] * len(sel.indices)) and 5 < len(sel.indices) < 35
    # its state travels with a checkpoint: a resumed estimator continues from the same probabilities
    again = make_estimator(config)
    again.load_state_dict(est.state_dict())
    assert again.exploration == est.exploration and again.select(ids, 2, size=40).probs.tolist() == \
        est.select(ids, 2, size=40).probs.tolist()
    # a resumed run with another target keeps the probabilities it reached and adapts toward the new target
    other = make_estimator(DPPOConfig(pruning="greso", greso_target_zero_variance=0.5))
    other.load_state_dict(est.state_dict())
    assert other.exploration.target == 0.5 and other.exploration.p_solved == est.exploration.p_solved
    # without the target: the constant rule at prompt_prune_rate, as before
    plain = make_estimator(DPPOConfig(pruning="greso", prompt_prune_rate=0.5))
    assert plain.exploration is None and "exploration" not in plain.state_dict()


@pytest.mark.parametrize("overrides", [dict(pruning="dppo", greso_target_zero_variance=0.25),
                                       dict(pruning="greso", greso_target_zero_variance=1.5),
                                       dict(pruning="greso", greso_target_zero_variance=0.25, prompt_prune_rate=0.5)])
def test_a_target_without_greso_or_beside_its_constant_rate_is_refused(overrides):
    with pytest.raises(ConfigError, match="greso_target_zero_variance"):
        DPPOConfig(**overrides)
