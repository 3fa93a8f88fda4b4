"""The committed results say what the documentation (README.md, docs/training.md, docs/benchmarks.md) says they say.

These tests read files under benchmarks/results (no model, no training): the learning curves of the
tiny-grpo preset over three seeds must show what the project promises of its embedded setting (see
benchmarks/grpo_tiny.py for the command that makes them), and be made with the preset as it is now.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dppo_core.config import DPPOConfig, preset

CURVES = Path(__file__).resolve().parents[2] / "benchmarks/results/tiny-grpo/curves-kl-0.04"
SEEDS = (0, 1, 2)
#: What a curve run overrides on top of the preset (benchmarks/grpo_tiny.py: CURVE_OVERRIDES and --set).
RUN_FIELDS = {"seed", "output_dir", "eval_steps", "eval_levels"}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", params=SEEDS, ids=[f"seed-{s}" for s in SEEDS])
def run(request):
    d = CURVES / f"seed-{request.param}"
    return {"config": json.loads((d / "config.json").read_text()), "evals": _read_jsonl(d / "eval.jsonl"),
            "metrics": _read_jsonl(d / "metrics.jsonl"), "seed": request.param}


def test_each_seed_ran_the_preset_as_it_is_now(run):
    current = json.loads(json.dumps(preset("tiny-grpo").to_dict()))  # tuples as JSON lists
    # a field added since the run takes its default there: the run behaved as the default does
    defaults = json.loads(json.dumps(DPPOConfig().to_dict()))
    differ = {k for k in current if run["config"].get(k, defaults[k]) != current[k]}
    assert differ <= RUN_FIELDS, f"rerun the curves: the preset changed in {sorted(differ - RUN_FIELDS)}"
    assert run["config"]["seed"] == run["seed"]
    assert run["config"]["eval_levels"] == [1, 2, 3, 4, 5]  # the untrained level 1 is watched too


def test_grpo_lifts_sampled_accuracy_by_15_points_within_10_minutes(run):
    first, last = run["evals"][0], run["evals"][-1]
    assert first["step"] == 0 and last["step"] == run["config"]["max_steps"]
    train_s = sum(m["step_time"] for m in run["metrics"])
    assert train_s <= 600, f"{train_s / 60:.1f} min of training"
    gain = last["sampled_accuracy"] - first["sampled_accuracy"]  # over the trained levels, 2-5
    assert gain >= 0.15, f"+{100 * gain:.1f} points"


def test_no_level_loses_more_greedy_accuracy_than_its_standard_error(run):
    first, last = run["evals"][0], run["evals"][-1]
    for level in (1, 2, 3, 4, 5):
        drop = first[f"greedy_L{level}"] - last[f"greedy_L{level}"]
        assert drop <= first[f"greedy_L{level}_stderr"], f"level {level}: greedy accuracy fell by {drop:.3f}"


def test_the_zero_signal_share_at_the_start_of_rl_is_logged(run):
    share = run["metrics"][0]["zero_std_groups"]
    assert 0 < share < 1  # some groups all right or all wrong, most with signal: what prompt pruning works with


ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_every_committed_result_says_what_made_it():
    """benchmarks/README.md ("Where each result came from") names every entry of benchmarks/results with its
    command, commit, machine and warm start; the archive has a README of its own."""
    table = (ROOT / "benchmarks" / "README.md").read_text().split("## Where each result came from", 1)[1]
    for entry in sorted(RESULTS.iterdir()):
        name = entry.stem.split(".")[0] if entry.is_file() else entry.name
        assert f"`results/{name}" in table, f"benchmarks/README.md does not say what made results/{entry.name}"
    assert (RESULTS / "archive" / "README.md").is_file()


#: The benches README.md's Results section quotes: the equal-tuning comparisons (each method at its own tuned batch,
#: and both at the strong GRPO's tuned batch), the 32-prompt one they were tuned against, and the prompt stage on
#: the pool shaped like real data.
HEADLINE_BENCHES = ("cpu-own-best", "cpu-batch8", "cpu-baselines", "cpu-realistic", "cpu-realistic-matched",
                    "cpu-persist-50", "cpu-persist-70", "cpu-persist-85", "cpu-persist-70-filter")
#: Around benchmarks/smollm2_realistic.py's tables in docs/benchmarks.md and the comparison's results README.
SMOLLM2_MARKERS = ("<!-- smollm2_realistic.py --markdown -->", "<!-- end of smollm2_realistic.py --markdown -->")


def _generated_figures() -> list[str]:
    """Speedups with intervals in the generated summaries the README also quotes: the offline filter at the
    persistence map's 0.96 point (benchmarks/persistence_map.py's point.json) and the pilot against `dppo`
    (benchmarks/pilot_summary.py's pilot_summary.json), as `1.23x [1.00, 1.45]`."""
    import itertools
    from decimal import ROUND_HALF_UP, Decimal

    def two(x: float) -> set[str]:  # the summaries keep 3 decimals, so 0.565 was 0.56 or 0.57 at full precision
        return {f"{x:.2f}", str(Decimal(str(x)).quantize(Decimal("0.01"), ROUND_HALF_UP))}

    def cell(x: float, ci: list[float]) -> str:
        return " ".join(f"{a}x [{b}, {c}]" for a, b, c in itertools.product(two(x), two(ci[0]), two(ci[1])))

    point = json.loads((RESULTS / "persistence-map/persist-70-filter/point.json").read_text())["points"][0]
    out = [cell(e["speedup"], e["ci95"]) for against in point["measured"]["others"]["grpo_skip_filtered"].values()
           for f, e in against.items() if f in ("0.50", "0.75")]
    pilot = json.loads((RESULTS / "pilot/realistic/pilot_summary.json").read_text())["pilot_vs_dppo"]["by_target"]
    return out + [cell(e["time_to_target"], e["ci95"]) for e in pilot.values()]


def test_the_readme_headline_is_the_committed_equal_tuning_tables():
    """Every speedup with an interval in README.md's Results section is in one of docs/benchmarks.md's marked tables
    of HEADLINE_BENCHES, which test_bench.py keeps equal to their bench.json, or in a generated summary
    (:func:`_generated_figures`); each bench's command and the figure named."""
    readme = (ROOT / "README.md").read_text()
    results = " ".join(readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0].split())
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = [docs.split(f"<!-- bench:{n}:start -->")[1].split(f"<!-- bench:{n}:end -->")[0] for n in HEADLINE_BENCHES]
    tables.append(docs.split(SMOLLM2_MARKERS[0])[1].split(SMOLLM2_MARKERS[1])[0])  # the real model's, below
    tables.append(" ".join(_generated_figures()))  # the offline filter's and the pilot's, from their summaries
    quoted = re.findall(r"\d+\.\d+x \[\d+\.\d+, \d+\.\d+\]", results)
    assert len(quoted) >= 2, results
    assert [q for q in quoted if not any(q in t for t in tables)] == [], \
        "README.md quotes figures the committed tables do not hold"
    for name in HEADLINE_BENCHES[:2]:
        command = json.loads((RESULTS / name / "bench.json").read_text())["command"]
        assert f"`{command}`" in results, f"README.md's Results section does not give {name}'s command"
    assert "](benchmarks/results/cpu-own-best/accuracy_vs_time.png)" in results


