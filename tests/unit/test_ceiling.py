"""The group log (dppo_core.grouplog) and the ceiling of pruning (dppo_core.tools.bench.ceiling), on synthetic logs
whose answer is computed by hand."""

import json
import re
from pathlib import Path

import pytest
import torch
from mutants import CEILING_MUTANTS, GROUPLOG_MUTANTS, lower_committed_ceiling

from dppo_core import grouplog
from dppo_core.grouplog import group_record, informative, read_groups
from dppo_core.run.disk import append_jsonl
from dppo_core.tools import bench
from dppo_core.tools.bench import ceiling
from dppo_core.tools.bench.ceiling import cost_fit, linear_fit, nonnegative_fit, oracle_ceiling, rollout_fit


def _groups(step, rewards, lengths):
    return group_record(step, len(rewards), [f"q{step}-{i}" for i in range(len(rewards))],
                        torch.ones(len(rewards)), torch.tensor(rewards, dtype=torch.float32), torch.tensor(lengths))


# the baseline: step 1 rolls out 100 tokens of which 30 in its informative group, step 2 60 of which 50
BASE_GROUPS = [_groups(1, [[1, 0], [1, 1]], [[10, 20], [30, 40]]), _groups(2, [[0, 0], [0, 1]], [[5, 5], [25, 25]])]
# its rollout costs exactly 0.1 s + 10 ms per generated token, its update 0.2 s + 10 ms per trained token (the same
# engine and packing as the method's)
BASE_METRICS = [{"step": 1, "tokens_generated": 100, "tokens_trained": 30, "time_rollout": 1.1, "time_update": 0.5,
                 "step_time": 1.7},
                {"step": 2, "tokens_generated": 60, "tokens_trained": 50, "time_rollout": 0.7, "time_update": 0.7,
                 "step_time": 1.5}]  # and 0.1 s per step elsewhere (reward, pack, gaps)
# the method: informative tokens 100 and 50, of which it trains 75 and 45 (kappa = 120 / 150 = 0.8); its update
# costs exactly 0.2 s + 10 ms per trained token
METHOD_GROUPS = [_groups(1, [[1, 0]], [[40, 60]]), _groups(2, [[1, 1], [0, 1]], [[7, 7], [20, 30]])]
METHOD_METRICS = [{"step": 1, "tokens_generated": 100, "tokens_trained": 75, "time_rollout": 1.1, "time_update": 0.95,
                   "step_time": 2.15},
                  {"step": 2, "tokens_generated": 64, "tokens_trained": 45, "time_rollout": 0.74, "time_update": 0.65,
                   "step_time": 1.49}]  # the same engine: its rollout costs what the baseline's does
# the oracle: step 1 = 0.1 + 0.01*30 + 0.2 + 0.01*0.8*30 + 0.1 = 0.94 s; step 2 = 0.1 + 0.5 + 0.2 + 0.4 + 0.1 = 1.3 s
CEILING = (1.7 + 1.5) / (0.94 + 1.3)


def test_the_ceiling_on_a_synthetic_log_with_a_known_answer():
    c = oracle_ceiling(BASE_METRICS, BASE_GROUPS, METHOD_METRICS, METHOD_GROUPS)
    assert c["speedup"] == pytest.approx(CEILING)
    assert c["kappa"] == pytest.approx(0.8) and c["other_s_per_step"] == pytest.approx(0.1)
    fit = c["rollout_fit"]
    assert fit["model"] == "decode-aware" and fit["r2"] == pytest.approx(1.0)
    assert (fit["c0"], fit["c_longest"], fit["c_tokens"]) == (pytest.approx(0.1), pytest.approx(0.0, abs=1e-9),
                                                              pytest.approx(0.01))
    assert (c["update_fit"]["a"], c["update_fit"]["b"]) == (pytest.approx(0.2), pytest.approx(0.01))
    assert c["informative_token_share"] == pytest.approx(80 / 160)


