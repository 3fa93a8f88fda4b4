"""``dppo bench``: the cpu-smoke preset end to end (every method, the JSON schema, the plots), the pure
summary functions on hand-computed numbers, the method configurations and the errors."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dppo_core.config import ConfigError, DPPOConfig, preset
from dppo_core.grouplog import read_groups
from dppo_core.tools import bench
from dppo_core.tools.bench import (
    BENCH_PRESETS,
    METHOD_OVERRIDES,
    METHODS,
    BenchError,
    aggregate_runs,
    compare,
    interleaved,
    method_config,
    run_bench,
    summarize_run,
    time_to_target,
    token_cost_bound,
    trl_grpo_args,
)
from dppo_core.tools.cli import main as cli_main
from dppo_core.trainer import build_prompt_source

PHASES = ("rollout", "reward", "prune", "pack", "update", "sync")


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------------------------------
# The smoke preset, through the command line
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(small_model_dir, tmp_path_factory):
    """cpu-smoke (every method, 2 seeds x 3 steps) on the small test model, through `dppo bench`."""
    out = tmp_path_factory.mktemp("bench")
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli_main(["bench", "--preset", "cpu-smoke", "--output-dir", str(out), f"model={small_model_dir}"])
    assert code == 0, buf.getvalue()
    return out, json.loads((out / "bench.json").read_text()), buf.getvalue()


@pytest.mark.slow
def test_smoke_bench_json_has_every_key_with_its_type(smoke):
    _, result, _ = smoke
    assert result["preset"] == "cpu-smoke" and isinstance(result["machine"], str) and result["machine"]
    assert result["seeds"] == [0, 1] and all(isinstance(s, int) for s in result["seeds"])
    assert _is_num(result["target_accuracy"])
    assert set(result["methods"]) == set(METHODS)
    for name, m in result["methods"].items():
        assert _is_num(m["wall_s"]) and m["wall_s"] > 0, name
        assert isinstance(m["steps"], int) and m["steps"] == 3, name
        assert set(m["step_time_s"]) == {"median", "min", "max"}
        assert m["step_time_s"]["min"] <= m["step_time_s"]["median"] <= m["step_time_s"]["max"]
        assert set(m["phase_s"]) == set(PHASES) and all(_is_num(v) and v >= 0 for v in m["phase_s"].values())
        assert set(m["tokens"]) == {"generated", "trained", "decode_steps", "row_capacity", "update_real"}
        assert all(isinstance(v, int) for v in m["tokens"].values())
        # dynamic sampling trains only groups whose rewards differ: the untrained model's are all 0 (tested with
        # signal in test_rollout_plans.py)
        untrained = name in ("dapo_sampling", "greso_sampling", "dapo_oversampled") and m["tokens"]["trained"] == 0
        assert m["tokens"]["generated"] > 0 and (untrained or 0 < m["tokens"]["trained"]), name
        assert m["tokens"]["trained"] <= m["tokens"]["update_real"] <= m["tokens"]["row_capacity"], name
        if not name.startswith("trl") and not untrained:  # TRL's logs have no weights or gradient norms
            assert _is_num(m["ess_per_step"]) and m["ess_per_step"] > 0 and 0 <= m["clip_rate"] <= 1, name
        acc = m["accuracy"]
        for key in ("before", "after", "after_std"):
            assert _is_num(acc[key]), (name, key)
        assert set(acc["per_level_after"]) == {"2", "3"} and all(_is_num(v) for v in acc["per_level_after"].values())
        assert m["time_to_target_s"] is None or _is_num(m["time_to_target_s"])
    for key in ("speedup_vs_grpo", "token_cost_bound", "fraction_of_bound"):
        assert set(result[key]) == set(METHODS), key
    for name, sp in result["speedup_vs_grpo"].items():
        assert set(sp) == {"step_time", "wall", "time_to_target"}
        assert _is_num(sp["step_time"]) and _is_num(sp["wall"]), name
        assert sp["time_to_target"] is None or _is_num(sp["time_to_target"])
        assert _is_num(result["token_cost_bound"][name]) and _is_num(result["fraction_of_bound"][name])
    assert result["token_cost_bound"]["grpo"] == pytest.approx(1.0)
    assert result["speedup_vs_grpo"]["grpo"]["wall"] == pytest.approx(1.0)
    assert len(result["runs"]) == len(METHODS) * 2
    for ref in ("grpo", "grpo_skip"):  # the ceiling of every method of ours over each baseline; TRL's have no groups
        for name, c in result["ceiling"][ref].items():
            if name.startswith("trl"):
                assert c["speedup"] is None and "groups.jsonl" in c["why_not"], name
            else:
                assert _is_num(c["speedup"]) and c["speedup"] > 0 and len(c["per_seed"]) == 2, (ref, name)
    json.dumps(result, allow_nan=False)  # strict JSON: no NaN or infinity anywhere


@pytest.mark.slow
def test_smoke_every_method_ran_and_left_its_logs_and_plots(smoke):
    out, result, printed = smoke
    for method in METHODS:
        for seed in (0, 1):
            d = out / "runs" / method / f"seed-{seed}"
            lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            steps = [m for m in lines if "step_time" in m]
            # the offline filter's line comes first, before the steps (its time and tokens are the run's)
            assert [m.get("event") for m in lines if m not in steps] == (["prefilter"] if method == "grpo_skip_filtered"
                                                                       else []), (method, seed)
            evals = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines()]
            assert [s["step"] for s in steps] == [1, 2, 3], (method, seed)
            assert [e["step"] for e in evals] == [0, 1, 2, 3], (method, seed)  # eval_steps=1, before and after
            assert not [p for p in d.iterdir() if p.is_dir()], "checkpoints and the final model are removed"
            if not method.startswith("trl"):  # our trainer logs every rolled-out group, consistent with the metrics
                groups = read_groups(d)
                assert [g["step"] for g in groups] == [1, 2, 3], (method, seed)
                for g, s in zip(groups, steps, strict=True):
                    stopped = g.get("stopped", {"ids": [], "lengths": []})  # a pilot's stopped groups (k each)
                    assert sum(map(sum, g["lengths"] + stopped["lengths"])) == s["tokens_generated"]
                    assert len(g["ids"]) == len(g["pi"]) and len(g["rewards"]) == len(g["lengths"])
                    assert len(g["rewards"]) + len(stopped["ids"]) == s["prompts_rolled_out"]
                    assert ("stopped" in g) == method.endswith("_pilot"), (method, g)
                    assert g["window"] == s["prompts_candidates"] and all(0 < p <= 1 for p in g["pi"])
        assert method in printed
    for name in ("accuracy_vs_step.png", "accuracy_vs_time.png", "phases.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    m = result["methods"]
    # pruning acted: dppo trains on fewer tokens than it generates; the others train on all they keep
    assert m["dppo"]["tokens"]["trained"] < m["dppo"]["tokens"]["generated"]
    assert m["cppo"]["tokens"]["trained"] < m["cppo"]["tokens"]["generated"]
    assert m["grpo"]["tokens"]["trained"] == m["grpo"]["tokens"]["generated"]
    # TRL's policy is evaluated by the same code on the same problems: the same model scores the same before
    assert m["trl_grpo"]["accuracy"]["before"] == m["grpo"]["accuracy"]["before"]
    assert m["trl_dppo"]["accuracy"]["before"] == m["grpo"]["accuracy"]["before"]
    assert result["trl_args"]["num_generations"] == 4 and result["trl_args"]["beta"] == 0.04
    # TRL's trainer with DPPO's estimator prunes: it trains on fewer tokens than it generates, unlike trl_grpo
    assert m["trl_dppo"]["tokens"]["trained"] < m["trl_dppo"]["tokens"]["generated"]
    assert m["trl_grpo"]["tokens"]["trained"] == m["trl_grpo"]["tokens"]["generated"]
    assert result["configs"]["trl_dppo"] == {**result["configs"]["dppo"], "packing": False, "dense_prompts": False}
    # the rollout-budget methods and their batch-matched baseline rolled out the same prompts in every step, half of
    # the others' 4 (dppo_budget's fixed-size draw keeps exactly round(4 x 0.5)), and are compared with it
    assert result["batch_matched"] == {"dppo_budget": "grpo_skip_matched", "dppo_budget_pilot": "grpo_skip_matched",
                                       "grpo_half": "grpo_skip_matched"}
    for name in ("dppo_budget", "dppo_budget_pilot", "grpo_half", "grpo_skip_matched"):
        assert m[name]["prompts_rolled_out"] == 2, name
    assert m["grpo_skip"]["prompts_rolled_out"] == m["grpo"]["prompts_rolled_out"] == 4
    assert set(result["speedup_vs"]["grpo_skip_matched"]) == {"grpo_skip_matched", *result["batch_matched"]}
    assert set(result["target_sweep"]["grpo_skip_matched"]["dppo_budget"]["by_target"]) == {
        "0.80", "0.85", "0.90", "0.92", "0.95", "0.97"}


@pytest.mark.slow
def test_cli_records_the_command_and_rewrites_the_readme_table(smoke, tmp_path, capsys):
    out, result, _ = smoke
    assert json.loads((out / "bench.json").read_text())["command"] == \
        f"dppo bench --preset cpu-smoke --output-dir {out} model={result['configs']['grpo']['model']}"
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- bench:cpu-smoke:start -->\n<!-- bench:cpu-smoke:end -->\n")
    assert cli_main(["bench", "--preset", "cpu-smoke", "--output-dir", str(out), "--summarize",
                     "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "| `dppo` |" in text and "Command: `dppo bench --preset cpu-smoke" in text   # the runs' command, kept
    assert "README.md: results table rewritten" in capsys.readouterr().out
    readme.write_text("no markers\n")
    assert cli_main(["bench", "--preset", "cpu-smoke", "--output-dir", str(out), "--summarize",
                     "--readme", str(readme)]) == 2


@pytest.mark.slow
def test_plots_leave_the_callers_matplotlib_backend_alone(smoke, tmp_path):
    """A notebook that runs the bench keeps its inline backend (plot_bench once switched it to Agg)."""
    import matplotlib

    _, result, _ = smoke
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        written = bench.plot_bench(result, tmp_path)
        assert matplotlib.get_backend() == "svg"
        assert [p.name for p in written] == ["accuracy_vs_step.png", "accuracy_vs_time.png", "phases.png"]
    finally:
        matplotlib.use(before)


@pytest.mark.slow
def test_summarize_rewrites_the_same_result_from_the_logs(smoke):
    out, result, _ = smoke
    again = bench.write_bench(out, "cpu-smoke", METHODS, (0, 1))
    assert again["methods"] == result["methods"] and again["fraction_of_bound"] == result["fraction_of_bound"]


@pytest.mark.slow
def test_times_from_reads_accuracies_here_and_every_time_from_identical_training(smoke, tmp_path):
    out, result, _ = smoke
    here, timing = tmp_path / "precise", tmp_path / "timing"
    for d in (here, timing):
        shutil.copytree(out / "runs", d / "runs")
    for path in timing.glob("runs/*/seed-*/metrics.jsonl"):  # the timing run: every time doubled
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: 2 * v if k == "step_time" or k.startswith("time_") else v
                                            for k, v in r.items()}) + "\n" for r in rows))
    for path in here.glob("runs/*/seed-*/eval.jsonl"):  # the precise evaluation: other accuracies
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "sampled_accuracy": 0.5 + r["step"] / 100}) + "\n" for r in rows))
    joined = bench.write_bench(here, "cpu-smoke", METHODS, (0, 1), times_from=timing)
    assert joined["times_from"] == timing.as_posix()
    for m in METHODS:
        ours, before = joined["methods"][m], result["methods"][m]
        assert ours["wall_s"] == pytest.approx(2 * before["wall_s"])
        assert ours["phase_s"]["rollout"] == pytest.approx(2 * before["phase_s"]["rollout"])
        assert ours["accuracy"]["after"] == pytest.approx(0.5 + 3 / 100)
    assert bench.write_bench(here, "cpu-smoke", METHODS, (0, 1))["times_from"] == timing.as_posix()  # kept
    fresh = bench.write_bench(here, "cpu-smoke", METHODS, (0, 1), command="dppo bench ...")  # a bench that just ran
    assert "times_from" not in fresh and fresh["methods"]["grpo"]["wall_s"] == result["methods"]["grpo"]["wall_s"]
    # a timing run that trained differently is refused, naming the run, the step and what differs
    path = timing / "runs" / "dppo" / "seed-1" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[1]["tokens_trained"] += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BenchError, match=r"dppo seed 1: step 2 differs from the timing run in tokens_trained"):
        bench.write_bench(here, "cpu-smoke", METHODS, (0, 1), times_from=timing)
    assert cli_main(["bench", "--preset", "cpu-smoke", "--output-dir", str(here), "--times-from", str(timing)]) == 2


@pytest.mark.slow
def test_a_preset_of_your_own_runs_and_on_record_sees_every_step_and_evaluation(small_model_dir, tmp_path):
    """run_bench takes a BenchPreset object (chapter 08 defines one) and streams the records as they are logged."""
    mine = bench.BenchPreset("mine", "two methods, two steps", base="tiny-grpo", methods=("grpo", "dppo"),
                             overrides={**BENCH_PRESETS["cpu-smoke"].overrides, "model": str(small_model_dir),
                                        "max_steps": 2},
                             method_overrides={"dppo": {"completion_prune_rate": 0.75}})
    seen = []
    result = run_bench(mine, tmp_path, log=lambda _: None, command="python my_experiment.py",
                       on_record=lambda method, seed, record: seen.append((method, seed, record)))
    assert result["preset"] == "mine" and set(result["methods"]) == {"grpo", "dppo"}
    assert result["command"] == "python my_experiment.py"
    assert bench.write_bench(tmp_path, mine, ("grpo", "dppo"), (0,))["command"] == "python my_experiment.py"  # kept
    assert result["method_overrides"]["dppo"]["completion_prune_rate"] == 0.75
    for method in ("grpo", "dppo"):
        steps = [r["step"] for m, s, r in seen if m == method and r.get("event") != "eval"]
        evals = [r["step"] for m, s, r in seen if m == method and r.get("event") == "eval"]
        assert steps == [1, 2] and evals == [0, 1, 2], (method, steps, evals)
        assert all(s == 0 for m, s, _ in seen)
    assert json.loads((tmp_path / "bench.json").read_text())["preset"] == "mine"



# --------------------------------------------------------------------------------------------------
# Ctrl-C, then --resume, through the command line
# --------------------------------------------------------------------------------------------------


def _bench_argv(out: Path, model: Path) -> list[str]:
    """The smallest accuracy bench, through ``python -m dppo_core``: cpu-smoke's grpo run, one seed, 3 steps, on
    level 1, which ``model`` (the warm small model) gets right at times: the rewards vary and the weights change."""
    return [sys.executable, "-m", "dppo_core", "bench", "--preset", "cpu-smoke", "--methods", "grpo", "--seeds", "0",
            "--output-dir", str(out), f"model={model}", "train_levels=[1]"]


def _cli_env() -> dict[str, str]:
    # one thread each: the uninterrupted bench runs beside the interrupted one, and both compute alike
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _start_cli(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_cli_env())


def _names(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _without_times(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k not in ("step_time", "eval_s")}
            for r in rows]


def test_a_bench_stopped_by_ctrl_c_after_its_first_step_resumes_through_the_cli(warm_small_model_dir, tmp_path):
    """What Ctrl-C's message says (run the same command again with --resume) works: the resumed bench ends with
    the files of an uninterrupted one, its training and evaluations equal but for the times."""
    ref_out, out = tmp_path / "uninterrupted", tmp_path / "stopped"
    ref_log, log = tmp_path / "uninterrupted.log", tmp_path / "stopped.log"
    ref = _start_cli(_bench_argv(ref_out, warm_small_model_dir), ref_log)  # beside the other: a second core
    proc = _start_cli(_bench_argv(out, warm_small_model_dir), log)
    try:
        metrics, deadline = out / "runs" / "grpo" / "seed-0" / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text()):  # its first step is logged: Ctrl-C
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130, log.read_text()  # stopped after a step, not finished
        assert "run the same command again with --resume" in log.read_text()
        assert re.search(r"stopped at step \d+; run the same command", log.read_text())  # no checkpoint (unused)
        assert not list(metrics.parent.glob("checkpoint-*")) and not (out / "bench.json").exists()
        resumed = subprocess.run([*_bench_argv(out, warm_small_model_dir), "--resume"], capture_output=True,
                                 text=True, stdin=subprocess.DEVNULL, env=_cli_env(), timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "grpo seed 0: 3 steps" in resumed.stdout  # the unfinished run starts again
        assert ref.wait(timeout=300) == 0, ref_log.read_text()
    finally:
        for p in (ref, proc):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert _names(out) == _names(ref_out)  # every file an uninterrupted bench writes, and nothing else
    run, ref_run = out / "runs" / "grpo" / "seed-0", ref_out / "runs" / "grpo" / "seed-0"
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert _without_times(run / name) == _without_times(ref_run / name), name
    assert read_groups(run) == read_groups(ref_run)
    assert any(r["loss"] != 0 for r in _without_times(run / "metrics.jsonl")), "the rewards never varied"
    config, ref_config = (json.loads((d / "config.json").read_text()) for d in (run, ref_run))
    assert {**config, "output_dir": None} == {**ref_config, "output_dir": None}
    result, ref_result = (json.loads((d / "bench.json").read_text()) for d in (out, ref_out))
    assert result["methods"]["grpo"]["accuracy"] == ref_result["methods"]["grpo"]["accuracy"]


@pytest.mark.parametrize("name", ["cpu-full", "cpu-baselines", "cpu-peers", "cpu-batch8", "cpu-own-best"])
def test_the_readme_results_table_is_generated_from_the_committed_bench_json(name):
    """Each marked table of docs/benchmarks.md (``bench:NAME``) is format_markdown of
    benchmarks/results/NAME/bench.json, with its command (rewrite it with `dppo bench --preset PRESET
    --output-dir benchmarks/results/NAME --summarize --readme docs/benchmarks.md` where NAME is the preset, else
    with :func:`~dppo_core.tools.bench.update_readme`'s ``name``)."""
    root = Path(__file__).resolve().parents[2]
    result = json.loads((root / f"benchmarks/results/{name}/bench.json").read_text())
    assert result["command"].startswith(f"dppo bench --preset {result['preset']}")
    assert f"--output-dir benchmarks/results/{name}" in result["command"]
    start, end = (m.format(preset=name) for m in bench.README_MARKERS)
    table = (root / "docs" / "benchmarks.md").read_text().split(start)[1].split(end)[0]
    assert table.strip() == bench.format_markdown(result, result["command"])


def test_update_readme_rewrites_only_between_the_markers_and_needs_them(tmp_path):
    result = {"preset": "p", "seeds": [0, 1], "target_accuracy": 0.5, "machine": "m",
              "methods": {"grpo": _method(100, 40, 1, 50, 1000, 1000, median=2.0, ttt=80.0),
                          "dppo": _method(50, 30, 1, 15, 600, 300, median=1.0, ttt=40.0)}, **{}}
    for m in result["methods"].values():
        m["accuracy"] = {"before": 0.4, "after": 0.6, "after_std": 0.01}
    result.update(compare(result["methods"]))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:p:start -->\nold\n<!-- bench:p:end -->\nrest\n")
    assert bench.update_readme(readme, result, "dppo bench --preset p")
    text = readme.read_text()
    assert text.startswith("intro\n<!-- bench:p:start -->\n| method |")
    assert text.endswith("<!-- bench:p:end -->\nrest\n")
    assert "| `dppo` | 0.600 ± 0.010 | 0.7 min | 1.00 s | 2.00x / 2.00x / 2.00x |" in text
    assert "Command: `dppo bench --preset p`" in text and "old" not in text
    assert not bench.update_readme(readme, result, "dppo bench --preset p")   # already up to date
    readme.write_text("no markers\n")
    with pytest.raises(BenchError, match="needs one line <!-- bench:p:start -->"):
        bench.update_readme(readme, result)


# --------------------------------------------------------------------------------------------------
# Pure functions, on hand-computed numbers
# --------------------------------------------------------------------------------------------------


def test_time_to_target_is_the_crossing_interpolated_between_evaluations():
    curve = [{"train_s": 0.0, "sampled_accuracy": 0.40}, {"train_s": 10.0, "sampled_accuracy": None},
             {"train_s": 20.0, "sampled_accuracy": 0.58}, {"train_s": 30.0, "sampled_accuracy": 0.55},
             {"train_s": 40.0, "sampled_accuracy": 0.60}]
    # between 0.40 at 0 s and 0.58 at 20 s (the evaluation without an accuracy at 10 s is skipped)
    assert time_to_target(curve, 0.49) == pytest.approx(10.0)
    assert time_to_target(curve, 0.57) == pytest.approx(20.0 * 0.17 / 0.18)
    assert time_to_target(curve, 0.58) == 20.0  # "reaches" includes equality: that evaluation's time exactly
    # the dip at 30 s does not count: 0.59 is first reached between 0.55 at 30 s and 0.60 at 40 s
    assert time_to_target(curve, 0.59) == pytest.approx(38.0)
    assert time_to_target(curve, 0.60) == 40.0
    assert time_to_target(curve, 0.40) == 0.0  # the first evaluation already reaches it: its time
    assert time_to_target(curve, 0.30) == 0.0
    assert time_to_target(curve, 0.61) is None  # never reached: None, not the end of the run
    assert time_to_target([], 0.5) is None
    late = [{"train_s": 5.0, "sampled_accuracy": None}, {"train_s": 15.0, "sampled_accuracy": 0.7}]
    assert time_to_target(late, 0.5) == 15.0  # the first evaluation with an accuracy, wherever it falls
    # never later than the first evaluation at or above the target, and None exactly when that is None
    for target in (0.3, 0.45, 0.5, 0.57, 0.58, 0.59, 0.6, 0.61):
        first = next((p["train_s"] for p in curve if p["sampled_accuracy"] is not None
                      and p["sampled_accuracy"] >= target), None)
        t = time_to_target(curve, target)
        assert (t is None) == (first is None) and (t is None or t <= first), target


def test_summarize_bench_times_each_run_to_target_by_the_interpolated_crossing(tmp_path):
    """bench.json's time_to_target_s (so the main table and its speedups) is the interpolated crossing, the
    same definition as speedup_vs: here grpo and dppo cross the target between evaluations."""
    def write_run(method, step_time, accs):
        d = bench.run_dir(tmp_path, method, 0)
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"machine": "m", "elapsed_s": 1.0}))
        (d / "config.json").write_text(json.dumps({"seed": 0, "output_dir": str(d)}))
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time": step_time}) + "\n"
                                                 for s in range(1, 5)))
        (d / "eval.jsonl").write_text("".join(json.dumps({"step": 2 * k, "sampled_accuracy": a}) + "\n"
                                              for k, a in enumerate(accs)))

    write_run("grpo", 10.0, (0.40, 0.50, 0.60))   # evaluations at 0, 20 and 40 s of training
    write_run("dppo", 5.0, (0.40, 0.56, 0.58))    # at 0, 10 and 20 s
    result = bench.summarize_bench(tmp_path, "mine", ("grpo", "dppo"), (0,))
    target = 0.95 * 0.60  # 0.57
    assert result["target_accuracy"] == pytest.approx(target)
    grpo, dppo = result["methods"]["grpo"], result["methods"]["dppo"]
    assert grpo["time_to_target_s"] == pytest.approx(20.0 + 0.07 / 0.10 * 20.0)  # 34 s, not the evaluation at 40 s
    assert dppo["time_to_target_s"] == pytest.approx(10.0 + 0.01 / 0.02 * 10.0)  # 15 s, not the one at 20 s
    assert [r["time_to_target_s"] for r in result["runs"]] == [grpo["time_to_target_s"], dppo["time_to_target_s"]]
    ratio = 34.0 / 15.0
    assert result["speedup_vs_grpo"]["dppo"]["time_to_target"] == pytest.approx(ratio)
    assert result["speedup_intervals"]["grpo"]["dppo"]["time_to_target"]["mean"] == pytest.approx(ratio)
    assert result["speedup_vs"]["grpo"]["dppo"]["by_target"]["0.95"]["time_to_target"] == pytest.approx(ratio)
    assert "interpolated" in result["notes"]["time_to_target_s"]