def test_the_batch_matched_tables_are_generated_from_their_bench_json():
    """The batch-matched cpu-realistic rerun (issue #63): docs/benchmarks.md's and the results README's marked tables
    are format_markdown of its committed bench.json; every rollout-budget speedup is there against
    grpo_skip_matched, and the README's correction quotes both that and the figure it corrects."""
    from dppo_core.tools.bench import README_MARKERS, format_markdown

    result = json.loads((RESULTS / "realistic-pool/matched/bench.json").read_text())
    assert result["batch_matched"] == {"dppo_budget": "grpo_skip_matched"} and len(result["seeds"]) >= 8
    assert {m: a["prompts_rolled_out"] for m, a in result["methods"].items()} == {
        "grpo_skip": 32.0, "grpo_skip_matched": 16.0, "dppo": 32.0, "dppo_budget": 16.0}
    start, end = (m.format(preset="cpu-realistic-matched") for m in README_MARKERS)
    for doc in (ROOT / "docs/benchmarks.md", RESULTS / "realistic-pool/README.md"):
        table = doc.read_text().split(start)[1].split(end)[0]
        assert table.strip() == format_markdown(result, result["command"]), doc
    vs = result["speedup_vs"]["grpo_skip_matched"]["dppo_budget"]["by_target"]
    said = [f"{e['time_to_target']:.2f}x [{e['ci95'][0]:.2f}, {e['ci95'][1]:.2f}]" for e in (vs["0.90"], vs["0.95"])]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert all(x in readme for x in said) and "1.46x [1.13, 1.72]" in readme and "A correction" in readme


