"""pass@k, benchmark evaluation with any engine, and `dppo eval` on the untrained tiny model."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from dppo_core.benchmark_data import BenchmarkRecord
from dppo_core.evaluate import evaluate_benchmarks, pass_at_k
from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup
from dppo_core.tools.cli import main


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 2), (5, 2, 3), (5, 3, 3), (5, 5, 5), (10, 1, 4)])
def test_pass_at_k_equals_brute_force(n, c, k):
    # the share of all k-subsets of the n samples that contain at least one correct sample
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


class ScriptedEngine:
    """An engine that answers from a script: prompt text -> list of completions, cycled."""

    name = "scripted"

    def __init__(self, script):
        self.script = script
        self.calls = []

    def generate(self, prompts, num_generations=1, sampling=None):
        self.calls.append(sampling)
        groups = []
        for p in prompts:
            texts = itertools.cycle(self.script[p[-1]["content"].split("\n")[0]])
            comps = [Completion([1, 2], next(texts), [0.0, 0.0], "stop") for _ in range(num_generations)]
            groups.append(RolloutGroup(p, [0], comps))
        return RolloutBatch(groups)


def test_evaluate_benchmarks_with_any_engine():
    recs = [BenchmarkRecord(f"q{i}", str(i), f"toy-{i}", "toy") for i in range(3)]
    script = {"q0": ["\\boxed{0}"], "q1": ["\\boxed{1}", "\\boxed{9}"], "q2": ["no idea"]}
    ev = evaluate_benchmarks(ScriptedEngine(script), {"toy": recs, "toy2": recs[:1]}, samples_per_problem=4,
                             ks=(2,), temperature=1.0, progress=False, chunk_size=2)
    r = ev.results["toy"]
    assert r.pass_at[1] == pytest.approx((1 + 0.5 + 0) / 3)
    assert r.pass_at[2] == pytest.approx((1 + pass_at_k(4, 2, 2) + 0) / 3)
    assert ev.results["toy2"].pass_at[1] == 1.0
    assert ev.average(1) == pytest.approx((r.pass_at[1] + 1.0) / 2)
    assert len(ev.completions) == 4 * 4 and ev.completions[0]["reward"] == 1.0
    assert "average" in ev.table() and "pass@2" in ev.table()
    json.dumps(ev.to_dict())  # serialisable
    with pytest.raises(ValueError, match="greedy"):
        evaluate_benchmarks(ScriptedEngine(script), {"toy": recs}, samples_per_problem=2, temperature=0.0)


def test_dppo_eval_on_the_tiny_model(tiny_model_dir, benchmarks_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(tiny_model_dir), "--benchmarks", "gsm8k", "--limit", "20",
               "--max-tokens", "32", "--data-dir", str(benchmarks_dir), "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["results"]["gsm8k"]["n_problems"] == 20
    assert 0.0 <= result["average"]["pass@1"] <= 1.0
    assert len(result["completions"]) == 20
    assert result["settings"]["max_tokens"] == 32
    assert "gsm8k" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [[], ["--extraction", "strict"]])
def test_dppo_eval_says_which_extraction(tiny_model_dir, tmp_path, capsys, flag):
    """The verifier's answer extraction (tests/unit/test_verifier.py), as `dppo eval` reports it."""
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--benchmarks", str(data), "--max-tokens", "4",
                 "--output", str(out), *flag]) == 0
    mode = flag[1] if flag else "lenient"
    assert f"answer extraction: {mode}" in capsys.readouterr().out
    assert json.loads(out.read_text())["settings"]["extraction"] == mode