def test_a_rollout_paced_by_its_longest_completion():
    """Rollout s = 0.2 + 20 ms per token of the step's longest completion + 1 ms per generated token (a batched
    decode runs until its longest completion ends). The oracle's longest completion is its informative groups':
    step 1's informative group is 10 and 20 tokens long, while the step's longest completion is 40."""
    def rollout(longest, tokens):
        return 0.2 + 0.02 * longest + 0.001 * tokens

    base = [{"step": s, "tokens_generated": sum(map(sum, ls)), "tokens_trained": n,
             "time_rollout": rollout(max(map(max, ls)), sum(map(sum, ls))), "time_update": 0.1 + 0.01 * n}
            for s, ls, n in ((1, [[10, 20], [30, 40]], 30), (2, [[5, 5], [25, 25]], 50))]
    method = [{"step": s, "tokens_generated": sum(map(sum, ls)), "tokens_trained": n,
               "time_rollout": rollout(max(map(max, ls)), sum(map(sum, ls))), "time_update": 0.1 + 0.01 * n}
              for s, ls, n in ((1, [[40, 60]], 100), (2, [[7, 7], [20, 30]], 50))]
    for m in [*base, *method]:
        m["step_time"] = m["time_rollout"] + m["time_update"] + 0.1
    base_groups = [_groups(1, [[1, 0], [1, 1]], [[10, 20], [30, 40]]), _groups(2, [[0, 0], [0, 1]], [[5, 5], [25, 25]])]
    method_groups = [_groups(1, [[1, 0]], [[40, 60]]), _groups(2, [[1, 1], [0, 1]], [[7, 7], [20, 30]])]
    c = oracle_ceiling(base, base_groups, method, method_groups)
    fit = c["rollout_fit"]
    assert fit["model"] == "decode-aware" and fit["r2"] == pytest.approx(1.0)
    assert (fit["c0"], fit["c_longest"], fit["c_tokens"]) == (pytest.approx(0.2), pytest.approx(0.02),
                                                              pytest.approx(0.001))
    kappa = 150 / 150  # the method trains every token of its informative groups (100 + 50)
    oracle = [rollout(20, 30) + 0.1 + 0.01 * kappa * 30 + 0.1, rollout(25, 50) + 0.1 + 0.01 * kappa * 50 + 0.1]
    assert c["kappa"] == pytest.approx(kappa)
    assert c["speedup"] == pytest.approx(sum(m["step_time"] for m in base) / sum(oracle), rel=1e-9)
    # the tokens-only model would have let the oracle save the decode steps of the longest, uninformative group
    assert c["speedup"] < sum(m["step_time"] for m in base) / sum(
        (0.2 + 0.02 * 40 + 0.001 * 30) * 30 / 100 + 0.1 + 0.01 * n + 0.1 for n in (30, 50))


def test_the_nonnegative_fit_and_the_named_fallback():
    fit = nonnegative_fit({"x": [1, 2, 3, 4]}, [3, 5, 7, 9])
    assert (fit["c0"], fit["x"], fit["r2"]) == (pytest.approx(1.0), pytest.approx(2.0), pytest.approx(1.0))
    fit = nonnegative_fit({"x": [1, 2, 3, 4], "z": [1, 0, 1, 0]}, [5, 4, 3, 2])  # falls with x: x's coefficient is 0
    assert fit["x"] == 0.0 and min(fit.values()) >= 0.0
    fit = nonnegative_fit({"x": [1, 2, 3]}, [1, 3, 5])  # the free fit's intercept is -1: through 0 instead
    assert fit["c0"] == 0.0 and fit["x"] == pytest.approx(22 / 14)
    fallback = rollout_fit([60, 61, 60, 62], [100, 110, 120, 130], [1.0, 1.2, 0.9, 1.1])
    assert fallback["model"] == "proportional" and fallback["r2"] < 0.5
    assert (fallback["c0"], fallback["c_longest"], fallback["c_tokens"]) == (0.0, 0.0, pytest.approx(4.2 / 460))


def test_every_group_informative_and_nothing_pruned_is_no_speedup():
    """The method is the baseline (same steps, every group informative, everything trained): the ceiling is 1."""
    groups = [_groups(s, [[1, 0], [0, 1]], [[10, 20], [30, 40 + s]]) for s in (1, 2, 3)]
    metrics = [{"step": s, "tokens_generated": n, "tokens_trained": n, "time_rollout": 0.1 + 0.01 * n,
                "time_update": 0.2 + 0.02 * n, "step_time": 0.35 + 0.03 * n} for s, n in ((1, 101), (2, 102), (3, 103))]
    assert oracle_ceiling(metrics, groups, metrics, groups)["speedup"] == pytest.approx(1.0)


