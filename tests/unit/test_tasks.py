"""The embedded arithmetic task: answers, worked solutions, split and sampling."""

import hashlib
import random
import re

import pytest

from dppo_core.tasks import ALL_LEVELS, EXTRA_LEVELS, LEVELS, ArithmeticTask, Problem, parse_boxed_int, uses_steps


@pytest.fixture(scope="module")
def task():
    return ArithmeticTask(ALL_LEVELS)


def _eval(expr: str) -> int:
    assert re.fullmatch(r"[0-9+\-*()]+", expr), expr
    return eval(expr)  # the expression alphabet is checked above


def test_every_answer_is_the_expression_value(task):
    for level in ALL_LEVELS:
        for p in task.train(level) + task.test(level):
            assert p.answer == _eval(p.question), p


@pytest.mark.parametrize("style", ["steps", "direct"])
def test_every_solution_boxes_the_right_answer(task, style):
    for level in ALL_LEVELS:
        for p in task.train(level) + task.test(level):
            assert parse_boxed_int(p.solution(style)) == p.answer, (p, p.solution(style))


def test_every_worked_step_is_true_arithmetic(task):
    """Each 'x=y.' step of a worked solution is a correct equation (so steps never teach wrong facts)."""
    rng = random.Random(0)
    for level in ALL_LEVELS:
        for p in rng.sample(task.train(level), min(300, len(task.train(level)))):
            for lhs, rhs in re.findall(r"([0-9+\-*()]+)=(-?\d+)\.", p.solution("steps")):
                assert _eval(lhs) == int(rhs), (p, lhs, rhs)


def test_every_level_has_a_worked_and_a_direct_form(task):
    for level in ALL_LEVELS:
        for p in task.train(level)[:20]:
            assert uses_steps(p.solution("steps")), p.solution("steps")
            assert p.solution("steps").startswith(f"{p.question}: ")
            assert not uses_steps(p.solution("direct"))
    assert Problem(1, "7+5", 12).solution("steps") == "7+5: 7+5=12. \\boxed{12}"
    assert Problem(1, "0+0", 0).solution("steps") == "0+0: 0+0=0. \\boxed{0}"


def test_split_is_disjoint_fixed_and_about_the_configured_size(task):
    for level in ALL_LEVELS:
        train = {p.question for p in task.train(level)}
        test = {p.question for p in task.test(level)}
        assert not train & test
        share = len(test) / (len(train) + len(test))
        assert 0.1 < share < 0.3, (level, share)
    again = ArithmeticTask(ALL_LEVELS)
    assert [p.id for p in again.test_set(50)] == [p.id for p in task.test_set(50)]


def test_level_6_is_two_digit_products_worked_as_level_4_multiplies():
    """Beyond the warm start's reach: a*b with both two-digit, its worked form split by the tens of a, as level 4's."""
    assert Problem(6, "47*36", 1692).solution("steps") == "47*36: 40*36=1440. 7*36=252. 1440+252=1692. \\boxed{1692}"
    assert Problem(6, "40*36", 1440).solution("steps") == "40*36: 40*36=1440. \\boxed{1440}"
    six = ArithmeticTask([6])
    assert len(six.train(6)) + len(six.test(6)) == 90 * 90
    assert all(re.fullmatch(r"[1-9][0-9]\*[1-9][0-9]", p.question) for p in six.train(6))
    questions = {p.question for lvl in LEVELS for p in ArithmeticTask().train(lvl) + ArithmeticTask().test(lvl)}
    assert not questions & {p.question for p in six.train(6) + six.test(6)}, "no level-6 question is another level's"


