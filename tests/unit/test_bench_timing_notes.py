"""The bench's table says when its speed columns cannot be trusted, and prints no spread for one seed.

A busy machine (load average above the core count as the runs start) or a run whose step times vary widely (their
interquartile range above ``SPREAD_LIMIT`` times their median) adds a "timing note"; a quiet one adds nothing. With
one seed the final accuracy reads ``± n/a``, not ``± 0.000``.
"""

from __future__ import annotations

import json
import os

import pytest

from dppo_core.tools import bench
from dppo_core.tools.bench import report


def _write_run(root, method, seed, step_times, accs=(0.40, 0.50, 0.60), machine="m"):
    d = bench.run_dir(root, method, seed)
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"machine": machine, "elapsed_s": 1.0}))
    (d / "config.json").write_text(json.dumps({"seed": seed, "output_dir": str(d)}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time": t, "tokens_generated": 100,
                                                         "tokens_trained": 50}) + "\n"
                                             for s, t in enumerate(step_times, 1)))
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": 4 * k, "sampled_accuracy": a}) + "\n"
                                          for k, a in enumerate(accs)))


QUIET = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.1]
DISTURBED = [1.0, 3.2, 0.9, 2.8, 1.0, 3.5, 1.0, 2.9]          # something else took the CPUs half the time


def _bench(tmp_path, dppo_times=QUIET, seeds=(0,)):
    for s in seeds:
        _write_run(tmp_path, "grpo", s, QUIET)
        _write_run(tmp_path, "dppo", s, [t / 2 for t in dppo_times])
    return bench.summarize_bench(tmp_path, "mine", ("grpo", "dppo"), seeds)


def test_step_time_spread_is_the_interquartile_range_over_the_median():
    assert report.step_time_spread([{"step_time": t} for t in QUIET]) < 0.2
    assert report.step_time_spread([{"step_time": t} for t in DISTURBED]) > report.SPREAD_LIMIT
    assert report.step_time_spread([{"step_time": 1.0}] * 3) is None      # too few steps to say
    assert report.step_time_spread([{"step": 1}, {"step_time": 2.0}] * 3) is None


def test_a_quiet_bench_has_no_note_and_one_seed_prints_n_a(tmp_path):
    result = _bench(tmp_path)
    table = bench.format_table(result, load=(0.3, 2))
    assert "timing note" not in table and "can be off" not in table, table
    rows = table.splitlines()[1:3]
    assert all(" ± n/a " in row and "± 0.000" not in row for row in rows), rows
    assert "± n/a: one seed" in table


def test_two_seeds_print_the_spread_over_seeds(tmp_path):
    table = bench.format_table(_bench(tmp_path, seeds=(0, 1)), load=(0.3, 2))
    assert "n/a" not in table and " ± 0.000 " in table.splitlines()[1], table


def test_a_busy_machine_is_noted(tmp_path):
    table = bench.format_table(_bench(tmp_path), load=(3.4, 2))
    assert "timing note: the machine was busy as the runs started (load average 3.4 over the last minute, 2 CPUs)" \
        in table, table
    assert "accuracies and token counts are not affected" in table
    assert "timing note" not in bench.format_table(_bench(tmp_path / "b"), load=(2.0, 2))    # at the count: not busy


def test_a_run_with_widely_spread_step_times_is_noted(tmp_path):
    result = _bench(tmp_path, dppo_times=DISTURBED)
    spread = next(r["step_time_spread"] for r in result["runs"] if r["method"] == "dppo")
    table = bench.format_table(result)
    assert f"timing note: step times vary widely within dppo seed 0 ({spread:.2f})" in table, table
    assert "grpo seed 0" not in table.split("timing note", 1)[1]


def test_a_bench_resumed_on_another_machine_names_each_with_its_seeds(tmp_path):
    """Each seed's runs compare on one machine; the bench says which seeds ran where (the first machine alone
    would pass the resumed seeds off as its own)."""
    assert _bench(tmp_path / "one", seeds=(0, 1))["machine"] == "m"
    for seed, machine in ((1, "AMD"), (2, "AMD"), (3, "Intel")):
        for method in ("grpo", "dppo"):
            _write_run(tmp_path / "two", method, seed, QUIET, machine=machine)
    result = bench.summarize_bench(tmp_path / "two", "mine", ("grpo", "dppo"), (1, 2, 3))
    assert result["machine"] == "AMD (seeds 1, 2) | Intel (seed 3)"
    assert "Machine: AMD (seeds 1, 2) | Intel (seed 3)." in bench.format_markdown(result)


def test_machine_load_reads_the_load_average():
    load = report.machine_load()
    if not hasattr(os, "getloadavg"):
        assert load is None
        return
    assert load is not None and load[0] >= 0 and load[1] == os.cpu_count()


@pytest.mark.parametrize("name", ["cpu-baselines", "cpu-own-best"])
def test_a_committed_bench_prints_as_before(name):
    """A bench.json written before the spread was recorded: no note, and its tables (chapter 08 prints one) keep
    their lines."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name / "bench.json"
    table = bench.format_table(json.loads(path.read_text()))
    assert "timing note" not in table and "n/a" not in table