def _method(wall, rollout, reward, update, generated, trained, median=None, ttt=None, prune=0.0, pack=0.0, sync=0.0):
    return {"wall_s": wall, "step_time_s": {"median": median or wall / 10, "min": 0.0, "max": 0.0},
            "phase_s": {"rollout": rollout, "reward": reward, "prune": prune, "pack": pack, "update": update,
                        "sync": sync},
            "tokens": {"generated": generated, "trained": trained, "row_capacity": trained},
            "time_to_target_s": ttt}


def test_token_cost_bound_on_hand_computed_numbers():
    # grpo: 100 s = 40 s rollout + 2 s reward (1000 generated tokens: 0.042 s each) + 50 s update
    # (1000 trained tokens: 0.05 s each) + 8 s fixed (1 s prune, 3 s pack, 4 s between phases)
    grpo = _method(100.0, 40.0, 2.0, 50.0, 1000, 1000, prune=1.0, pack=3.0)
    # a method generating 750 and training 250 tokens: 0.042 * 750 + 0.05 * 250 + 8 = 31.5 + 12.5 + 8 = 52
    other = _method(65.0, 30.0, 1.5, 12.0, 750, 250)
    assert token_cost_bound(grpo, grpo) == pytest.approx(1.0)
    assert token_cost_bound(grpo, other) == pytest.approx(100 / 52)
    out = compare({"grpo": grpo, "other": other})
    assert out["token_costs"]["rollout_s_per_generated_token"] == pytest.approx(0.04)
    assert out["token_costs"]["reward_s_per_generated_token"] == pytest.approx(0.002)
    assert out["token_costs"]["update_s_per_trained_token"] == pytest.approx(0.05)
    assert out["token_costs"]["fixed_s"] == pytest.approx(8.0)
    assert out["speedup_vs_grpo"]["other"]["wall"] == pytest.approx(100 / 65)
    assert out["fraction_of_bound"]["other"] == pytest.approx((100 / 65) / (100 / 52))  # = 52 / 65 = 0.8
    assert out["fraction_of_bound"]["other"] == pytest.approx(0.8)


