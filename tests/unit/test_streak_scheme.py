"""The ``streak`` prompt scheme (issue #63, item 4): ``fitted``'s P(informative), recalibrated for prompts after a run
of all-equal groups by the run's own counts (dppo_core.posterior.StreakCalibration). Its exactness (π fixed before the
draw, weights 1/π) is checked with every other scheme by the exact matrices (tests/helpers/exact.py enumerates
PROMPT_SCHEMES, with counts that move its π away from fitted's); here: what it computes, that it learns what a run
shows, and that it survives a checkpoint."""

from __future__ import annotations

import pytest
import torch

from dppo_core import posterior, pruning
from dppo_core.estimator import DPPOEstimator
from dppo_core.grpo import group_advantages
from dppo_core.history import PromptHistory
from dppo_core.posterior import CALIBRATION_PSEUDO_GROUPS, StreakCalibration

G = 8
ALL_WRONG, ALL_RIGHT, MIXED = [0.0] * G, [1.0] * G, [1.0, 0.0] * (G // 2)


def observe(history: PromptHistory, rows: dict[str, list[float]], step: int) -> None:
    r = torch.tensor(list(rows.values()), dtype=torch.float64)
    history.update(list(rows), r, group_advantages(r), step)


def pool_history() -> PromptHistory:
    """20 prompts seen at steps 0 and 1: a never solved (two all-wrong groups), b once all wrong after a mixed group,
    c mixed, the rest a spread of pass counts (so the fitted prior has its 20 prompts)."""
    h = PromptHistory(half_life=20.0)
    rest = {f"r{i}": [1.0] * (i % (G + 1)) + [0.0] * (G - i % (G + 1)) for i in range(17)}
    observe(h, {"a": ALL_WRONG, "b": MIXED, "c": MIXED, **rest}, 0)
    observe(h, {"a": ALL_WRONG, "b": ALL_WRONG, "c": MIXED}, 1)
    return h


def test_an_empty_table_is_the_fitted_rule():
    h = pool_history()
    ids = ["a", "b", "c", "r3", "unseen"]
    fitted = pruning.prompt_keep_probs(h, ids, 0.5, scheme="fitted", min_keep_prob=0.1, step=2, group_size=G)
    for calibration in (None, StreakCalibration()):
        streak = pruning.prompt_keep_probs(h, ids, 0.5, scheme="streak", min_keep_prob=0.1, step=2, group_size=G,
                                           calibration=calibration)
        torch.testing.assert_close(streak, fitted, rtol=0, atol=1e-12)


def test_the_table_moves_only_prompts_whose_last_groups_were_all_equal():
    """a (z = 2) and b (z = 1) get their cells' estimates, shrunk toward the posterior; c (mixed last) and an unseen
    prompt keep the posterior's value."""
    h = pool_history()
    ids = ["a", "b", "c", "unseen"]
    p = posterior.fitted_informative(h, ids, G, step=2)
    assert h.get("a").equal_streak == 2 and h.get("b").equal_streak == 1 and h.get("c").equal_streak == 0
    cal = StreakCalibration({StreakCalibration.cell(2, float(p[0])): [0.0, 90.0],
                             StreakCalibration.cell(1, float(p[1])): [45.0, 90.0]})
    out = cal.predict(h, ids, p, step=2)
    m = CALIBRATION_PSEUDO_GROUPS
    assert float(out[0]) == pytest.approx(m * float(p[0]) / (90 + m))
    assert float(out[1]) == pytest.approx((45 + m * float(p[1])) / (90 + m))
    assert out[2:].tolist() == p[2:].tolist()
    # a stale record (max_age) reads as unseen: the posterior's value again
    assert cal.predict(h, ids, p, step=30, max_age=5).tolist() == p.tolist()


def test_the_estimator_learns_what_its_run_shows_and_keeps_it_in_checkpoints():
    """A run in which a prompt after all-equal groups is never informative next: the counts say so, and its
    P(informative) falls below the posterior's while a mixed one's does not; the counts go through a checkpoint, and
    a bad one is refused without changing anything; the fitted rule counts nothing."""
    est = DPPOEstimator(prompt_prune_rate=0.5, prompt_scheme="streak", min_prompt_keep_prob=0.05, group_size=G)
    fitted = DPPOEstimator(prompt_prune_rate=0.5, prompt_scheme="fitted", min_prompt_keep_prob=0.05, group_size=G)
    assert fitted.calibration.counts == {}
    never = [f"n{i}" for i in range(12)]
    mixed = [f"m{i}" for i in range(12)]
    for step in range(8):
        rows = {**{pid: ALL_WRONG for pid in never}, **{pid: MIXED for pid in mixed}}
        r = torch.tensor(list(rows.values()), dtype=torch.float64)
        for e in (est, fitted):
            e.observe(list(rows), r, group_advantages(r), step)
    cells = est.calibration.counts
    assert cells and all(k.startswith(("1:", "2:", "3:")) for k in cells)
    assert sum(v[0] for v in cells.values()) == 0 and sum(v[1] for v in cells.values()) == 12 * 7
    ids = [never[0], mixed[0]]
    p = posterior.fitted_informative(est.history, ids, G, step=8)
    calibrated = est.calibration.predict(est.history, ids, p, step=8)
    assert float(calibrated[0]) < 0.5 * float(p[0]) and float(calibrated[1]) == float(p[1])
    ours = est.prompt_probs(ids, 8)

    state = est.state_dict()
    again = DPPOEstimator(prompt_prune_rate=0.5, prompt_scheme="streak", min_prompt_keep_prob=0.05, group_size=G)
    again.load_state_dict(state)
    torch.testing.assert_close(again.prompt_probs(ids, 8), ours, rtol=0, atol=0)
    with pytest.raises(ValueError, match="StreakCalibration"):
        again.load_state_dict({**state, "calibration": {"counts": {"1:0": [3.0]}}})
    torch.testing.assert_close(again.prompt_probs(ids, 8), ours, rtol=0, atol=0)
    # another scheme's checkpoint holds no counts (its state is as before the scheme existed)
    assert "calibration" not in fitted.state_dict()


def test_a_stopped_pilot_is_not_counted():
    """k equal rewards of a stopped pilot say nothing of the G-group they stood for: not counted."""
    h = pool_history()
    cal = StreakCalibration()
    p = posterior.fitted_informative(h, ["a"], G, step=2)
    cal.record(h, ["a"], p, torch.zeros(1, 2, dtype=torch.float64), G, step=2)
    assert cal.counts == {}
    cal.record(h, ["a"], p, torch.tensor([MIXED], dtype=torch.float64), G, step=2)
    assert list(cal.counts.values()) == [[1.0, 1.0]]
