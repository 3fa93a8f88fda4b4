"""The embedded arithmetic task: answers, worked solutions, split and sampling."""

import random
import re

import pytest

from dppo_core.tasks import LEVELS, ArithmeticTask, Problem, parse_boxed_int, uses_steps


@pytest.fixture(scope="module")
def task():
    return ArithmeticTask()


def _eval(expr: str) -> int:
    assert re.fullmatch(r"[0-9+\-*()]+", expr), expr
    return eval(expr)  # the expression alphabet is checked above


def test_every_answer_is_the_expression_value(task):
    for level in LEVELS:
        for p in task.train(level) + task.test(level):
            assert p.answer == _eval(p.question), p


@pytest.mark.parametrize("style", ["steps", "direct"])
def test_every_solution_boxes_the_right_answer(task, style):
    for level in LEVELS:
        for p in task.train(level) + task.test(level):
            assert parse_boxed_int(p.solution(style)) == p.answer, (p, p.solution(style))


def test_every_worked_step_is_true_arithmetic(task):
    """Each 'x=y.' step of a worked solution is a correct equation (so steps never teach wrong facts)."""
    rng = random.Random(0)
    for level in LEVELS:
        for p in rng.sample(task.train(level), min(300, len(task.train(level)))):
            for lhs, rhs in re.findall(r"([0-9+\-*()]+)=(-?\d+)\.", p.solution("steps")):
                assert _eval(lhs) == int(rhs), (p, lhs, rhs)


def test_every_level_has_a_worked_and_a_direct_form(task):
    for level in LEVELS:
        for p in task.train(level)[:20]:
            assert uses_steps(p.solution("steps")), p.solution("steps")
            assert p.solution("steps").startswith(f"{p.question}: ")
            assert not uses_steps(p.solution("direct"))
    assert Problem(1, "7+5", 12).solution("steps") == "7+5: 7+5=12. \\boxed{12}"
    assert Problem(1, "0+0", 0).solution("steps") == "0+0: 0+0=0. \\boxed{0}"


def test_split_is_disjoint_fixed_and_about_the_configured_size(task):
    for level in LEVELS:
        train = {p.question for p in task.train(level)}
        test = {p.question for p in task.test(level)}
        assert not train & test
        share = len(test) / (len(train) + len(test))
        assert 0.1 < share < 0.3, (level, share)
    again = ArithmeticTask()
    assert [p.id for p in again.test_set(50)] == [p.id for p in task.test_set(50)]


def test_levels_span_one_step_to_multi_step(task):
    """Level 1 is a single step, levels 2-4 one or two, level 5 the most."""
    mean_steps = []
    for level in LEVELS:
        ps = task.train(level)
        mean_steps.append(sum(p.solution("steps").count("=") for p in ps) / len(ps))
    assert mean_steps[0] == 1
    assert all(1 <= m <= 3 for m in mean_steps[1:4]), mean_steps
    assert mean_steps[4] > max(mean_steps[1:4]) and mean_steps[4] >= 3


def test_sample_train_is_reproducible_and_respects_weights(task):
    a = task.sample_train(random.Random(1), 200, [1, 0, 0, 0, 1])
    b = task.sample_train(random.Random(1), 200, [1, 0, 0, 0, 1])
    assert a == b
    assert {p.level for p in a} == {1, 5}
    assert all(not p.is_test for p in a)


def test_bad_arguments_name_the_problem(task):
    with pytest.raises(ValueError, match="level_weights"):
        task.sample_train(random.Random(0), 3, [1, 1])
    with pytest.raises(ValueError, match="levels"):
        ArithmeticTask(levels=[0, 9])
    with pytest.raises(ValueError, match="style"):
        Problem(1, "1+1", 2).solution("verbose")


def test_record_is_conversational():
    rec = Problem(3, "75+72", 147).to_record()
    assert rec["answer"] == "147" and rec["level"] == 3
    assert rec["prompt"][0]["role"] == "user" and "\\boxed{}" in rec["prompt"][0]["content"]


@pytest.mark.parametrize(
    "text, expected",
    [("\\boxed{147}", 147), ("a \\boxed{1} then \\boxed{-2}", -2), ("\\boxed{ 3 }", 3),
     ("no answer", None), ("\\boxed{1.5}", None), ("\\boxed{12", None)],
)
def test_parse_boxed_int(text, expected):
    assert parse_boxed_int(text) == expected