def test_speedups_over_grpo_and_a_missing_time_to_target():
    grpo = _method(100.0, 40.0, 0.0, 60.0, 1000, 1000, median=1.0, ttt=50.0)
    fast = _method(50.0, 20.0, 0.0, 30.0, 500, 500, median=0.4, ttt=20.0)
    never = _method(80.0, 40.0, 0.0, 40.0, 1000, 500, median=0.8, ttt=None)
    sp = compare({"grpo": grpo, "fast": fast, "never": never})["speedup_vs_grpo"]
    assert sp["fast"] == {"step_time": pytest.approx(2.5), "wall": pytest.approx(2.0),
                          "time_to_target": pytest.approx(2.5)}
    assert sp["never"]["time_to_target"] is None and sp["never"]["wall"] == pytest.approx(1.25)
    assert sp["grpo"]["time_to_target"] == pytest.approx(1.0)


def test_summarize_run_totals_steps_phases_tokens_and_the_training_clock():
    metrics = [
        {"step": 1, "step_time": 2.0, "time_rollout": 1.0, "time_reward": 0.1, "time_prune": 0.1, "time_pack": 0.1,
         "time_update": 0.6, "time_sync": 0.0, "tokens_generated": 100, "tokens_trained": 60, "update_capacity": 80,
         "completion_length_max": 12},
        # a step whose prompts were all pruned: no rollout, no tokens
        {"step": 2, "step_time": 0.5, "time_prune": 0.5, "tokens_generated": 0, "tokens_trained": 0, "skipped": 1},
        {"step": 3, "step_time": 3.0, "time_rollout": 2.0, "time_reward": 0.1, "time_prune": 0.0, "time_pack": 0.1,
         "time_update": 0.8, "time_sync": 0.0, "tokens_generated": 120, "tokens_trained": 90, "update_capacity": 100,
         "completion_length_max": 9, "decode_steps": 20},  # a pilot's two engine calls: their decode steps
    ]
    evals = [{"step": 0, "sampled_accuracy": 0.4, "greedy_accuracy": 0.5, "sampled_L2": 0.5, "sampled_L2_stderr": 0.1,
              "sampled_L3": 0.3, "sampled_stderr": 0.05, "sampled_steps_share": 0.5, "eval_s": 4.0},
             {"step": 2, "sampled_accuracy": 0.5, "greedy_accuracy": 0.6, "sampled_L2": 0.6, "sampled_L3": 0.4,
              "eval_s": 4.0},
             {"step": 3, "sampled_accuracy": 0.6, "greedy_accuracy": 0.7, "sampled_L2": 0.7, "sampled_L3": 0.5,
              "eval_s": 5.0}]
    run = summarize_run(metrics, evals)
    assert run["steps"] == 3 and run["wall_s"] == pytest.approx(5.5) and run["eval_s"] == pytest.approx(13.0)
    assert run["step_time_s"] == {"median": 2.0, "min": 0.5, "max": 3.0}
    assert run["phase_s"] == pytest.approx({"rollout": 3.0, "reward": 0.2, "prune": 0.6, "pack": 0.2,
                                            "update": 1.4, "sync": 0.0})
    assert run["tokens"] == {"generated": 220, "trained": 150, "decode_steps": 32, "row_capacity": 180,
                             "update_real": 0}  # no density
    assert [p["train_s"] for p in run["curve"]] == pytest.approx([0.0, 2.5, 5.5])
    assert run["accuracy"]["before"] == 0.4 and run["accuracy"]["after"] == 0.6
    assert run["accuracy"]["per_level_before"] == {"2": 0.5, "3": 0.3}
    assert run["accuracy"]["per_level_after"] == {"2": 0.7, "3": 0.5}
    assert run["eval_stderr_max"] == 0.05  # the one evaluation that logs it