def test_a_baseline_log_missing_a_step_is_refused():
    with pytest.raises(ValueError, match=r"no line for step\(s\) \[2\]"):
        oracle_ceiling(BASE_METRICS, BASE_GROUPS[:1], METHOD_METRICS, METHOD_GROUPS)


def test_a_cost_the_tokens_do_not_explain_is_taken_as_proportional():
    """Times that do not follow the token counts (R² under MIN_R2): the proportional model, which lets the oracle
    save the per-step part too, so the ceiling can only rise."""
    fit = cost_fit([100, 110, 120, 130], [1.0, 1.2, 0.9, 1.1])
    assert fit["model"] == "proportional" and fit["a"] == 0.0 and fit["b"] == pytest.approx(4.2 / 460)
    assert cost_fit([1, 2, 3], [3, 5, 7])["model"] == "affine"


def test_linear_fit_and_a_constant_input():
    fit = linear_fit([1, 2, 3], [3, 5, 7])
    assert (fit["a"], fit["b"], fit["r2"]) == (pytest.approx(1.0), pytest.approx(2.0), pytest.approx(1.0))
    assert linear_fit([4, 4], [1.0, 3.0]) == {"a": 2.0, "b": 0.0, "r2": 0.0}
    assert (linear_fit([1, 2, 3], [1, 3, 5])["a"], linear_fit([1, 2, 3], [3, 2, 1])["b"]) == (0.0, 0.0)  # never < 0
    assert linear_fit([1, 2, 3], [3, 2, 1])["a"] == pytest.approx(2.0)


def test_group_records_are_compact_and_read_back_in_step_order(tmp_path):
    rec = group_record(3, 5, ["a", "b"], torch.tensor([0.5, 1 / 3], dtype=torch.float64),
                       torch.tensor([[1.0, 0.0], [0.25, 2 / 3]]), torch.tensor([[4, 5], [6, 7]]))
    assert rec == {"step": 3, "window": 5, "ids": ["a", "b"], "pi": [0.5, 0.333333],
                   "rewards": [[1, 0], [0.25, 0.666667]], "lengths": [[4, 5], [6, 7]]}
    (tmp_path / "groups.jsonl").write_text(json.dumps({**rec, "step": 4}) + "\n" + json.dumps(rec) + "\n{\"step\": 5, ")
    assert [g["step"] for g in read_groups(tmp_path)] == [3, 4]  # a line cut off by a crash is skipped
    assert informative([1, 0]) and not informative([0.5, 0.5])
    with pytest.raises(ValueError, match="one row per id"):
        group_record(1, 2, ["a"], torch.ones(1), torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(FileNotFoundError, match="log_groups"):
        read_groups(tmp_path / "elsewhere")


def test_bench_json_has_the_ceiling_and_the_fraction_reached(tmp_path):
    """Through summarize_bench: the ceiling over grpo_skip from the runs' own logs, the fraction of it reached to
    each target, and the markdown line; a method without groups.jsonl says why it has none."""
    def write_run(method, metrics, groups, accs):
        d = bench.run_dir(tmp_path, method, 0)
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"machine": "m", "elapsed_s": 1.0}))
        (d / "config.json").write_text(json.dumps({"seed": 0, "output_dir": str(d)}))
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        if groups is not None:
            (d / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
        (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "sampled_accuracy": a}) + "\n"
                                              for s, a in zip((0, 1, 2), accs, strict=True)))

    write_run("grpo", BASE_METRICS, BASE_GROUPS, (0.4, 0.5, 0.6))
    write_run("grpo_skip", BASE_METRICS, BASE_GROUPS, (0.4, 0.5, 0.6))  # reaches 0.57 at 1.7 + 0.7 * 1.5 = 2.75 s
    write_run("dppo", METHOD_METRICS, METHOD_GROUPS, (0.4, 0.6, 0.6))   # reaches 0.57 at 0.85 * 2.15 = 1.8275 s
    result = bench.summarize_bench(tmp_path, "mine", ("grpo", "grpo_skip", "dppo"), (0,))
    c = result["ceiling"]["grpo_skip"]["dppo"]
    assert c["speedup"] == pytest.approx(CEILING) and c["per_seed"] == [pytest.approx(CEILING)]
    measured = result["speedup_vs"]["grpo_skip"]["dppo"]["by_target"]["0.95"]["time_to_target"]
    assert measured == pytest.approx(2.75 / 1.8275)
    # up to grpo_skip's time to the 95% target (2.75 s: step 1 and 0.7 of step 2) the oracle takes 0.94 + 0.7 * 1.3 s;
    # to the 90% target (0.54, at 2.3 s) 0.94 + 0.4 * 1.3 s
    assert c["by_target"]["0.95"]["ceiling"] == pytest.approx(2.75 / (0.94 + 0.7 * 1.3))
    assert c["by_target"]["0.90"]["ceiling"] == pytest.approx(2.3 / (0.94 + 0.4 * 1.3))
    assert c["fraction_reached"]["0.95"] == pytest.approx(measured / (2.75 / (0.94 + 0.7 * 1.3)))
    assert result["ceiling"]["grpo"]["grpo_skip"]["speedup"] > 1  # grpo_skip over grpo: its uninformative groups
    text = bench.format_markdown(result)
    assert f"| {CEILING:.2f}x ({CEILING:.2f}) |" in text  # the whole run's ceiling, per seed
    assert f"{2.75 / (0.94 + 0.7 * 1.3):.2f}x, {measured / (2.75 / (0.94 + 0.7 * 1.3)):.0%}" in text
    (bench.run_dir(tmp_path, "dppo", 0) / "groups.jsonl").unlink()
    result = bench.summarize_bench(tmp_path, "mine", ("grpo", "grpo_skip", "dppo"), (0,))
    assert result["ceiling"]["grpo_skip"]["dppo"]["speedup"] is None
    assert "no group log" in result["ceiling"]["grpo_skip"]["dppo"]["why_not"]