def test_adding_level_6_changed_nothing_of_levels_1_to_5():
    """The default task is levels 1-5 (what the tokenizer and the warm start are built from, and every evaluation
    default), and its problems, answers, worked solutions, split and orders are those from before level 6 existed:
    the digest below was computed from the task as it was then."""
    default = ArithmeticTask()
    assert default.levels == LEVELS == (1, 2, 3, 4, 5) and EXTRA_LEVELS == (6,) and ALL_LEVELS == (1, 2, 3, 4, 5, 6)
    h = hashlib.sha256()
    for level in default.levels:
        for p in default.train(level) + default.test(level):
            h.update(f"{p.id}|{p.answer}|{p.solution('steps')}\n".encode())
    assert h.hexdigest() == "00cfbadc2e31dd0a920966f508f72893c0f56fa2dc1ff8fec88868740b47dc0a"
    assert [p.id for p in default.sample_train(random.Random(0), 5)] == [
        "L5:(39+17)*7", "L4:92-90", "L3:44+40", "L2:76+8", "L3:50+74"]
    assert [p.id for p in default.test_set(1)] == ["L1:9+3", "L2:72+8", "L3:35+66", "L4:64-61", "L5:(42-29)*7"]
    full = ArithmeticTask(ALL_LEVELS)
    assert all(full.train(lvl) == default.train(lvl) and full.test(lvl) == default.test(lvl) for lvl in LEVELS)


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
    default = ArithmeticTask()
    a = default.sample_train(random.Random(1), 200, [1, 0, 0, 0, 1])
    b = default.sample_train(random.Random(1), 200, [1, 0, 0, 0, 1])
    assert a == b
    assert {p.level for p in a} == {1, 5}
    assert all(not p.is_test for p in a)
    c = task.sample_train(random.Random(1), 200, [0, 0, 0, 0, 1, 1])
    assert {p.level for p in c} == {5, 6} and all(not p.is_test for p in c)


def test_bad_arguments_name_the_problem(task):
    with pytest.raises(ValueError, match="level_weights"):
        task.sample_train(random.Random(0), 3, [1, 1])
    with pytest.raises(ValueError, match="levels"):
        ArithmeticTask(levels=[0, 9])
    with pytest.raises(ValueError, match="levels"):
        ArithmeticTask(levels=[7])
    with pytest.raises(ValueError, match="level_weights"):
        task.sample_train(random.Random(0), 3, [1, 1, 1, 1, 1])  # six levels, five weights
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


def test_the_cpu_realistic_pool_mixes_levels_1_to_6(tmp_path):
    """The bench's cpu-realistic preset trains on a pool with level 6 in it (the shares its README reports); the
    default train_levels, and the evaluation's levels, stay those of the other presets."""
    from collections import Counter

    from dppo_core.config import DPPOConfig
    from dppo_core.data import build_prompt_source
    from dppo_core.tools.bench.presets import BENCH_PRESETS, method_config

    assert DPPOConfig().train_levels == (2, 3, 4, 5) and DPPOConfig().eval_levels is None
    config = method_config(BENCH_PRESETS["cpu-realistic"], "grpo_skip", 1, tmp_path)
    assert config.train_levels == ALL_LEVELS and config.eval_levels == (2, 3, 4, 5)
    pool = build_prompt_source(config)
    assert Counter(row["level"] for row in pool.rows) == {1: 57, 2: 49, 3: 43, 4: 39, 5: 36, 6: 32}


def test_the_persistence_presets_put_more_of_the_pool_on_level_6_and_change_nothing_else(tmp_path):
    """The persistence map's presets (issue #63): cpu-realistic with level 6 at a larger share of the weight, the
    other levels in cpu-realistic's proportions, trained long enough to roll out about as many learnable prompts;
    each pool holds more never-solved prompts than the one before."""
    from collections import Counter

    from dppo_core.data import build_prompt_source
    from dppo_core.tools.bench.cpu_settings import PERSISTENCE_SHARES, persistence_steps
    from dppo_core.tools.bench.presets import BENCH_PRESETS, method_config

    realistic = method_config(BENCH_PRESETS["cpu-realistic"], "grpo_skip", 1, tmp_path)
    counts = [Counter(row["level"] for row in build_prompt_source(realistic).rows)[6]]
    for share in PERSISTENCE_SHARES:
        config = method_config(BENCH_PRESETS[f"cpu-persist-{round(100 * share)}"], "grpo_skip", 1, tmp_path)
        weights = config.level_weights
        assert sum(weights) == pytest.approx(1.0, abs=1e-3) and weights[-1] == share
        assert [w / weights[1] for w in weights[:-1]] == pytest.approx([2, 1, 1, 1, 1], abs=5e-3)
        steps = config.max_steps
        assert abs(steps * (1 - share) - realistic.max_steps * (1 - realistic.level_weights[-1])) <= 5 * (1 - share)
        assert steps == persistence_steps(share) and 12 <= steps / config.eval_steps < 14
        assert config.with_overrides({"level_weights": list(realistic.level_weights), "max_steps": realistic.max_steps,
                                      "eval_steps": realistic.eval_steps}) == realistic
        pool = build_prompt_source(config)
        counts.append(Counter(row["level"] for row in pool.rows)[6])
        assert len(pool.rows) == 256
    assert counts == sorted(counts) and counts[-1] > 0.7 * 256, counts