def test_summarize_run_counts_an_offline_filter_as_training_time_and_tokens():
    """grpo_skip_filtered's filter runs before the first step: its time starts the clock, its tokens count."""
    steps = [{"step": 1, "step_time": 2.0, "tokens_generated": 100, "tokens_trained": 60},
             {"step": 2, "step_time": 3.0, "tokens_generated": 120, "tokens_trained": 90}]
    evals = [{"step": 0, "sampled_accuracy": 0.4}, {"step": 1, "sampled_accuracy": 0.5},
             {"step": 2, "sampled_accuracy": 0.6}]
    plain = summarize_run(steps, evals)
    run = summarize_run([{"event": "prefilter", "step": 0, "time_prefilter": 7.0, "tokens_generated": 400}, *steps],
                        evals)
    assert plain["prefilter_s"] == 0.0 and run["prefilter_s"] == 7.0
    assert run["wall_s"] == pytest.approx(plain["wall_s"] + 7.0) and run["steps"] == plain["steps"] == 2
    assert [p["train_s"] for p in run["curve"]] == pytest.approx([7.0, 9.0, 12.0])
    assert run["tokens"]["generated"] == plain["tokens"]["generated"] + 400 == 620
    assert run["step_time_s"] == plain["step_time_s"]  # the filter is not a step
    assert time_to_target(run["curve"], 0.55) == pytest.approx(10.5)

