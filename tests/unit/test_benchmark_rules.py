"""The rules that pick the committed batch (benchmarks/tune_batch.py) and the numbers that compare predictors of
informative groups (benchmarks/predictors.py), on inputs whose answers are known."""

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tune_batch = _load("tune_batch")
predictors = _load("predictors")
smollm2_realistic = _load("smollm2_realistic")


def _run(score, wall, curve):
    return {"score": score, "wall_s": wall, "curve": [{"step": s, "train_s": t, "sampled_accuracy": a}
                                                      for s, t, a in curve]}


def test_equal_data_overrides_and_a_batch_that_does_not_divide():
    cpu_baselines = (32, 60, 10)  # its batch, steps and evaluation interval
    assert tune_batch.overrides(16, 1e-4, cpu_baselines) == ["prompts_per_step=16", "max_steps=120", "eval_steps=20",
                                                             "learning_rate=0.0001"]
    with pytest.raises(SystemExit, match="does not divide"):
        tune_batch.overrides(7, 1e-4, cpu_baselines)


def test_equal_data_follows_the_presets_own_budget():
    """cpu-baselines' budget is the module's constants; a persistence-map point keeps its own steps, so a batch of
    8 there runs four times its steps and evaluates at the same numbers of prompts seen."""
    from dppo_core.tools.bench import bench_preset
    from dppo_core.tools.bench.cpu_settings import persistence_steps

    assert tune_batch.base_budget(bench_preset("cpu-baselines")) == (32, 60, 10)
    batch, steps, every = tune_batch.base_budget(bench_preset("cpu-persist-70"))
    assert steps == persistence_steps(0.7) > 60 and every == steps // 12
    assert tune_batch.overrides(8, 2e-4, (batch, steps, every))[:3] == [
        "prompts_per_step=8", f"max_steps={steps * batch // 8}", f"eval_steps={every * batch // 8}"]


def test_mean_accuracy_over_time_is_the_area_under_the_interpolated_curve():
    curve = [{"step": 0, "train_s": 0.0, "sampled_accuracy": 0.4},
             {"step": 1, "train_s": 10.0, "sampled_accuracy": 0.6}]
    assert tune_batch.mean_accuracy_over_time(curve, 10.0) == pytest.approx(0.5)
    assert tune_batch.mean_accuracy_over_time(curve, 20.0) == pytest.approx((0.5 * 10 + 0.6 * 10) / 20)  # held after


def test_the_batch_rule_picks_the_rate_per_batch_then_the_batch_by_accuracy_over_time():
    """At B=32 the best rate is 1e-4, at B=16 2e-4; B=16 reaches the same accuracy in half the time, so it wins
    although its score per evaluation is lower."""
    rows = {
        "b32-lr0.0001": _run(0.60, 100.0, [(0, 0, 0.4), (10, 50, 0.6), (20, 100, 0.6)]),
        "b32-lr0.0002": _run(0.55, 100.0, [(0, 0, 0.4), (10, 50, 0.5), (20, 100, 0.6)]),
        "b16-lr0.0001": _run(0.50, 50.0, [(0, 0, 0.4), (20, 25, 0.5), (40, 50, 0.5)]),
        "b16-lr0.0002": _run(0.58, 50.0, [(0, 0, 0.4), (20, 25, 0.58), (40, 50, 0.58)]),
    }
    chosen = tune_batch.choose({"m": rows}, [32, 16], [1e-4, 2e-4])["m"]
    assert chosen["best_lr_per_batch"] == {"32": "b32-lr0.0001", "16": "b16-lr0.0002"}
    assert chosen["horizon_s"] == 50.0 and chosen["batch"] == 16 and chosen["setting"] == "b16-lr0.0002"
    assert chosen["mean_accuracy_over_time"]["32"] == pytest.approx(0.5)  # 0.4 -> 0.6 over [0, 50]


def test_auc_counts_ties_half_and_needs_both_classes():
    assert predictors.auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    assert predictors.auc([0.5, 0.5], [True, False]) == pytest.approx(0.5)
    assert predictors.auc([0.2, 0.3], [True, True]) is None