def test_a_bench_without_grpo_is_relative_to_grpo_skip(tmp_path):
    """grpo_skip has grpo's gradient, so a bench may leave grpo's slower runs out: the target and the first
    speedups are then relative to grpo_skip, and the tables say so."""
    for method, metrics, groups, accs in (("grpo_skip", BASE_METRICS, BASE_GROUPS, (0.4, 0.5, 0.6)),
                                          ("dppo", METHOD_METRICS, METHOD_GROUPS, (0.4, 0.6, 0.6))):
        d = bench.run_dir(tmp_path, method, 0)
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"machine": "m", "elapsed_s": 1.0}))
        (d / "config.json").write_text(json.dumps({"seed": 0, "output_dir": str(d)}))
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        (d / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
        (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "sampled_accuracy": a}) + "\n"
                                              for s, a in zip((0, 1, 2), accs, strict=True)))
    result = bench.summarize_bench(tmp_path, "mine", ("grpo_skip", "dppo"), (0,))
    assert result["reference"] == "grpo_skip" and "speedup_vs_grpo" not in result
    assert result["target_accuracy"] == pytest.approx(0.95 * 0.6)
    assert result["speedup_vs_grpo_skip"]["dppo"]["time_to_target"] == pytest.approx(2.75 / 1.8275)
    assert result["ceiling"]["grpo_skip"]["dppo"]["speedup"] == pytest.approx(CEILING)
    assert "of grpo_skip's final accuracy" in bench.format_markdown(result)
    assert "speedup over grpo_skip" in bench.format_table(result)
    assert bench.reference_method(["dppo", "grpo_skip", "grpo"]) == "grpo"


# --- synthetic runs whose ceiling is known by hand, written through the trainer's own writers (issue #52) ----------
# Two groups of G = 2 per baseline step. Rollout s = 0.5 + 0.01 x generated tokens and update s = 0.25 + 0.02 x
# trained tokens exactly, for the baseline and the method alike (R² 1: the affine model); the rest of a step
# (reward, pack, gaps) differs from step to step: 0.1, 0.3, 0.2, 0.2 s for the baseline (mean 0.2), 0.05 s for the
# method. Seed 1's steps 2 and 4 have no informative group (all-equal rewards, some outside [0, 1]); seed 2's step 2
# has one, with continuous rewards.
BASE_STEPS = {  # step: (rewards, lengths, tokens trained, the rest of the step in s)
    1: ([[1, 0], [1, 1]], [[10, 30], [20, 20]], 40, 0.1),     # informative tokens 40 of 80
    2: ([[0, 0], [2, 2]], [[15, 25], [10, 30]], 0, 0.3),      # none of 80
    3: ([[0, 1], [-1, 2]], [[20, 20], [30, 30]], 100, 0.2),   # all 100
    4: ([[3.7, 3.7], [1, 1]], [[40, 40], [20, 40]], 0, 0.2),  # none of 140
}
SEED2_STEP2 = [[0.6, 0.9], [2, 2]]  # seed 2's step 2: its first group informative (40 tokens)
# the method trains half its informative tokens (kappa = (40 + 30) / (80 + 60) = 0.5); its step 4 pruned every
# prompt (skipped: no group line, and no part in the fits or kappa)
METHOD_STEPS = {1: ([[1, 0]], [[30, 50]], 40, 0.05), 2: ([[1, 1], [0, 1]], [[5, 5], [20, 40]], 30, 0.05),
                3: ([[0, 0]], [[10, 10]], 0, 0.05)}