def _run(after, wall, ttt, curve_accs=(0.4, 0.5), generated=1000):
    return {"wall_s": wall, "eval_s": 1.0, "steps": 10,
            "step_time_s": {"median": wall / 10, "min": 0.0, "max": wall / 5},
            "phase_s": dict.fromkeys(PHASES, wall / 6),
            "tokens": {"generated": generated, "trained": 500, "row_capacity": 700},
            "accuracy": {"before": 0.4, "after": after, "per_level_after": {"2": after, "3": after}},
            "time_to_target_s": ttt,
            "curve": [{"step": 5 * i, "train_s": wall * i / 2, "sampled_accuracy": a}
                      for i, a in enumerate(curve_accs)]}


def test_aggregation_over_seeds_is_the_mean_with_the_std_of_the_final_accuracy():
    agg = aggregate_runs([_run(0.5, 10.0, 4.0, generated=1000), _run(0.6, 20.0, 6.0, (0.4, 0.7), generated=1001)])
    assert agg["wall_s"] == pytest.approx(15.0) and agg["steps"] == 10
    assert agg["accuracy"]["after"] == pytest.approx(0.55)
    assert agg["accuracy"]["after_std"] == pytest.approx(math.sqrt(((0.05) ** 2 * 2) / 1))  # sample std, n - 1
    assert agg["accuracy"]["per_level_after"] == pytest.approx({"2": 0.55, "3": 0.55})
    assert agg["tokens"]["generated"] == 1000 and isinstance(agg["tokens"]["generated"], int)  # 1000.5 rounds to even
    assert agg["step_time_s"]["median"] == pytest.approx(1.5)
    assert agg["time_to_target_s"] == pytest.approx(5.0) and agg["time_to_target_reached"] == "2/2"
    assert [p["sampled_accuracy"] for p in agg["curve"]] == pytest.approx([0.4, 0.6])
    assert [p["train_s"] for p in agg["curve"]] == pytest.approx([0.0, 7.5])
    # a seed that never reaches the target: no mean time to target (it would flatter the method)
    partial = aggregate_runs([_run(0.5, 10.0, 4.0), _run(0.6, 20.0, None)])
    assert partial["time_to_target_s"] is None and partial["time_to_target_reached"] == "1/2"
    one = aggregate_runs([_run(0.5, 10.0, 4.0)])
    assert one["accuracy"]["after_std"] == 0.0