def test_the_persistence_map_is_its_committed_benches():
    """The persistence map (issue #63): the cpu-persist-70, -50, -85 and second -70 (seeds 6-10, with the offline
    filter) tables of docs/benchmarks.md and of the
    map's README are format_markdown of their committed bench.json; map.json's figures of each
    point are its bench's, ordered by persistence, with a prediction and its error; the README says against which
    baselines the gain holds."""
    from dppo_core.tools.bench import README_MARKERS, format_markdown

    folder = RESULTS / "persistence-map"
    result = json.loads((folder / "persist-70/bench.json").read_text())
    assert result["batch_matched"] == {"dppo_budget": "grpo_skip_matched"} and len(result["seeds"]) >= 5
    start, end = (m.format(preset="cpu-persist-70") for m in README_MARKERS)
    for doc in (ROOT / "docs/benchmarks.md", folder / "README.md"):
        assert doc.read_text().split(start)[1].split(end)[0].strip() == format_markdown(result, result["command"]), doc
    for share in ("50", "85", "70-filter"):
        other = json.loads((folder / f"persist-{share}/bench.json").read_text())
        start, end = (m.format(preset=f"cpu-persist-{share}") for m in README_MARKERS)
        for doc in (ROOT / "docs/benchmarks.md", folder / "README.md"):
            table = doc.read_text().split(start)[1].split(end)[0].strip()
            assert table == format_markdown(other, other["command"]), doc
    points = json.loads((folder / "map.json").read_text())["points"]
    assert [p["preset"] for p in points] == ["cpu-realistic", "cpu-persist-50", "cpu-persist-70", "cpu-persist-85"]
    assert [p["p_equal_after_equal"] for p in points] == sorted(p["p_equal_after_equal"] for p in points)
    benches = {"cpu-realistic": RESULTS / "realistic-pool/matched", "cpu-persist-50": folder / "persist-50",
               "cpu-persist-70": folder / "persist-70", "cpu-persist-85": folder / "persist-85"}
    for p in points:
        bench = json.loads((benches[p["preset"]] / "bench.json").read_text())
        vs = bench["speedup_vs"]["grpo_skip_matched"]["dppo_budget"]["by_target"]
        assert {t: e["time_to_target"] for t, e in p["measured"]["of_final"].items()} == {
            t: e["time_to_target"] for t, e in vs.items()}
        assert p["predicted"]["time_speedup"] > 0 and set(p["error"]) == {"0.50", "0.75"}
    again = json.loads((folder / "persist-70-filter/bench.json").read_text())
    point = json.loads((folder / "persist-70-filter/point.json").read_text())["points"][0]
    vs = again["speedup_vs"]["grpo_skip_matched"]["dppo_budget"]["by_target"]
    assert {t: e["time_to_target"] for t, e in point["measured"]["of_final"].items()} == {
        t: e["time_to_target"] for t, e in vs.items()}
    assert set(again["seeds"]).isdisjoint(result["seeds"]) and "grpo_skip_filtered" in point["measured"]["others"]
    assert point["offline_filter"]["seeds"] == len(again["seeds"])
    pool = json.loads((folder / "persist-70-filter/pooled.json").read_text())  # persistence_map.py --pool
    assert pool["seeds"] == sorted(result["seeds"] + again["seeds"])
    said = " ".join((folder / "README.md").read_text().split())
    for base in ("grpo_skip_matched", "grpo_skip"):
        for e in pool[base].values():
            assert f"{e['geomean']:.2f}x [{e['t_ci95'][0]:.2f}, {e['t_ci95'][1]:.2f}]" in said, (base, e)
    readme = " ".join((ROOT / "README.md").read_text().split())
    vs = result["speedup_vs"]
    for base in ("grpo_skip_matched", "grpo_skip"):
        by = vs[base]["dppo_budget"]["by_target"]
        said = [f"{e['time_to_target']:.2f}x [{e['ci95'][0]:.2f}, {e['ci95'][1]:.2f}]"
                for e in (by["0.90"], by["0.95"])]
        assert all(x in readme for x in said), (base, said)