def _oracle(n):  # the oracle's step with n informative tokens: 0.2 s of the rest only when n = 0
    return (0.5 + 0.01 * n + 0.25 + 0.02 * 0.5 * n if n else 0.0) + 0.2


BASE_TIMES = [2.45, 1.85, 3.95, 2.35]  # 0.5 + 0.01 gen + 0.25 + 0.02 trained + the rest, per step: 10.6 s in all
ORACLE = {1: [_oracle(40), _oracle(0), _oracle(100), _oracle(0)],   # 1.75, 0.2, 2.95, 0.2: 5.1 s
          2: [_oracle(40), _oracle(40), _oracle(100), _oracle(0)]}  # 1.75, 1.75, 2.95, 0.2: 6.65 s
TARGETS = {"0.90": 0.54, "0.95": 0.57}
CURVES = {  # the baseline's accuracy at the end of each step (training time: the cumulative step times)
    1: [0.3, 0.5, 0.5, 0.6, 0.6],    # reaches 0.54 at 4.3 + 0.4 x 3.95 s, 0.57 at 4.3 + 0.7 x 3.95 s (in step 3)
    2: [0.3, 0.44, 0.56, 0.55, 0.56]}  # reaches 0.54 at 2.45 + 5/6 x 1.85 s (in step 2), never 0.57
MEASURED = {"0.90": 1.5, "0.95": 1.25}  # the method's measured time-to-target speedups (given to ceilings())


def _write_run(root, method, seed, steps, pi):
    """metrics.jsonl by hand; groups.jsonl as the trainer writes it: group_record of float32 rewards and int lengths
    (a (P, G) tensor each, as after gather_groups), appended line by line with checkpoint.append_jsonl."""
    d = bench.run_dir(root, method, seed)
    d.mkdir(parents=True)
    records, lines = [], []
    for step, (rewards, lengths, trained, rest) in steps.items():
        generated = sum(map(sum, lengths))
        rollout, update = 0.5 + 0.01 * generated, 0.25 + 0.02 * trained
        lines.append({"step": step, "tokens_generated": generated, "tokens_trained": trained, "time_rollout": rollout,
                      "time_update": update, "step_time": rollout + update + rest})
        records.append(grouplog.group_record(step, 2 * len(rewards), [f"q{step}-{i}" for i in range(len(rewards))],
                                             torch.full((len(rewards),), pi, dtype=torch.float64),
                                             torch.tensor(rewards, dtype=torch.float32), torch.tensor(lengths)))
        append_jsonl(d / grouplog.FILENAME, records[-1])
    if method == "dppo":  # a skipped step: every candidate pruned, nothing rolled out, so no group line
        lines.append({"step": 4, "skipped": 1, "tokens_generated": 0, "tokens_trained": 0, "time_rollout": 0.0,
                      "time_update": 0.0, "step_time": 0.01})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return d, records


def _synthetic_bench(root):
    """grpo_skip (the baseline) and dppo, seeds 1 and 2; returns ceilings()'s arguments after the directories."""
    runs = {"grpo_skip": [], "dppo": []}
    for seed in (1, 2):
        base = dict(BASE_STEPS)
        if seed == 2:
            base[2] = (SEED2_STEP2, *BASE_STEPS[2][1:])
        _write_run(root, "grpo_skip", seed, base, 1.0)
        _write_run(root, "dppo", seed, METHOD_STEPS, 0.5)
        clock = [0.0, *(sum(BASE_TIMES[:k]) for k in range(1, 5))]
        points = zip(range(5), clock, CURVES[seed], strict=True)
        runs["grpo_skip"].append({"seed": seed, "curve": [{"step": s, "train_s": t, "sampled_accuracy": a}
                                                          for s, t, a in points]})
        runs["dppo"].append({"seed": seed, "curve": []})
    speedups = {"grpo_skip": {"dppo": {"by_target": {f: {"target": t, "time_to_target": MEASURED[f]}
                                                     for f, t in TARGETS.items()}}}}
    return runs, ["grpo_skip"], speedups