def test_runs_are_interleaved_and_the_order_rotates_per_seed():
    assert interleaved(("a", "b", "c"), (0, 1, 2, 3)) == [
        ("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2),
        ("a", 3), ("b", 3), ("c", 3)]


# --------------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BENCH_PRESETS))
def test_every_preset_builds_valid_configs_that_differ_only_by_the_method(name, tmp_path):
    preset = BENCH_PRESETS[name]
    configs = {m: method_config(preset, m, 7, tmp_path) for m in preset.methods}
    ref = bench.reference_method(preset.methods)  # grpo, or grpo_skip where a preset runs no grpo
    base = configs[ref].to_dict()
    for m, config in configs.items():
        assert isinstance(config, DPPOConfig) and config.seed == 7
        assert config.output_dir == str(tmp_path / "runs" / m / "seed-7")
        changed = {k for k, v in config.to_dict().items() if base[k] != v} - {"output_dir"}
        assert changed <= set(bench.method_settings(preset, m)) | set(bench.method_settings(preset, ref)), (m, changed)
        if m in METHOD_OVERRIDES and m not in bench.DERIVED_METHODS:
            halved = {"prompts_per_step": base["prompts_per_step"] // 2} if m in bench.HALF_BATCH_METHODS else {}
            assert bench.method_settings(preset, m) == {**METHOD_OVERRIDES[m], **preset.method_overrides.get(m, {}),
                                                        **halved}
        assert config.train_pool_size is not None, "every method samples one fixed pool of prompts"
    if "trl_grpo" in configs:
        args = trl_grpo_args(configs["trl_grpo"], tmp_path)
        c = configs[ref]
        assert args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] == \
            c.prompts_per_step * c.num_generations
        assert (args["learning_rate"], args["beta"], args["max_completion_length"], args["num_generations"]) == \
            (c.learning_rate, c.beta, c.max_completion_length, c.num_generations)
        assert args["use_vllm"] == (c.rollout_engine == "vllm")
    if "trl_dppo" in configs:
        assert trl_grpo_args(configs["trl_dppo"], tmp_path, "trl_dppo") == \
            trl_grpo_args(configs["trl_grpo"], tmp_path), "the TRL peers differ only by the estimator"


def test_cpu_presets_make_pruning_act_on_recurring_prompts():
    full = method_config(BENCH_PRESETS["cpu-full"], "dppo", 0, "out")
    assert full.pruning == "dppo" and full.prompt_prune_rate > 0 and full.completion_prune_rate > 0 and full.packing
    assert full.beta == 0.0  # no KL term: an A = 0 completion has a zero loss and DPPO drops it exactly
    assert full.drop_zero_advantage and full.prompt_scheme == "posterior" and full.dense_prompts
    paper = method_config(BENCH_PRESETS["cpu-full"], "dppo_paper", 0, "out")
    assert paper.prompt_scheme == "paper" and paper.prompt_prune_rate == 0.8 and not paper.dense_prompts
    assert method_config(BENCH_PRESETS["cpu-full"], "greso", 0, "out").prompt_prune_rate == 0.8  # paper's rate
    # each prompt of the pool comes back every few steps, so its history exists when it is drawn again
    assert full.train_pool_size / full.prompts_per_step <= full.max_steps / 4


#: Every bench configuration as it was while METHOD_OVERRIDES["dppo"] was a hand copy of the tiny-dppo preset's
#: pruning (recorded before it was derived from the preset), as changes on DPPOConfig's defaults: what every
#: method of the preset shares (grpo's configuration), then what each method changes on that.
RECORDED_CONFIGS: dict[str, dict[str, dict]] = {
    "cpu-smoke": {
        "shared": {"model": "tiny-untrained", "train_levels": [2, 3], "train_pool_size": 8, "num_generations": 4,
                   "prompts_per_step": 4, "max_completion_length": 16, "beta": 0.04, "micro_batch_size": 16,
                   "max_steps": 3, "save_steps": 0, "eval_steps": 1, "eval_problems_per_level": 4, "eval_samples": 1},
        "dppo": {"pruning": "dppo", "prompt_prune_rate": 0.5, "completion_prune_rate": 0.5, "min_prompt_keep_prob": 0.2,
                 "min_completion_keep_prob": 0.2, "fixed_size_sampling": True, "packing": True,
                 "max_tokens_per_row": 128},
        "cppo": {"pruning": "cppo", "completion_prune_rate": 0.5},
        "greso": {"pruning": "greso", "prompt_prune_rate": 0.5},
        "trl_grpo": {}},
    "demo": {
        "shared": {"train_pool_size": 128, "prompts_per_step": 16, "max_steps": 30, "save_steps": 0, "eval_steps": 10,
                   "eval_problems_per_level": 50, "eval_samples": 2},
        "dppo": {"pruning": "dppo", "prompt_prune_rate": 0.8, "completion_prune_rate": 0.5, "min_prompt_keep_prob": 0.2,
                 "min_completion_keep_prob": 0.2, "fixed_size_sampling": True, "packing": True,
                 "max_tokens_per_row": 128},
        "cppo": {"pruning": "cppo", "completion_prune_rate": 0.5},
        "greso": {"pruning": "greso", "prompt_prune_rate": 0.8},
        "trl_grpo": {}},
    "cpu-full": {
        "shared": {"train_pool_size": 256, "max_steps": 60, "save_steps": 0, "eval_steps": 10,
                   "eval_problems_per_level": 100, "eval_samples": 2},
        "dppo": {"pruning": "dppo", "prompt_prune_rate": 0.8, "completion_prune_rate": 0.5, "min_prompt_keep_prob": 0.2,
                 "min_completion_keep_prob": 0.2, "fixed_size_sampling": True, "packing": True,
                 "max_tokens_per_row": 128},
        "cppo": {"pruning": "cppo", "completion_prune_rate": 0.5},
        "greso": {"pruning": "greso", "prompt_prune_rate": 0.8},
        "trl_grpo": {}},
    "gpu-qwen3": {
        "shared": {"model": "Qwen/Qwen3-1.7B-Base", "task": "math", "train_pool_size": 2048,
                   "max_completion_length": 1024, "rollout_engine": "vllm", "learning_rate": 1e-05,
                   "loss_type": "dr_grpo", "micro_batch_size": 8, "update_mode": "lora", "lora_r": 64,
                   "lora_alpha": 128, "save_steps": 0, "eval_steps": 20, "eval_samples": 2, "device": "cuda"},
        "dppo": {"pruning": "dppo", "prompt_prune_rate": 0.5, "completion_prune_rate": 0.5, "min_prompt_keep_prob": 0.2,
                 "min_completion_keep_prob": 0.2, "fixed_size_sampling": True, "packing": True,
                 "max_tokens_per_row": 4096, "packing_rows_per_micro_batch": 2},
        "cppo": {"pruning": "cppo", "completion_prune_rate": 0.5},
        "greso": {"pruning": "greso", "prompt_prune_rate": 0.5},
        "trl_grpo": {}},
}


#: What the dppo method changed to with the variance-aware schemes (#22), on top of the recorded pruning; its
#: prompt rate is the preset's 0.5 everywhere (the CPU presets' 0.8 is dppo_paper's).
VARIANCE_AWARE = {"prompt_prune_rate": 0.5, "prompt_scheme": "posterior", "posterior_half_life": 20,
                  "dense_prompts": True, "completion_scheme": "length", "length_exponent": 1.0,
                  "fixed_size_design": "sorted"}


@pytest.mark.parametrize("name", list(RECORDED_CONFIGS))
def test_every_method_configuration_is_the_recorded_one(name, tmp_path):
    preset, recorded = BENCH_PRESETS[name], RECORDED_CONFIGS[name]
    for method in ("grpo", "dppo", "cppo", "greso", "trl_grpo", "dppo_paper"):
        settings = recorded.get(method, {})
        if method == "dppo":
            settings = {**settings, **VARIANCE_AWARE}
        elif method == "dppo_paper":  # what dppo was (a 128-token row: the GPU preset's 4096 is dppo's own)
            settings = {**recorded["dppo"], "max_tokens_per_row": 128}
            settings.pop("packing_rows_per_micro_batch", None)
        expected = DPPOConfig().with_overrides({**recorded["shared"], **settings, "seed": 7,
                                                "output_dir": str(tmp_path / "runs" / method / "seed-7")})
        assert method_config(preset, method, 7, tmp_path) == expected, method
    # command-line overrides still apply to every method, or to one after its settings
    overrides = ["max_steps=5", "dppo.completion_prune_rate=0.3", "grpo.beta=0.1"]
    grpo = method_config(preset, "grpo", 3, tmp_path, overrides)
    assert grpo == DPPOConfig().with_overrides({**recorded["shared"], "max_steps": 5, "beta": 0.1, "seed": 3,
                                                "output_dir": str(tmp_path / "runs/grpo/seed-3")})
    dppo = method_config(preset, "dppo", 3, tmp_path, overrides)
    assert dppo == DPPOConfig().with_overrides({**recorded["shared"], **recorded["dppo"], **VARIANCE_AWARE,
                                                "max_steps": 5, "completion_prune_rate": 0.3, "seed": 3,
                                                "output_dir": str(tmp_path / "runs/dppo/seed-3")})


def test_the_dppo_method_takes_its_pruning_from_the_tiny_dppo_preset():
    """One source of truth: the dppo method prunes as `dppo train --preset tiny-dppo` does, plus dense packing."""
    # in the preset's order (chapter 08 prints it)
    assert list(METHOD_OVERRIDES["dppo"].items()) == [
        ("pruning", "dppo"), ("prompt_prune_rate", 0.5), ("prompt_scheme", "posterior"), ("posterior_half_life", 20),
        ("dense_prompts", True), ("min_prompt_keep_prob", 0.2), ("completion_prune_rate", 0.5),
        ("completion_scheme", "length"), ("length_exponent", 1.0), ("min_completion_keep_prob", 0.2),
        ("drop_zero_advantage", True), ("fixed_size_sampling", True), ("fixed_size_design", "sorted"),
        ("packing", True), ("max_tokens_per_row", 128)]
    # dppo_paper is what dppo was, as it was written by hand, in its order
    assert list(METHOD_OVERRIDES["dppo_paper"].items()) == [
        ("pruning", "dppo"), ("prompt_prune_rate", 0.5), ("prompt_scheme", "paper"), ("min_prompt_keep_prob", 0.2),
        ("completion_prune_rate", 0.5), ("completion_scheme", "proportional"), ("min_completion_keep_prob", 0.2),
        ("drop_zero_advantage", True), ("fixed_size_sampling", True), ("packing", True), ("max_tokens_per_row", 128)]
    tiny_grpo, tiny_dppo = preset("tiny-grpo"), preset("tiny-dppo")
    pruning = {k: v for k, v in METHOD_OVERRIDES["dppo"].items() if k not in ("packing", "max_tokens_per_row")}
    assert pruning == bench.DPPO_PRUNING
    assert tiny_grpo.with_overrides(pruning) == tiny_dppo.with_overrides({"output_dir": tiny_grpo.output_dir})


def test_trl_dppo_is_the_dppo_configuration_run_by_trl_without_packing(tmp_path):
    for preset_ in BENCH_PRESETS.values():
        dppo = method_config(preset_, "dppo", 0, tmp_path)
        assert method_config(preset_, "trl_dppo", 0, tmp_path) == dppo.with_overrides(
            {"packing": False, "dense_prompts": False, "output_dir": str(tmp_path / "runs/trl_dppo/seed-0")})
    assert "trl_dppo" in BENCH_PRESETS["cpu-smoke"].methods
    assert "trl_dppo" not in BENCH_PRESETS["cpu-full"].methods  # not in the committed results
    # dppo's own command-line settings carry over to trl_dppo; trl_dppo's come after them
    smoke = BENCH_PRESETS["cpu-smoke"]
    overrides = ["dppo.completion_prune_rate=0.3", "trl_dppo.prompt_prune_rate=0.25"]
    trl = method_config(smoke, "trl_dppo", 0, tmp_path, overrides)
    assert (trl.completion_prune_rate, trl.prompt_prune_rate, trl.packing) == (0.3, 0.25, False)
    assert method_config(smoke, "dppo", 0, tmp_path, overrides).prompt_prune_rate == 0.5
    assert bench.method_settings(BENCH_PRESETS["cpu-full"], "trl_dppo") == {
        **METHOD_OVERRIDES["dppo"], **bench.CPU_BENCH_METHODS.get("dppo", {}), "packing": False, "dense_prompts": False}
    # the peer's trainer gets DPPO's estimator of that configuration; TRL's plain GRPOTrainer gets nothing extra
    from dppo_core.estimator import DPPOEstimator
    from dppo_core.tools.bench.peers import peer_trainer_kwargs

    estimator = peer_trainer_kwargs("trl_dppo", trl)["estimator"]
    assert isinstance(estimator, DPPOEstimator) and estimator.prompt_prune_rate == 0.25
    assert peer_trainer_kwargs("trl_grpo", method_config(smoke, "trl_grpo", 0, tmp_path)) == {}


def test_trl_dppo_without_its_trainer_fails_before_the_first_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "dppo_core.integrations.trl", None)  # the import now raises ImportError
    with pytest.raises(BenchError, match="method 'trl_dppo' needs"):
        run_bench("cpu-smoke", tmp_path, methods=["grpo", "trl_dppo"])
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # importing TRL's trainer imports vLLM: 10-15 s
def test_trl_args_make_a_valid_grpo_config(tmp_path):
    trl = pytest.importorskip("trl")
    config = method_config(BENCH_PRESETS["cpu-smoke"], "trl_grpo", 0, tmp_path)
    args = trl.GRPOConfig(**trl_grpo_args(config, tmp_path / "trl"))
    assert args.generation_batch_size == config.prompts_per_step * config.num_generations
    assert args.steps_per_generation == args.gradient_accumulation_steps  # one generation per optimizer step


