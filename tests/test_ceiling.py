"""The group log (dppo_core.grouplog) and the ceiling of pruning (dppo_core.tools.bench.ceiling), on synthetic logs
whose answer is computed by hand."""

import json

import pytest
import torch

from dppo_core.grouplog import group_record, informative, read_groups
from dppo_core.tools import bench
from dppo_core.tools.bench.ceiling import cost_fit, linear_fit, oracle_ceiling


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
    assert (c["rollout_fit"]["a"], c["rollout_fit"]["b"]) == (pytest.approx(0.1), pytest.approx(0.01))
    assert (c["update_fit"]["a"], c["update_fit"]["b"]) == (pytest.approx(0.2), pytest.approx(0.01))
    assert c["informative_token_share"] == pytest.approx(80 / 160)


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
