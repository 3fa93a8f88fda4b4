"""The bench's figures read (issue #67): one colour per method in every figure, titles that name the run, legends
that name the batch sizes, a phase chart whose method names do not overlap. On a small bench.json built here (no
training) and, where the repository has them, on the committed results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.colors import to_rgb

from dppo_core.tools.bench.plots import METHOD_STYLES, PHASE_COLOURS, method_label, plot_bench, run_title
from dppo_core.tools.bench.presets import METHODS, PHASES

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_every_method_and_phase_has_its_own_colour():
    assert set(METHOD_STYLES) == set(METHODS) and set(PHASE_COLOURS) == set(PHASES)
    colours = [to_rgb(c) for c, _ in METHOD_STYLES.values()]
    assert len(set(colours)) == len(colours), "two methods share a colour"
    assert not set(colours) & {to_rgb(c) for c in PHASE_COLOURS.values()}


def small_result(methods: dict[str, int]) -> dict:
    curve = [{"step": s, "train_s": 10.0 * s, "sampled_accuracy": 0.4 + 0.01 * s, "sampled_std": 0.01}
             for s in (0, 5, 10)]
    return {"preset": "cpu-baselines", "seeds": [1, 2], "target_accuracy": 0.47, "reference": "grpo_skip",
            "configs": {m: {"prompts_per_step": n} for m, n in methods.items()},
            "methods": {m: {"curve": curve, "steps": 10, "phase_s": {p: 1.0 for p in PHASES}} for m in methods}}


def test_titles_name_the_run_and_legends_the_batch(tmp_path):
    result = small_result({"grpo_skip": 8, "dppo": 32})
    result["methods"]["dppo"]["prompts_rolled_out"] = 16.0  # what the logs say it rolled out wins over the config
    assert run_title(result, tmp_path / "cpu-own-best") == "cpu-own-best (dppo bench --preset cpu-baselines)"
    assert run_title(result, tmp_path / "cpu-baselines") == "dppo bench cpu-baselines"
    assert method_label(result, "grpo_skip") == "grpo_skip (batch 8)"
    assert method_label(result, "dppo") == "dppo (16 prompts/step)"
    # a bench from before prompts_rolled_out was kept: the config's batch, and what a rollout budget rolls out of it
    old = {**result, "methods": {m: {k: v for k, v in a.items() if k != "prompts_rolled_out"}
                                 for m, a in result["methods"].items()},
           "configs": {"dppo": {"prompts_per_step": 32, "pruning": "dppo", "prompt_prune_rate": 0.5,
                                "dense_prompts": False}}}
    assert method_label(old, "dppo") == "dppo (batch 32, about 16 rolled out)"
    assert method_label(old, "grpo_skip") == "grpo_skip"
    out = tmp_path / "cpu-own-best"
    out.mkdir()
    written = plot_bench(result, out)
    assert [p.name for p in written] == ["accuracy_vs_step.png", "accuracy_vs_time.png", "phases.png"]
    assert all(p.stat().st_size > 5000 for p in written)


def test_the_phase_chart_grows_with_the_methods(tmp_path):
    """Seven methods' names on a horizontal chart: the figure is tall enough for each its own row."""
    from matplotlib.image import imread

    few, many = tmp_path / "few", tmp_path / "many"
    few.mkdir(), many.mkdir()
    plot_bench(small_result({"grpo_skip": 32, "dppo": 32}), few)
    plot_bench(small_result({m: 32 for m in METHODS[:7]}), many)
    assert imread(many / "phases.png").shape[0] > 1.5 * imread(few / "phases.png").shape[0]


@pytest.mark.skipif(not (RESULTS / "cpu-own-best" / "bench.json").exists(), reason="no committed bench results")
def test_the_headline_figure_names_its_run_and_batches(tmp_path):
    result = json.loads((RESULTS / "cpu-own-best" / "bench.json").read_text())
    assert run_title(result, RESULTS / "cpu-own-best").startswith("cpu-own-best")
    assert [method_label(result, m) for m in result["methods"]] in (
        ["grpo_skip (8 prompts/step)", "dppo (32 prompts/step)"], ["grpo_skip (batch 8)", "dppo (batch 32)"])