def test_p_informative_is_one_minus_both_all_equal_probabilities():
    assert predictors.p_informative(1.0, 1.0, 8) == pytest.approx(1 - 2 / 9)  # uniform: P(k = 0) = P(k = 8) = 1/9
    a, b, g = 30.0, 10.0, 4  # nearly p = 0.75: close to 1 - p^4 - (1 - p)^4
    assert predictors.p_informative(a, b, g) == pytest.approx(1 - 0.75 ** 4 - 0.25 ** 4, abs=0.02)


def test_sqrt_keep_probs_meet_the_budget_within_the_floor():
    pi = predictors.sqrt_keep_probs([0.0, 0.25, 1.0, 1.0], budget=2.0, floor=0.2)
    assert sum(pi) == pytest.approx(2.0, abs=1e-6) and min(pi) == pytest.approx(0.2)
    assert pi[2] == pi[3] and pi[1] == pytest.approx(pi[2] / 2)  # ∝ √p where neither floor nor cap binds
    assert all(0.2 <= q <= 1 for q in pi) and not math.isnan(sum(pi))


def test_replay_scores_each_group_before_it_is_seen():
    groups = [{"step": 1, "ids": ["L2:a", "L3:b"], "rewards": [[1, 1], [0, 1]]},
              {"step": 2, "ids": ["L2:a", "L3:b"], "rewards": [[1, 1], [1, 0]]}]
    out = predictors.replay(groups, [None])
    assert out["labels"] == [False, True, False, True]
    assert out["last"]["p"][2:] == [0.0, 1.0]  # step 2 reads step 1's outcomes
    unseen = 1 - 1 / 3 - 1 / 3  # Beta(1, 1), G = 2: P(k = 0) = P(k = 2) = 1/3
    assert out["posterior-hinf"]["p"][0] == out["posterior-hinf"]["p"][1] == pytest.approx(unseen)
    assert out["hindsight"]["p"][0] == pytest.approx(predictors.p_informative(3.0, 1.0, 2))  # the other group: 2 of 2


def test_the_realistic_pool_rule_solves_the_two_target_shares():
    """benchmarks/level_success.py: with level 1 always all-correct, level 6 always all-wrong and levels 2-5 always
    mixed, the weights for 30% all correct and 20% all wrong are 0.3, 0.5 (split over levels 2-5) and 0.2."""
    level_success = _load("level_success")
    assert level_success.shares([8, 8, 0, 3], 8) == {"all_correct": 0.5, "all_wrong": 0.25, "mixed": 0.25,
                                                     "mean_success": 19 / 32}
    per_level = {1: {"all_correct": 1.0, "all_wrong": 0.0, "mixed": 0.0, "mean_success": 1.0},
                 6: {"all_correct": 0.0, "all_wrong": 1.0, "mixed": 0.0, "mean_success": 0.0},
                 **{lvl: {"all_correct": 0.0, "all_wrong": 0.0, "mixed": 1.0, "mean_success": 0.5}
                    for lvl in (2, 3, 4, 5)}}
    out = level_success.solve_weights(per_level, 0.3, 0.2)
    assert out["exact"] == pytest.approx({"level_1": 0.3, "levels_2_5": 0.5, "level_6": 0.2})
    assert out["levels"] == [1, 2, 3, 4, 5, 6]
    assert out["level_weights"] == pytest.approx([0.3, 0.125, 0.125, 0.125, 0.125, 0.2])
    assert out["expected_shares"]["all_correct"] == pytest.approx(0.3)
    assert out["expected_shares"]["all_wrong"] == pytest.approx(0.2)
    assert level_success.pool_weights(per_level, 0.3, 0.2) == out  # reachable: the rule itself