def test_overrides_apply_to_every_method_or_to_one(tmp_path):
    preset = BENCH_PRESETS["cpu-smoke"]
    overrides = ["max_steps=5", "dppo.completion_prune_rate=0.3"]
    assert method_config(preset, "grpo", 0, tmp_path, overrides).max_steps == 5
    dppo = method_config(preset, "dppo", 0, tmp_path, overrides)
    assert dppo.max_steps == 5 and dppo.completion_prune_rate == 0.3
    # a shared override cannot change what a method is: the method's settings come after it
    assert method_config(preset, "grpo", 0, tmp_path, ["pruning=dppo"]).pruning == "none"
    with pytest.raises(BenchError, match="'nope' is not a method.*grpo, dppo"):
        method_config(preset, "grpo", 0, tmp_path, ["nope.beta=0"])
    with pytest.raises(ConfigError, match="unknown key"):
        method_config(preset, "grpo", 0, tmp_path, ["learning_rat=1e-3"])


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_unknown_preset_and_method_list_the_valid_ones(tmp_path, capsys):
    with pytest.raises(BenchError, match="unknown bench preset 'nope'; choose one of cpu-smoke, demo, cpu-full"):
        run_bench("nope", tmp_path)
    with pytest.raises(BenchError, match="unknown method.*'ppo'.*grpo, dppo, cppo, greso, trl_grpo"):
        run_bench("cpu-smoke", tmp_path, methods=["grpo", "ppo"])
    with pytest.raises(BenchError, match="include grpo"):
        run_bench("cpu-smoke", tmp_path, methods=["dppo"])
    with pytest.raises(SystemExit):
        cli_main(["bench", "--preset", "nope"])
    assert "cpu-smoke" in capsys.readouterr().err
    assert cli_main(["bench", "--preset", "cpu-smoke", "--methods", "ppo", "--output-dir", str(tmp_path)]) == 2
    assert "trl_grpo" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "nothing ran"


def test_cli_takes_overrides_that_follow_a_list_option(monkeypatch, tmp_path):
    seen = {}

    def fake_run_bench(name, output_dir, **kwargs):
        seen.update(kwargs, name=name)
        raise BenchError("stop here")

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    argv = ["bench", "--preset", "cpu-full", "--seeds", "0", "3", "max_steps=5", "--methods", "grpo", "dppo",
            "dppo.beta=0", "--output-dir", str(tmp_path)]
    assert cli_main(argv) == 2
    assert seen["name"] == "cpu-full" and seen["seeds"] == [0, 3] and seen["methods"] == ["grpo", "dppo"]
    assert seen["overrides"] == ["max_steps=5", "dppo.beta=0"]
    assert cli_main(["bench", "--seeds", "zero", "--output-dir", str(tmp_path)]) == 2


