"""The batch-matched baseline (issue #63): a method that rolls out fewer prompts per step than the preset
(``dppo_budget``, ``grpo_half``) is compared with ``grpo_skip`` given exactly as many, so that a smaller batch's gain is
not credited to the method. Its configuration, the bench's refusal to run such a method without it, the check from
the logs that the two rolled out alike, and the speedups and tables that report against it."""

from __future__ import annotations

import json

import pytest

from dppo_core.config import DPPOConfig
from dppo_core.tools import bench
from dppo_core.tools.bench import BENCH_PRESETS, BenchError, method_config, method_settings
from dppo_core.tools.bench.tables import format_markdown, format_table


def test_the_matched_baseline_is_grpo_skip_at_dppo_budgets_rolled_out_count(tmp_path):
    preset = BENCH_PRESETS["cpu-realistic"]
    skip, matched = (method_config(preset, m, 3, tmp_path) for m in ("grpo_skip", "grpo_skip_matched"))
    budget = method_config(preset, "dppo_budget", 3, tmp_path)
    assert budget.prompts_per_step == 32 and budget.prompt_prune_rate == 0.5 and not budget.dense_prompts
    assert budget.fixed_size_sampling  # so it rolls out exactly 16 every step
    assert matched.with_overrides({"prompts_per_step": 32, "output_dir": skip.output_dir}) == skip
    assert matched.prompts_per_step == 16 == bench.matched_prompts_per_step(budget)
    assert method_settings(preset, "grpo_skip_matched")["prompts_per_step"] == 16  # what bench.json records
    # it follows dppo_budget's rate and the shared batch; its own override wins
    assert method_config(preset, "grpo_skip_matched", 3, tmp_path,
                         ["dppo_budget.prompt_prune_rate=0.75"]).prompts_per_step == 8
    assert method_config(preset, "grpo_skip_matched", 3, tmp_path, ["prompts_per_step=8"]).prompts_per_step == 4
    assert method_config(preset, "grpo_skip_matched", 3, tmp_path,
                         ["grpo_skip_matched.prompts_per_step=5"]).prompts_per_step == 5


def test_rolled_out_count_of_a_configuration():
    base = DPPOConfig().with_overrides({"prompts_per_step": 32})
    assert bench.matched_prompts_per_step(base) == 32  # no pruning
    budget = base.with_overrides({"pruning": "dppo", "prompt_prune_rate": 0.5, "dense_prompts": False})
    assert bench.matched_prompts_per_step(budget) == 16
    assert bench.matched_prompts_per_step(budget.with_overrides({"prompt_prune_rate": 0.3})) == 22  # round(22.4)
    assert bench.matched_prompts_per_step(budget.with_overrides({"dense_prompts": True})) == 32  # the batch kept full
    assert bench.matched_prompts_per_step(budget.with_overrides({"prompt_prune_rate": 0.99})) == 1


def test_a_rollout_budget_without_its_matched_baseline_is_refused_before_any_run(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(BenchError, match="grpo_skip_matched"):
        bench.run_bench("cpu-smoke", out, methods=["grpo_skip", "dppo_budget"], seeds=[0])
    with pytest.raises(BenchError, match="grpo_half.*grpo_skip_matched"):
        bench.run_bench("cpu-smoke", out, methods=["grpo", "grpo_half"], seeds=[0])
    assert not out.exists()
    bench.check_batch_matched_methods(["grpo_skip", "dppo"])  # dense prompts: the full batch, nothing to match
    bench.check_batch_matched_methods(["grpo_skip", "grpo_skip_matched", "dppo_budget"])


def _write_run(root, method, seed, prompts, step_time, accs):
    d = bench.run_dir(root, method, seed)
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"machine": "m", "elapsed_s": 1.0}))
    (d / "config.json").write_text(json.dumps({"seed": seed, "output_dir": str(d)}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time": step_time, "prompts_rolled_out":
                                                         prompts}) + "\n" for s in range(1, 5)))
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": 2 * k, "sampled_accuracy": a}) + "\n"
                                          for k, a in enumerate(accs)))


def test_speedups_of_a_rollout_budget_are_reported_against_its_matched_baseline(tmp_path):
    """Hand-made logs: grpo_skip at 32 prompts is slow, the matched baseline and dppo_budget at 16 are fast. Against
    grpo_skip dppo_budget looks 2x faster; against the matched baseline, which learns alike at the same cost, 1x."""
    for seed in (0, 1):
        _write_run(tmp_path, "grpo_skip", seed, 32, 10.0, (0.40, 0.50, 0.60))  # evaluations at 0, 20 and 40 s
        _write_run(tmp_path, "grpo_skip_matched", seed, 16, 5.0, (0.40, 0.50, 0.60))  # at 0, 10 and 20 s
        _write_run(tmp_path, "dppo_budget", seed, 16, 5.0, (0.40, 0.50, 0.60))
        _write_run(tmp_path, "dppo", seed, 32, 8.0, (0.40, 0.55, 0.60))
    methods = ("grpo_skip", "grpo_skip_matched", "dppo_budget", "dppo")
    result = bench.summarize_bench(tmp_path, "mine", methods, (0, 1))
    assert result["batch_matched"] == {"dppo_budget": "grpo_skip_matched"}
    vs = result["speedup_vs"]
    assert vs["grpo_skip"]["dppo_budget"]["by_target"]["0.95"]["time_to_target"] == pytest.approx(2.0)
    # against the matched baseline only the methods matched to it; dense dppo rolls out the full batch
    assert set(vs["grpo_skip_matched"]) == {"grpo_skip_matched", "dppo_budget"}
    assert vs["grpo_skip_matched"]["dppo_budget"]["by_target"]["0.95"]["time_to_target"] == pytest.approx(1.0)
    assert result["speedup_intervals"]["grpo_skip_matched"]["dppo_budget"]["wall"]["mean"] == pytest.approx(1.0)
    sweep = result["target_sweep"]["grpo_skip_matched"]["dppo_budget"]["by_target"]
    assert list(sweep) == ["0.80", "0.85", "0.90", "0.92", "0.95", "0.97"]
    # each target is that fraction of the matched baseline's final 0.60; identical curves reach each alike
    assert all(e["time_to_target"] == pytest.approx(1.0) and e["n"] == 2 for e in sweep.values())
    assert sweep["0.80"]["target"] == pytest.approx(0.48)
    text = format_markdown(result)
    assert "| `dppo_budget` * |" in text and "| `dppo` * |" not in text  # flagged where it is not batch-matched
    assert "batch-matched baseline (`grpo_skip_matched`)" in text and "| 80% | 85% | 90% | 92% | 95% | 97% |" in text
    assert "against its batch-matched grpo_skip_matched" in format_table(result)


def test_a_pair_that_did_not_roll_out_alike_is_an_error_naming_both(tmp_path):
    _write_run(tmp_path, "grpo_skip", 0, 32, 10.0, (0.40, 0.60))
    _write_run(tmp_path, "grpo_skip_matched", 0, 32, 10.0, (0.40, 0.60))  # e.g. set to the full batch by hand
    _write_run(tmp_path, "dppo_budget", 0, 16, 5.0, (0.40, 0.60))
    with pytest.raises(BenchError, match=r"dppo_budget rolled out 16\.0 .* grpo_skip_matched 32\.0"):
        bench.summarize_bench(tmp_path, "mine", ("grpo_skip", "grpo_skip_matched", "dppo_budget"), (0,))