def test_links_to_files_in_the_documentation_resolve():
    docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "notebooks" / "README.md",
            *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.rglob("*.md"))]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (doc.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _rollout_throughput_script():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks/rollout_throughput.py"
    spec = importlib.util.spec_from_file_location("rollout_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rollout_cost_model_recovers_a_known_fixed_cost():
    script = _rollout_throughput_script()
    fixed, per_token = 2e-3, 50e-6

    def row(spread, batch, steps, tokens):
        runs = [{"max_length": steps, "tokens": tokens + k, "seconds": fixed * steps + per_token * (tokens + k)}
                for k in (0, 7)]
        return {"engine": "e", "spread": spread, "batch_size": batch, "runs": runs}

    results = [row("a", 32, 60, 900), row("a", 256, 63, 7000), row("b", 32, 64, 1870), row("b", 256, 64, 14900)]
    m = script.cost_model(results)["e"]
    assert m["fixed_s_per_step"] == pytest.approx(fixed, rel=1e-4)
    assert m["s_per_token"] == pytest.approx(per_token, rel=1e-4)
    # at the allowed fixed cost the extreme cells of spread "a" are exactly 15% apart
    f = m["fixed_s_per_step_for_1_15"]["a"]
    spt = [60 / 903.5, 63 / 7003.5]
    assert (per_token + f * max(spt)) / (per_token + f * min(spt)) == pytest.approx(1.15, rel=1e-3)
    # cells whose steps per token differ by less than 15%: any fixed cost would do
    assert script.cost_model([row("c", 32, 60, 900), row("c", 64, 61, 910)])["e"]["fixed_s_per_step_for_1_15"] == {
        "c": None}


def test_the_committed_rollout_cost_model_is_computed_from_its_runs():
    committed = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/rollout_throughput.json")
                           .read_text())
    recomputed = _rollout_throughput_script().cost_model(committed["results"])
    assert committed["cost_model"].keys() == recomputed.keys()
    for engine, model in committed["cost_model"].items():  # rounded least squares: equal up to the last digit
        assert model["fixed_s_per_step"] == pytest.approx(recomputed[engine]["fixed_s_per_step"], rel=1e-4)
        assert model["s_per_token"] == pytest.approx(recomputed[engine]["s_per_token"], rel=1e-4)
        assert model["fixed_s_per_step_for_1_15"] == pytest.approx(recomputed[engine]["fixed_s_per_step_for_1_15"],
                                                                   rel=1e-3)


def test_the_smollm2_pool_weights_are_the_rule_applied_to_the_committed_measurement():
    """dppo_core/tools/bench/cpu_settings.py's SMOLLM2_REALISTIC_WEIGHTS are what benchmarks/level_success.py's rule
    (its fallback: no level of SmolLM2 at T = 1 gives all-correct groups) makes of the committed distributions."""
    import importlib.util

    from dppo_core.tools.bench.cpu_settings import SMOLLM2_REALISTIC_LEVELS, SMOLLM2_REALISTIC_WEIGHTS

    spec = importlib.util.spec_from_file_location("level_success", ROOT / "benchmarks" / "level_success.py")
    level_success = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(level_success)
    measured = json.loads((RESULTS / "smollm2-realistic" / "level_success.json").read_text())
    per_level = {int(k): v for k, v in measured["levels"].items()}
    out = level_success.pool_weights(per_level, 0.3, 0.2)
    assert out["rule"] == "fallback: all-equal share" and not level_success.feasible(out["exact"])
    assert out["levels"] == list(SMOLLM2_REALISTIC_LEVELS)
    assert out["level_weights"] == pytest.approx(list(SMOLLM2_REALISTIC_WEIGHTS), abs=1e-4)
    assert measured["weights"]["level_weights"] == out["level_weights"]


def test_the_smollm2_learning_rate_is_the_committed_tuning_choice():
    """The smollm2-realistic preset runs every method at the rate benchmarks/tune_lr.py's rule picks from the
    committed grid (benchmarks/results/smollm2-realistic/tuning), under the schedule the preset uses."""
    import importlib.util

    from dppo_core.tools.bench.presets import BENCH_PRESETS, SMOLLM2_REALISTIC_LEARNING_RATE

    spec = importlib.util.spec_from_file_location("tune_lr", ROOT / "benchmarks" / "tune_lr.py")
    tune_lr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_lr)
    tuning = json.loads((RESULTS / "smollm2-realistic" / "tuning" / "tuning.json").read_text())
    schedule, chosen = tune_lr.choose(tuning["table"], [float(lr) for lr in tuning["grid"]],
                                     tuning["schedules"])
    assert (schedule, chosen) == (tuning["schedule"], tuning["chosen"])
    preset = BENCH_PRESETS["smollm2-realistic"]
    assert sorted(chosen) == sorted(preset.methods)
    assert {float(lr) for lr in chosen.values()} == {SMOLLM2_REALISTIC_LEARNING_RATE}
    assert preset.overrides["learning_rate"] == SMOLLM2_REALISTIC_LEARNING_RATE and schedule == "constant"
    assert not any("learning_rate" in o for o in preset.method_overrides.values())