def _check_the_synthetic_ceiling(root):
    result = ceiling.ceilings(root, root, *_synthetic_bench(root))["grpo_skip"]["dppo"]
    whole = [10.6 / sum(ORACLE[1]), 10.6 / sum(ORACLE[2])]  # 10.6 / 5.1 and 10.6 / 6.65
    assert result["per_seed"] == [pytest.approx(w, rel=1e-9) for w in whole]
    assert result["speedup"] == pytest.approx(sum(whole) / 2, rel=1e-9)
    assert result["kappa"] == pytest.approx(0.5, rel=1e-9)
    assert result["informative_token_share"] == pytest.approx((140 / 400 + 180 / 400) / 2, rel=1e-9)
    for seed in result["seeds"]:
        assert seed["baseline_s"] == pytest.approx(10.6, rel=1e-9) and seed["other_s_per_step"] == pytest.approx(0.2)
        assert (seed["rollout_fit"]["model"], seed["update_fit"]["model"]) == ("decode-aware", "affine")
        assert (seed["rollout_fit"]["c0"], seed["rollout_fit"]["c_tokens"]) == (pytest.approx(0.5), pytest.approx(0.01))
        assert seed["rollout_fit"]["c_longest"] == pytest.approx(0.0, abs=1e-9)
        assert (seed["update_fit"]["a"], seed["update_fit"]["b"]) == (pytest.approx(0.25), pytest.approx(0.02))
    # per target: up to the baseline's time to it, the step in progress counted in proportion
    o1, o2 = ORACLE[1], ORACLE[2]
    seed1_90 = (4.3 + 0.4 * 3.95) / (o1[0] + o1[1] + 0.4 * o1[2])
    seed1_95 = (4.3 + 0.7 * 3.95) / (o1[0] + o1[1] + 0.7 * o1[2])
    seed2_90 = (2.45 + 5 / 6 * 1.85) / (o2[0] + 5 / 6 * o2[1])
    assert [s["by_time"]["0.90"] for s in result["seeds"]] == [pytest.approx(seed1_90), pytest.approx(seed2_90)]
    assert [s["by_time"]["0.95"] for s in result["seeds"]] == [pytest.approx(seed1_95), None]  # seed 2: never
    c90, c95 = (seed1_90 + seed2_90) / 2, seed1_95
    assert result["by_target"] == {
        "0.90": {"ceiling": pytest.approx(c90, rel=1e-9), "n": 2, "fraction_reached": pytest.approx(1.5 / c90)},
        "0.95": {"ceiling": pytest.approx(c95, rel=1e-9), "n": 1, "fraction_reached": pytest.approx(1.25 / c95)}}
    assert result["fraction_reached"] == {"0.90": pytest.approx(1.5 / c90), "0.95": pytest.approx(1.25 / c95)}


def test_the_ceiling_of_synthetic_runs_with_empty_steps_and_uneven_step_costs(tmp_path):
    """Steps with no informative group pay only the baseline's rest of a step; the baseline's own, uneven step
    costs place its time to each target; the whole run per seed, per target, fraction reached: all by hand."""
    _check_the_synthetic_ceiling(tmp_path)


def _check_the_group_log_round_trip(root):
    base = dict(BASE_STEPS)
    base[2] = (SEED2_STEP2, *BASE_STEPS[2][1:])
    d, written = _write_run(root, "grpo_skip", 2, base, 1.0)
    back = grouplog.read_groups(d)
    assert back == written  # JSON keeps every field as group_record made it
    assert [g["step"] for g in back] == [1, 2, 3, 4] and [g["window"] for g in back] == [4] * 4
    assert [g["rewards"] for g in back] == [base[s][0] for s in (1, 2, 3, 4)]  # 3.7 and 0.6 of float32, -1, 2
    assert [g["lengths"] for g in back] == [base[s][1] for s in (1, 2, 3, 4)]
    assert [[grouplog.informative(r) for r in g["rewards"]] for g in back] == [
        [True, False], [True, False], [True, True], [False, False]]  # step 4: no informative group
    assert ceiling.informative_tokens(back) == {1: 40, 2: 40, 3: 100, 4: 0}