def test_summarize_without_finished_runs_says_which_are_missing(tmp_path):
    with pytest.raises(BenchError, match="runs not finished.*grpo/seed-0.*--resume"):
        bench.write_bench(tmp_path, "cpu-smoke", ["grpo", "dppo"], (0,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_the_gpu_preset_refuses_to_start_without_a_gpu(tmp_path):
    with pytest.raises(BenchError, match="'gpu-qwen3' needs a CUDA GPU.*cpu-smoke"):
        run_bench("gpu-qwen3", tmp_path)
    assert not (tmp_path / "runs").exists()


def test_trl_missing_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    with pytest.raises(BenchError, match=r"pip install 'dppo-core\[bench\]'"):
        bench.require_trl()
    with pytest.raises(BenchError, match="needs Hugging Face TRL"):
        run_bench("cpu-smoke", tmp_path, methods=["grpo", "trl_grpo"])
    assert not (tmp_path / "runs").exists(), "the check comes before the first run"


def test_trl_refuses_what_it_cannot_run(tmp_path):
    preset = BENCH_PRESETS["cpu-smoke"]
    with pytest.raises(BenchError, match="plain GRPO"):
        trl_grpo_args(method_config(preset, "dppo", 0, tmp_path), tmp_path)
    with pytest.raises(BenchError, match="full or lora"):
        trl_grpo_args(method_config(preset, "trl_grpo", 0, tmp_path, ["update_mode=qlora4"]), tmp_path)
    # trl_dppo takes the pruning (through DPPO's estimator) but not the packing: TRL pads its batches
    trl_grpo_args(method_config(preset, "trl_dppo", 0, tmp_path), tmp_path, "trl_dppo")
    with pytest.raises(BenchError, match="trl_dppo trains TRL's padded batches"):
        trl_grpo_args(method_config(preset, "dppo", 0, tmp_path), tmp_path, "trl_dppo")


# --------------------------------------------------------------------------------------------------
# The fixed training pool (config knob train_pool_size)
# --------------------------------------------------------------------------------------------------


def test_training_pool_is_fixed_a_prefix_and_balanced_by_level():
    big = build_prompt_source(DPPOConfig(train_pool_size=256, seed=0))
    other_seed = build_prompt_source(DPPOConfig(train_pool_size=256, seed=5))
    small = build_prompt_source(DPPOConfig(train_pool_size=64))
    ids = [r["id"] for r in big.rows]
    assert len(set(ids)) == 256 and big.weights is None  # distinct prompts, sampled uniformly
    assert ids == [r["id"] for r in other_seed.rows], "the pool does not depend on the run's seed"
    assert [r["id"] for r in small.rows] == ids[:64]
    counts = {lvl: sum(r["level"] == lvl for r in big.rows) for lvl in (2, 3, 4, 5)}
    assert all(40 <= n <= 90 for n in counts.values()), counts  # level weights are uniform: ~64 each
    # steps draw only from the pool
    assert {r["id"] for s in range(20) for r in big.sample(0, s, 32)} <= set(ids)
    weighted = build_prompt_source(DPPOConfig(train_pool_size=100, train_levels=(2, 3), level_weights=(1.0, 0.0)))
    assert {r["level"] for r in weighted.rows} == {2}, "a level of weight 0 is never in the pool"


def test_training_pool_size_errors_say_how_to_fix():
    with pytest.raises(ConfigError, match="train_pool_size=0: .*at least 1 prompt.*null"):
        DPPOConfig(train_pool_size=0)
    with pytest.raises(ConfigError, match=r"train_pool_size=100000: the training set has \d+ prompts; give 1 to"):
        build_prompt_source(DPPOConfig(train_pool_size=100_000))
    assert DPPOConfig().with_overrides(["train_pool_size=null"]).train_pool_size is None


def test_committed_result_is_found_from_any_subdirectory_of_the_checkout(tmp_path, monkeypatch):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x.json").write_text('{"a": 1}')
    deep = tmp_path / "notebooks" / "runs"
    deep.mkdir(parents=True)
    assert bench.committed_result("benchmarks/results/x.json", start=deep) == '{"a": 1}'
    monkeypatch.chdir(deep)
    assert bench.committed_result("benchmarks/results/x.json") == '{"a": 1}'


def test_committed_result_outside_a_checkout_reads_the_packaged_snapshot_and_never_the_network(tmp_path, monkeypatch):
    """Opened alone (Colab, a workshop laptop): the file comes from the snapshot dppo_core ships, a checkout's own
    file wins over it, and a file in neither place is a one-line FileNotFoundError saying what to do."""
    import socket
    import urllib.request

    from dppo_core.tools import course

    def no_network(*args, **kwargs):
        raise AssertionError("committed_result tried the network")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    assert not hasattr(bench, "REPOSITORY_RAW_URL") and not hasattr(bench.report, "REPOSITORY_RAW_URL")
    here = tmp_path / "colab"
    here.mkdir()
    # the real snapshot: the committed file, byte for byte
    relative = "benchmarks/results/cpu-peers/bench.json"
    repository = Path(__file__).resolve().parents[2]
    assert bench.committed_result(relative, start=here) == (repository / relative).read_text()
    # a snapshot of its own, and a checkout whose file comes first
    snapshot = tmp_path / "snapshot"
    (snapshot / "benchmarks").mkdir(parents=True)
    (snapshot / "benchmarks" / "y.md").write_text("from the package")
    monkeypatch.setattr(course, "RESULTS", snapshot)
    assert bench.committed_result("benchmarks/y.md", start=here) == "from the package"
    (here / "benchmarks").mkdir()
    (here / "benchmarks" / "y.md").write_text("from the checkout")
    assert bench.committed_result("benchmarks/y.md", start=here) == "from the checkout"
    with pytest.raises(FileNotFoundError) as err:
        bench.committed_result("benchmarks/missing.json", start=here)
    message = str(err.value)
    assert "\n" not in message and "benchmarks/missing.json" in message and str(snapshot) in message
    assert "clone of the repository" in message and "python -m dppo_core.tools.course --sync-results" in message


def test_the_strong_baselines_and_pods_are_what_their_names_say(tmp_path):
    preset, peers = BENCH_PRESETS["cpu-baselines"], BENCH_PRESETS["cpu-peers"]
    grpo, skip, half, pods = (method_config(peers, m, 1, tmp_path) for m in ("grpo", "grpo_skip", "grpo_half", "pods"))
    # the two presets' grpo and grpo_skip runs are the same runs
    for m in ("grpo", "grpo_skip"):
        assert method_config(preset, m, 1, tmp_path) == method_config(peers, m, 1, tmp_path)
    assert preset.methods == ("grpo", "grpo_skip", "dppo_paper", "dppo")
    assert set(peers.methods) & set(preset.methods) == {
        "grpo", "grpo_skip"}
    # grpo_skip: the estimator with nothing pruned but the completions whose loss is identically zero (beta 0)
    assert skip.pruning == "dppo" and skip.prompt_prune_rate == skip.completion_prune_rate == 0.0
    assert skip.drop_zero_advantage and skip.beta == 0.0 and skip.packing
    assert half.prompts_per_step == grpo.prompts_per_step // 2 and half.pruning == "none"
    assert pods.pruning == "pods" and pods.completion_prune_rate == 0.5 and pods.prompt_prune_rate == 0.0
    assert preset.seeds == (1, 2, 3, 4, 5) and 0 not in preset.seeds  # seed 0 tuned cpu-full's DPPO rate


def test_paired_speedups_are_geometric_means_with_a_t_interval():
    def run(seed, step, wall, ttt):
        return {"seed": seed, "step_time_s": {"median": step}, "wall_s": wall, "time_to_target_s": ttt}

    runs = {"grpo": [run(1, 2.0, 100.0, 80.0), run(2, 2.0, 100.0, 60.0), run(3, 2.0, 100.0, 90.0)],
            "dppo": [run(1, 1.0, 50.0, 40.0), run(2, 0.5, 40.0, None), run(3, 1.0, 25.0, 45.0)]}
    out = bench.paired_speedups(runs, "grpo")
    step = out["dppo"]["step_time"]
    assert step["per_seed"] == [2.0, 4.0, 2.0] and step["n"] == 3
    logs = [math.log(2), math.log(4), math.log(2)]
    mean, sd = sum(logs) / 3, statistics.stdev(logs)
    assert math.isclose(step["mean"], math.exp(mean))
    assert math.isclose(step["low"], math.exp(mean - 4.303 * sd / math.sqrt(3)))
    assert math.isclose(step["high"], math.exp(mean + 4.303 * sd / math.sqrt(3)))
    ttt = out["dppo"]["time_to_target"]  # seed 2 missed the target: no ratio for it
    assert ttt["per_seed"] == [2.0, 2.0] and ttt["n"] == 2 and ttt["missing"] == 1 and math.isclose(ttt["low"], 2.0)
    assert out["grpo"]["wall"]["mean"] == 1.0
    single = bench.paired_speedups({"grpo": runs["grpo"][:1], "dppo": runs["dppo"][:1]}, "grpo")
    assert single["dppo"]["wall"]["low"] is None and single["dppo"]["wall"]["mean"] == 2.0
    text = "\n".join(bench.tables.format_intervals({"speedup_intervals": {"grpo": out}}))
    assert "| `dppo` | 2.52x [" in text and "(n=3)" in text and "(n=2, 1 missed)" in text and "| `grpo` |" not in text


def test_interpolated_time_to_target_and_accuracy_at_a_time():
    curve = [{"train_s": 0.0, "sampled_accuracy": 0.5}, {"train_s": 10.0, "sampled_accuracy": 0.6},
             {"train_s": 20.0, "sampled_accuracy": 0.7}]
    assert bench.time_to_target(curve, 0.65) == pytest.approx(15.0)
    assert bench.time_to_target(curve, 0.5) == 0.0 and bench.time_to_target(curve, 0.71) is None
    assert not hasattr(bench, "crossing_time")  # one definition of the time to target
    assert bench.accuracy_at_time(curve, 5.0) == pytest.approx(0.55)
    assert bench.accuracy_at_time(curve, 50.0) == 0.7 and bench.accuracy_at_time(curve, -1.0) == 0.5


def test_speedups_vs_a_baseline_with_bootstrap_intervals_and_accuracy_at_equal_time():
    def run(seed, times, accs):
        curve = [{"train_s": t, "sampled_accuracy": a} for t, a in zip(times, accs, strict=True)]
        return {"seed": seed, "curve": curve, "wall_s": times[-1], "accuracy": {"after": accs[-1]}}

    runs = {"grpo_skip": [run(s, [0, 50, 100], [0.5, 0.7, 0.8]) for s in (1, 2, 3)],
            "dppo": [run(1, [0, 25, 50], [0.5, 0.7, 0.78]), run(2, [0, 20, 40], [0.5, 0.7, 0.8]),
                     run(3, [0, 30, 60], [0.5, 0.6, 0.7])]}
    out = bench.speedups_vs(runs, "grpo_skip", draws=500)
    d = out["dppo"]
    at95 = d["by_target"]["0.95"]  # target 0.76: grpo_skip at 80 s on each seed; dppo at 43.75 s, 32 s, missed
    assert at95["target"] == pytest.approx(0.76) and at95["n"] == 2 and at95["missed"] == 1
    assert at95["time_to_target"] == pytest.approx(160 / 75.75)
    lo, hi = at95["ci95"]  # the extreme resamples: seed 1 twice, seed 2 twice
    assert lo <= at95["time_to_target"] <= hi and lo == pytest.approx(80 / 43.75) and hi == pytest.approx(2.5)
    assert d["time_to_target"] == at95["time_to_target"] and d["target_fraction"] == 0.95
    at90 = d["by_target"]["0.90"]  # target 0.72
    assert at90["n"] == 2 and at90["missed"] == 1
    # at grpo_skip's 100 s every dppo run has finished: its final accuracy, mean over seeds
    assert d["accuracy_at_equal_time"] == pytest.approx((0.78 + 0.8 + 0.7) / 3)
    assert out["grpo_skip"]["time_to_target"] == pytest.approx(1.0)
    text = "\n".join(bench.tables.format_speedups_vs({"speedup_vs": {"grpo_skip": out}}))
    assert "| `dppo` | " in text and "1 missed" in text and "to 95% target" in text


def test_summarize_run_counts_learning_per_cost():
    metrics = [{"step": 1, "step_time": 1.0, "weight_ess": 10.0, "grad_norm": 0.5, "update_density": 0.5,
                "update_capacity": 100},
               {"step": 2, "step_time": 1.0, "weight_ess": 20.0, "grad_norm": 1.5, "update_density": 0.25,
                "update_capacity": 40}]
    run = bench.summarize_run(metrics, [], max_grad_norm=1.0)
    assert run["ess_per_step"] == 15.0 and run["clip_rate"] == 0.5 and run["grad_norm_median"] == 1.0
    assert run["tokens"]["update_real"] == 60
    assert bench.summarize_run(metrics, [])["clip_rate"] is None
    assert bench.summarize_run([{"step": 1, "step_time": 1.0}], [])["ess_per_step"] is None