def test_the_pool_rule_falls_back_to_the_all_equal_share_when_nothing_is_always_solved():
    """A model that solves no level every time (SmolLM2 at T = 1) cannot give 30% all-correct groups: the
    exact solution is no mixture, so the fallback keeps levels 1-5 at 2 : 1 : 1 : 1 : 1 and puts on level 6
    the grid weight whose expected all-equal share is nearest 50%."""
    level_success = _load("level_success")
    mixed = {"all_correct": 0.0, "all_wrong": 0.0, "mixed": 1.0, "mean_success": 0.5}
    per_level = {**{lvl: mixed for lvl in (1, 2, 3, 4, 5)},
                 6: {"all_correct": 0.0, "all_wrong": 1.0, "mixed": 0.0, "mean_success": 0.0}}
    assert not level_success.feasible(level_success.solve_weights(per_level, 0.3, 0.2)["exact"])
    out = level_success.pool_weights(per_level, 0.3, 0.2)
    assert out["rule"] == "fallback: all-equal share" and out["levels"] == [1, 2, 3, 4, 5, 6]
    # level 6 at 0.5 gives exactly 50% all-equal groups; the rest 2 : 1 : 1 : 1 : 1
    assert out["level_weights"] == pytest.approx([0.5 / 3, 0.5 / 6, 0.5 / 6, 0.5 / 6, 0.5 / 6, 0.5], abs=1e-4)
    assert out["expected_shares"]["all_wrong"] == pytest.approx(0.5)
    # levels 1-5 already half all-wrong: level 6 gets nothing
    half = {"all_correct": 0.0, "all_wrong": 0.5, "mixed": 0.5, "mean_success": 0.2}
    out = level_success.pool_weights({**{lvl: half for lvl in (1, 2, 3, 4, 5)}, 6: per_level[6]}, 0.3, 0.2)
    assert out["level_weights"][-1] == 0.0


def _greedy_run(points):
    return {"curve": [{"step": i, "train_s": t, "greedy_accuracy": a, "sampled_accuracy": a}
                      for i, (t, a) in enumerate(points)]}


def test_the_real_model_comparison_times_each_seed_to_the_baselines_final_accuracy():
    """smollm2_realistic.speedups: the baseline ends at 0.6 on every seed (targets 0.54 and 0.57); the method
    climbs twice as fast on seeds 1 and 2, and never gets there on seed 3 (a miss, not a ratio)."""
    base = _greedy_run([(0, 0.3), (100, 0.45), (200, 0.6)])
    fast = _greedy_run([(0, 0.3), (50, 0.45), (100, 0.6)])
    slow = _greedy_run([(0, 0.3), (100, 0.4), (200, 0.5)])
    runs = {("grpo_skip", s): base for s in (1, 2, 3)} | {("dppo", 1): fast, ("dppo", 2): fast, ("dppo", 3): slow}
    out = smollm2_realistic.speedups(runs, "dppo", "grpo_skip", "greedy")
    assert out["seeds"] == [1, 2, 3] and out["baseline_final"] == 0.6
    for f, t in (("0.90", 160.0), ("0.95", 180.0)):  # 0.45 + (0.6 - 0.45) * (t - 100) / 100 = 0.54, 0.57
        e = out[f]
        assert e["target"] == pytest.approx(float(f) * 0.6) and e["missed"] == 1 and e["at_start"] == 0
        assert smollm2_realistic.time_to_target(smollm2_realistic._curve(base, "greedy"), e["target"]) == \
            pytest.approx(t)
        assert e["speedup"] == pytest.approx(2.0) and e["per_seed"] == [2.0, 2.0]
        assert e["ci95"] == [2.0, 2.0] and e["paired_ci95"] == [2.0, 2.0]
    assert smollm2_realistic.speedups(runs, "dppo", "grpo_skip_matched", "greedy")["why_not"].startswith("no seed")
    row = smollm2_realistic._interval(out["0.90"])
    assert row == "2.00x [2.00, 2.00]; bootstrap [2.00, 2.00] (1 missed)"
    assert smollm2_realistic._interval({"speedup": None}) == "never reached"
    method = {"seeds": [1, 2, 3], "prompts_rolled_out": 4.5, "all_equal_share": 0.4567, "greedy_start": 0.3,
              "greedy_final": [0.6, 0.01], "sampled_final": [0.55, 0.02], "training_minutes": 12.34,
              "phase_minutes": {"rollout": 5.0, "update": 6.0}, "tokens_trained": 12345}
    text = smollm2_realistic.markdown({"methods": {"dppo": method}, "speedups": {"greedy": {
        "dppo vs grpo_skip": out, "dppo vs grpo_skip_matched": {"seeds": [], "why_not": "no seed"}}}})
    assert "| `dppo` | 3 | 4.5 | 45.7% | 0.300 -> 0.600 (0.010) | 0.550 (0.020) | 12.3 (5.0, 6.0) | 12,345 |" in text
    assert ("| `dppo` against `grpo_skip` | greedy | 0.600 | 2.00x [2.00, 2.00]; bootstrap [2.00, 2.00] (1 missed) |"
            in text)
    assert "grpo_skip_matched" not in text