def test_the_group_log_round_trips_rewards_outside_the_unit_interval_and_empty_steps(tmp_path):
    _check_the_group_log_round_trip(tmp_path)


COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
#: the committed benches with a ceiling (their runs' group logs are committed with them)
COMMITTED_CEILINGS = ("cpu-batch8", "cpu-own-best", "realistic-pool/comparison")


def _close(got, want, where="ceiling"):
    """Equal, numbers to 1e-9 relative (the least-squares fits need not agree to the last bit across CPUs)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    else:
        assert got == want, where


def _check_the_committed_ceiling(name, committed):
    d = COMMITTED / name
    runs = {}
    for r in committed["runs"]:
        runs.setdefault(r["method"], []).append(r)
    recomputed = ceiling.ceilings(d, d, runs, list(committed["ceiling"]), committed["speedup_vs"])
    _close(json.loads(json.dumps(recomputed)), committed["ceiling"])


@pytest.mark.parametrize("name", COMMITTED_CEILINGS)
def test_the_committed_ceiling_is_computed_from_its_committed_runs(name):
    """Every number of a committed bench.json's ceiling (per seed, per target, fraction reached, the fits) is what
    the ceiling code computes now from the bench's committed metrics.jsonl and groups.jsonl and its curves. A
    deliberate change to the ceiling's model means summarizing those benches again (``dppo bench --summarize`` with
    their command) and updating the figures the documentation quotes."""
    committed = json.loads((COMMITTED / name / "bench.json").read_text())
    assert committed["ceiling"]["grpo_skip"]["dppo"]["speedup"] is not None and "times_from" not in committed
    _check_the_committed_ceiling(name, committed)


def test_the_documentation_quotes_the_committed_ceiling():
    """README.md and docs/benchmarks.md quote the equal-batch ceiling (cpu-batch8) and the fraction reached."""
    c = json.loads((COMMITTED / "cpu-batch8" / "bench.json").read_text())["ceiling"]["grpo_skip"]["dppo"]
    (c90, c95), (f90, f95) = ([c["by_target"][f][k] for f in ("0.90", "0.95")] for k in ("ceiling", "fraction_reached"))
    root = COMMITTED.parents[1]
    readme, docs = (" ".join(re.sub(r"^> ?", "", (root / p).read_text(), flags=re.M).split())
                    for p in ("README.md", "docs/benchmarks.md"))
    assert (f"would be {c90:.2f}x / {c95:.2f}x sooner to the two targets at 8 prompts; DPPO reaches {f90:.0%} and "
            f"{f95:.0%} of that") in readme
    assert f"{f90:.0%} / {f95:.0%} of the ceiling of pruning there ({c90:.2f}x / {c95:.2f}x)" in docs
    assert f"is {c90:.2f}x to 90% and {c95:.2f}x to 95%" in docs
    assert f"DPPO reaches {f90:.0%} and {f95:.0%} of it" in docs


# --- each check above fails on a deliberately wrong line (tests/helpers/mutants.py) --------------------------------


@pytest.mark.parametrize("mutant", list(CEILING_MUTANTS), ids=repr)
def test_ceiling_mutants_are_caught(tmp_path, monkeypatch, mutant):
    mutant.install(monkeypatch)
    with pytest.raises(AssertionError):
        if CEILING_MUTANTS[mutant] == "synthetic":
            _check_the_synthetic_ceiling(tmp_path)
        else:
            for name in COMMITTED_CEILINGS:
                _check_the_committed_ceiling(name, json.loads((COMMITTED / name / "bench.json").read_text()))


def test_a_committed_ceiling_lowered_by_5_percent_is_caught():
    committed = json.loads((COMMITTED / "cpu-batch8" / "bench.json").read_text())
    with pytest.raises(AssertionError, match=r"per_seed\[0\]"):
        _check_the_committed_ceiling("cpu-batch8", lower_committed_ceiling(committed))


@pytest.mark.parametrize("mutant", list(GROUPLOG_MUTANTS), ids=repr)
def test_group_log_mutants_are_caught(tmp_path, monkeypatch, mutant):
    assert GROUPLOG_MUTANTS[mutant] == "round_trip"
    mutant.install(monkeypatch)
    with pytest.raises(AssertionError):
        _check_the_group_log_round_trip(tmp_path)
