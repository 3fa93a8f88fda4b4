"""``evaluate_policy``: the one evaluation of a training run, used by the trainer and by ``dppo bench`` (for
our trainer's runs and TRL's): its record on the embedded task and on benchmarks, and that it is the
trainer's own evaluation."""

from __future__ import annotations

import json

import pytest

from dppo_core.config import DPPOConfig
from dppo_core.evaluate import evaluate_policy
from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup
from dppo_core.tasks import ArithmeticTask


class AnswerEngine:
    """Answers every problem whose prompt is in ``right`` correctly and every other one wrongly."""

    name = "answers"

    def __init__(self, right: dict[str, str], wrong: str = "\\boxed{-12345}"):
        self.right, self.wrong = right, wrong
        self.calls: list[tuple[int, float]] = []

    def generate(self, prompts, num_generations=1, sampling=None):
        self.calls.append((num_generations, sampling.temperature))
        groups = []
        for p in prompts:
            text = self.right.get(p[-1]["content"], self.wrong)
            comps = [Completion([1, 2], text, [0.0, 0.0], "stop") for _ in range(num_generations)]
            groups.append(RolloutGroup(p, [0], comps))
        return RolloutBatch(groups)


def test_the_embedded_task_record_has_every_level_and_the_mean_over_the_trained_ones():
    config = DPPOConfig(train_levels=(2, 3), eval_levels=(1, 2, 3), eval_problems_per_level=5, eval_samples=3)
    task = ArithmeticTask((1, 2, 3))
    right = {p.messages()[-1]["content"]: f"\\boxed{{{p.answer}}}" for lvl in (1, 2) for p in task.test(lvl, 5)}
    engine = AnswerEngine(right)
    record = evaluate_policy(config, engine, 7)
    kinds = ("greedy", "sampled")
    assert set(record) == {"step"} | {f"{k}_{name}" for k in kinds for name in (
        "accuracy", "stderr", "steps_share", "L1", "L1_stderr", "L2", "L2_stderr", "L3", "L3_stderr")}
    assert record["step"] == 7
    for k in kinds:
        assert (record[f"{k}_L1"], record[f"{k}_L2"], record[f"{k}_L3"]) == (1.0, 1.0, 0.0)
        assert record[f"{k}_accuracy"] == 0.5  # the trained levels 2 and 3; level 1 is only watched
        assert record[f"{k}_stderr"] == 0.0 and record[f"{k}_steps_share"] == 0.0
    assert engine.calls == [(1, 0.0), (3, 1.0)]  # greedy once per problem, then eval_samples at T=1


def test_benchmarks_give_pass_at_1_per_benchmark_and_their_mean(tmp_path):
    path = tmp_path / "toy.jsonl"
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from dppo_core.benchmark_data import load_benchmark

    records = load_benchmark(path)
    right = {r.messages()[-1]["content"]: f"\\boxed{{{r.answer}}}" for r in records[:1]}
    config = DPPOConfig(task=str(path), eval_samples=2)
    record = evaluate_policy(config, AnswerEngine(right), 3, benchmarks=[str(path)], benchmark_limit=2)
    assert record["step"] == 3
    assert record["greedy_accuracy"] == record["sampled_accuracy"] == pytest.approx(0.5)  # 1 of the first 2
    assert record[f"greedy_{path}"] == pytest.approx(0.5) and record[f"sampled_{path}_stderr"] == pytest.approx(0.5)
    # without benchmarks a task other than the embedded one has nothing to evaluate
    assert evaluate_policy(config, AnswerEngine({}), 3) == {"step": 3}


def test_it_is_the_trainers_own_evaluation(small_model_dir, tmp_path):
    """DPPOTrainer.evaluate and evaluate_policy on the trainer's policy give the same record, to the last bit."""
    from dppo_core.rollout import HFRollout
    from dppo_core.trainer import DPPOTrainer

    config = DPPOConfig(model=str(small_model_dir), output_dir=str(tmp_path), train_levels=(2, 3),
                        eval_levels=(1, 2, 3), eval_problems_per_level=3, eval_samples=2, max_completion_length=8)
    trainer = DPPOTrainer(config, progress=False)
    assert trainer.evaluate() == evaluate_policy(config, HFRollout(trainer.model, trainer.tokenizer), trainer.step)


class _Terminal:
    """A stand-in stderr that says it is a terminal (tqdm shows its bar only on one)."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


def test_progress_bars_show_on_a_terminal_and_are_quiet_elsewhere(monkeypatch, capsys):
    """An evaluation asked for progress shows a bar per pass on a terminal, and nothing in a log, CI or a test."""
    import sys

    config = DPPOConfig(train_levels=(2,), eval_problems_per_level=3, eval_samples=1)
    evaluate_policy(config, AnswerEngine({}), step=0, progress=True)
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    evaluate_policy(config, AnswerEngine({}), step=0, progress=True)
    assert "eval greedy" in terminal.text and "eval T=1" in terminal.text and "3/3" in terminal.text
    terminal.text = ""
    evaluate_policy(config, AnswerEngine({}), step=0, progress=False)
    assert terminal.text == ""
