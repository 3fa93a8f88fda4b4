"""Benchmark loading (local files, errors, name resolution) and the reward on real benchmark answers."""

from __future__ import annotations

import json
import re

import pytest

from dppo_core.benchmark_data import (
    BENCHMARKS,
    BOX_INSTRUCTION,
    EVAL_SUITE,
    BenchmarkRecord,
    load_benchmark,
    read_jsonl,
)
from dppo_core.grading import extract_answer, parse_number, parse_written_number
from dppo_core.rewards import math_reward, math_rewards

SIZES = {"gsm8k": 1319, "math500": 500, "aime24": 30, "amc23": 40, "minerva_math": 272, "olympiadbench": 674}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_gsm8k_answer_is_normalised(tmp_path):
    write_jsonl(tmp_path / "gsm8k_test.jsonl", [
        {"question": "How many?", "answer": "3 * 700 = <<3*700=2100>>2,100\n#### 2,100"},
    ])
    [rec] = load_benchmark("gsm8k", data_dir=tmp_path)
    assert rec == BenchmarkRecord(problem="How many?", answer="2100", id="gsm8k-0", source="gsm8k",
                                  solution="3 * 700 = <<3*700=2100>>2,100\n#### 2,100")
    assert rec.prompt.endswith(BOX_INSTRUCTION)  # GSM8K gets the instruction to box the answer
    assert rec.messages() == [{"role": "user", "content": rec.prompt}]


def test_problem_that_asks_for_a_box_is_left_alone(tmp_path):
    p = write_jsonl(tmp_path / "mine.jsonl", [{"problem": "1+1? Put it in \\boxed{}.", "answer": "2"}, ""])
    [rec] = load_benchmark(p)  # a path; blank lines are skipped
    assert (rec.source, rec.id, rec.prompt) == ("mine", "mine-0", "1+1? Put it in \\boxed{}.")


def test_env_var_and_limit(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "aime24_test.jsonl", [{"problem": f"p{i}", "answer": str(i)} for i in range(5)])
    monkeypatch.setenv("DPPO_DATA_DIR", str(tmp_path))
    assert [r.answer for r in load_benchmark("aime24", limit=2)] == ["0", "1"]


def test_missing_file(tmp_path, monkeypatch):
    monkeypatch.delenv("DPPO_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="math500_test.jsonl"):
        load_benchmark("math500", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_benchmark(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="hub=False"):
        load_benchmark("math500", hub=False)


def test_malformed_line_names_its_number(tmp_path):
    p = write_jsonl(tmp_path / "amc23_test.jsonl", [{"problem": "a", "answer": "1"}, "{not json"])
    with pytest.raises(ValueError, match=r"amc23_test.jsonl:2: not valid JSON"):
        read_jsonl(p)


def test_missing_field_names_the_field(tmp_path):
    p = write_jsonl(tmp_path / "amc23_test.jsonl", [{"problem": "a"}])
    with pytest.raises(ValueError, match=r":1: missing field 'answer'"):
        read_jsonl(p)
    p = write_jsonl(tmp_path / "gsm8k_test.jsonl", [{"question": "a", "answer": "no hashes"}])
    with pytest.raises(ValueError, match=r":1: a GSM8K answer must end in '#### <number>'"):
        read_jsonl(p)


def test_unknown_name_and_directory(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        load_benchmark("gsm9k")
    with pytest.raises(ValueError, match="is a directory"):
        load_benchmark(tmp_path)


# ---------------------------------------------------------------------------------------------------
# Real benchmark data (skipped when ../shared is absent)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite(benchmarks_dir):
    return {name: load_benchmark(name, data_dir=benchmarks_dir) for name in EVAL_SUITE}


def test_every_set_loads(suite):
    assert {name: len(records) for name, records in suite.items()} == SIZES
    for records in suite.values():
        assert all(r.problem and r.answer for r in records)
        assert "\\boxed" in records[0].prompt


@pytest.mark.parametrize("name", EVAL_SUITE)
def test_reference_answers_verify_against_themselves(suite, name):
    records = suite[name]
    rewards = math_rewards([f"So the final answer is \\boxed{{{r.answer}}}." for r in records],
                           [r.answer for r in records])
    misses = [r.answer for r, x in zip(records, rewards, strict=True) if x != 1.0]
    assert not misses


def test_math500_solutions_agree_with_answers(suite, benchmarks_dir):
    solutions = read_jsonl(benchmarks_dir / "math500_solutions.jsonl")
    by_problem = {s.problem.strip(): s for s in solutions}
    tests = suite["math500"]
    pairs = [(by_problem[t.problem.replace(BOX_INSTRUCTION, "").strip()], t) for t in tests]
    rewards = math_rewards([s.solution for s, _ in pairs], [t.answer for _, t in pairs])
    misses = [(t.id, extract_answer(s.solution), t.answer)
              for (s, t), x in zip(pairs, rewards, strict=True) if x != 1.0]
    assert len(misses) <= 0.01 * len(tests), misses


def test_gsm8k_solutions_score_one(suite):
    records = suite["gsm8k"]
    assert math_rewards([r.solution for r in records], [r.answer for r in records]) == [1.0] * len(records)


def _perturbations(answer: str) -> list[str]:
    """Wrong answers near a right one: off by one (by one unit in the last written place for a rounded
    decimal such as 4.5e33, which 4.5e33 + 1 rounds to), wrong sign, another fraction."""
    value = parse_number(answer)
    written = parse_written_number(answer)
    out = []
    if written is not None and written.ulp is not None:
        out.append(str(value + written.ulp))
    elif value is not None and value.denominator == 1:
        out.append(str(value + 1))
    if value:
        out.append(str(-value))
    m = re.fullmatch(r"\\frac\{(\d+)\}\{(\d+)\}", answer)
    if m:
        out.append(f"\\frac{{{int(m.group(1)) + 1}}}{{{m.group(2)}}}")
    return out


def test_perturbed_answers_score_zero(suite):
    completions, answers = [], []
    for records in suite.values():
        for r in records:
            for wrong in _perturbations(r.answer):
                completions.append(f"\\boxed{{{wrong}}}")
                answers.append(r.answer)
    assert len(completions) > 2000
    rewards = math_rewards(completions, answers)
    hits = [(c, a) for c, a, x in zip(completions, answers, rewards, strict=True) if x != 0.0]
    assert not hits


def test_wrong_sign_of_symbolic_answers_scores_zero(suite):
    # answers that are not plain numbers go to the symbolic path
    records = [r for r in suite["math500"] if parse_number(r.answer) is None and "," not in r.answer
               and "=" not in r.answer and "\\text" not in r.answer and "\\begin" not in r.answer][:30]
    rewards = math_rewards([f"\\boxed{{-({r.answer})}}" for r in records], [r.answer for r in records])
    assert sum(rewards) == 0.0


def test_known_names_cover_the_suite():
    assert set(EVAL_SUITE) <= set(BENCHMARKS)
    assert math_reward("\\boxed{3}", "3") == 1.0