def test_the_smollm2_comparison_is_its_committed_bench():
    """The real model against the strong baselines (issue #66): summary.json is benchmarks/smollm2_realistic.py's
    summary of the committed bench (advise's replay aside, which needs the model), with the four methods on at
    least three seeds; the results README's and docs/benchmarks.md's tables are its markdown, and README.md quotes
    `dppo` against `grpo_skip` and the rollout budget against the batch-matched baseline, with their t-intervals,
    and the pool's persistence."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2_realistic", ROOT / "benchmarks" / "smollm2_realistic.py")
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    folder = RESULTS / "smollm2-realistic"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["bench"] == "benchmarks/results/smollm2-realistic/bench" and len(summary["seeds"]) >= 3
    assert set(summary["methods"]) == {"grpo_skip", "grpo_skip_matched", "dppo", "dppo_budget"}
    assert all(m["seeds"] == summary["seeds"] for m in summary["methods"].values())
    again = json.loads(json.dumps(smollm2.summarize(folder / "bench", replay=False)))
    assert {k: v for k, v in again.items() if k not in ("bench", "advise")} == {
        k: v for k, v in summary.items() if k not in ("bench", "advise")}
    assert [a["seed"] for a in summary["advise"]] == summary["seeds"]
    start, end = SMOLLM2_MARKERS
    for page in (ROOT / "docs/benchmarks.md", folder / "README.md"):
        assert page.read_text().split(start)[1].split(end)[0].strip() == smollm2.markdown(summary).strip(), page
    doc = (folder / "README.md").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    for pair in ("dppo vs grpo_skip", "dppo_budget vs grpo_skip_matched"):  # with the t-intervals
        entry = summary["speedups"]["greedy"][pair]
        said = [f"{e['speedup']:.2f}x [{e['paired_ci95'][0]:.2f}, {e['paired_ci95'][1]:.2f}]"
                for e in (entry["0.90"], entry["0.95"])]
        assert all(x in readme for x in said), (pair, said)
    p = summary["persistence"]
    assert f"P(all-equal | previous all-equal) {p['p_equal_after_equal']:.2f}" in " ".join(doc.split())
    assert f"(persistence {p['p_equal_after_equal']:.2f})" in readme
