"""Answer extraction, equivalence, time limits and the TRL-style reward functions."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dppo_core.grading import extract_answer, fast_equivalence, parse_number, symbolic_equivalence
from dppo_core.rewards import accuracy_reward, combine_rewards, format_reward, math_reward, math_rewards

# A comparison that SymPy cannot finish in any reasonable time (it tries to evaluate the tower).
PATHOLOGICAL = "9^{9^{9^{9}}}"


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{42}.", "42"),
    ("first \\boxed{1}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("\\boxed{{a}+{b}}", "{a}+{b}"),  # nested braces
    ("$\\boxed 7$", "7"),  # \boxed without braces
    ("\\fbox{x=3}", "x=3"),
    ("\\boxed{5} and a truncated \\boxed{12", "5"),  # an unclosed box is not an answer
    ("She pays 3*6=18.\n#### 18", "18"),  # GSM8K
    ("#### 1,000\n", "1,000"),
    ("Adding up, the answer is 42.", "42"),  # the documented fallback
    ("Final answer: $x = 3$", "x = 3"),
    ("the answer is 3 and then more text\nmore", "3 and then more text"),
    ("I think it is 42", None),  # no last-number fallback
    ("", None),
    ("\\boxed{", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_non_string_gives_none():
    assert extract_answer(None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("text, value", [
    ("42", 42), ("-3.5", -3.5), ("1,000", 1000), ("1{,}000", 1000), ("1,\\!000", 1000),
    ("\\$18.00", 18), ("50\\%", 50), ("76^\\circ", 76), ("5\\text{ cm}", 5), ("18 dollars", 18),
    ("\\frac{3}{4}", 0.75), ("\\dfrac34", 0.75), ("-\\frac{1}{2}", -0.5), ("3/4", 0.75),
    ("1.2e-8", 1.2e-8), ("6.5 \\times 10^{-2}", 0.065),
])
def test_parse_number(text, value):
    assert float(parse_number(text)) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text", ["-2,1", "1,2", "3x", "2 and 3", "2516_8", "\\sqrt{2}", "1e99999", "x", ""])
def test_parse_number_rejects_non_numbers(text):
    assert parse_number(text) is None


@pytest.mark.parametrize("pred, gold", [
    ("18", "18"), ("\\$18", "18"), ("18.0", "18"), ("1,000", "1000"),  # decorations
    ("0.5", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "\\frac12"),  # \frac vs /
    ("10\\%", "10"), ("5 \\text{ cm}", "5"), ("90^\\circ", "90"),  # units
    ("(2,12) \\cup (12,102)", "(2, 12)\\cup(12, 102)"),  # intervals
    ("\\{1, 2\\}", "\\{2, 1\\}"), ("1,-2", "-2,1"),  # sets, unordered lists
    ("\\sqrt{4}", "2"), ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),  # symbolic
    ("2x+2", "2(x+1)"),
    ("\\text{Evelyn}", "\\text{Evelyn}"), ("\\text{(C)}", "(C)"),  # text answers
    ("\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", "\\begin{pmatrix}-1&0\\\\0&-1\\end{pmatrix}"),
])
def test_equivalent_answers_score_one(pred, gold):
    assert math_reward(f"The result is \\boxed{{{pred}}}.", gold) == 1.0


@pytest.mark.parametrize("pred, gold", [
    ("19", "18"), ("-18", "18"), ("\\frac{2}{3}", "\\frac{1}{2}"), ("1.25e-8", "1.24e-8"),
    ("(2,12]", "(2,12)"), ("\\{1, 3\\}", "\\{1, 2\\}"), ("\\sqrt{3}", "\\sqrt{2}"), ("2x+1", "2(x+1)"),
    ("\\text{Evelyn}", "\\text{Bob}"), ("50\\%", "0.5"),
])
def test_different_answers_score_zero(pred, gold):
    assert math_reward(f"\\boxed{{{pred}}}", gold) == 0.0


def test_reference_may_be_a_worked_solution():
    assert math_reward("\\boxed{72}", "48+24=72\n#### 72") == 1.0
    assert math_reward("#### 72", "so \\boxed{72}") == 1.0


def test_conversational_completions():
    conv = [{"role": "assistant", "content": "so \\boxed{3}"}]
    assert math_reward(conv, "3") == 1.0
    assert accuracy_reward(prompts=None, completions=[conv, "\\boxed{4}"], answer=["3", "3"]) == [1.0, 0.0]
    assert accuracy_reward(prompts=None, completions=["\\boxed{4}"], solution=["4"]) == [1.0]  # TRL's name
    with pytest.raises(ValueError, match="answer"):
        accuracy_reward(prompts=None, completions=["x"])


def test_fast_path_decides_plain_numbers_only():
    assert fast_equivalence("1,000", "1000") is True
    assert fast_equivalence("999", "1000") is False
    assert fast_equivalence("\\sqrt{4}", "2") is None  # the symbolic path decides


def test_format_reward():
    completions = [
        "Adding: 2+2=4, so \\boxed{4}.",  # ok
        "\\boxed{4} and \\boxed{4}",  # boxed twice
        "no box at all",
        "\\boxed{4} " + "and then I kept talking for a long while after the answer.",  # does not end there
        "cut off in the box \\boxed{4",
        "\\boxed{}",  # empty
    ]
    assert format_reward(None, completions) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_combine_rewards_weights_and_trl_functions():
    def length_penalty(prompts, completions, **kwargs):  # a TRL user's reward function
        return [-0.01 * len(c) for c in completions]

    fn = combine_rewards([accuracy_reward, format_reward, length_penalty], [1.0, 0.5, 1.0])
    out = fn(prompts=["q", "q"], completions=["\\boxed{3}", "3"], answer=["3", "3"])
    assert out == pytest.approx([1.0 + 0.5 - 0.09, -0.01])
    with pytest.raises(ValueError, match="one weight per function"):
        combine_rewards([accuracy_reward], [1.0, 2.0])


def test_batch_scoring_equals_one_by_one():
    golds = ["\\frac{1}{2}", "2", "(1,2)", "x^2", "18"]
    preds = ["0.5", "\\sqrt{4}", "(1, 2)", "x\\cdot x", "17"]
    completions = [f"\\boxed{{{p}}}" for p in preds] * 4
    answers = golds * 4
    one_by_one = [math_reward(c, a) for c, a in zip(completions, answers, strict=True)]
    assert one_by_one == [1.0, 1.0, 1.0, 1.0, 0.0] * 4
    assert math_rewards(completions, answers) == one_by_one
    # the symbolic checks in worker processes (min_parallel=1 forces the pool)
    assert math_rewards(completions, answers, num_workers=2, min_parallel=1) == one_by_one
    with pytest.raises(ValueError, match="one answer per completion"):
        math_rewards(["a"], [])


# ---------------------------------------------------------------------------------------------------
# Time limit: main thread, other threads, worker processes
# ---------------------------------------------------------------------------------------------------


def test_timeout_in_main_thread():
    t0 = time.perf_counter()
    assert math_reward(f"\\boxed{{{PATHOLOGICAL}}}", "1", timeout=0.5) == 0.0
    assert time.perf_counter() - t0 < 3.0


def test_timeout_in_a_thread():
    out = {}

    def work():
        t0 = time.perf_counter()
        out["reward"] = math_reward(f"\\boxed{{{PATHOLOGICAL}}}", "1", timeout=0.5)
        out["ok"] = math_reward("\\boxed{\\sqrt{4}}", "2", timeout=5.0)  # the symbolic path still works
        out["seconds"] = time.perf_counter() - t0

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert out["reward"] == 0.0 and out["ok"] == 1.0
    # the worker process starts once (a few seconds); the time-out itself must not stall
    assert out["seconds"] < 30


def test_timeout_in_worker_processes():
    completions = [f"\\boxed{{{PATHOLOGICAL}}}", "\\boxed{\\sqrt{4}}"] * 2
    t0 = time.perf_counter()
    assert math_rewards(completions, ["1", "2"] * 2, timeout=0.5, num_workers=2, min_parallel=1) == [0.0, 1.0] * 2
    assert time.perf_counter() - t0 < 30


def test_timeout_restores_an_outer_alarm():
    import signal

    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 5.0)
        assert symbolic_equivalence("\\sqrt{4}", "2", timeout=1.0)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 3.0 < remaining <= 5.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired


# ---------------------------------------------------------------------------------------------------
# Never raises, bounded time (property-based)
# ---------------------------------------------------------------------------------------------------

# strings made of LaTeX-ish pieces reach the parsers far more often than uniform unicode does
latexish = st.lists(st.sampled_from(list("0123456789+-*/^_{}()[].,$\\ xyz=%")
                                    + ["\\boxed{", "\\frac", "\\sqrt", "####", "\\left(", "\\right)",
                                       "\\infty", "\\cup", "\\pi", "the answer is "]),
                    max_size=30).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=200), latexish), answer=st.one_of(st.text(max_size=30), latexish))
def test_never_raises_and_bounded_time(text, answer):
    t0 = time.perf_counter()
    extracted = extract_answer(text)
    assert extracted is None or isinstance(extracted, str)
    assert math_reward(text, answer, timeout=0.5) in (0.0, 1.0)
    assert math_reward(f"\\boxed{{{text}}}", answer, timeout=0.5) in (0.0, 1.0)
    assert time.perf_counter() - t0 < 5.0


def test_a_rollout_completion_is_read_by_its_text_and_anything_else_is_refused():
    """A dppo_core.rollout.Completion scores as its text does (it used to score 0 without a word), in every
    reward function; what is no completion at all raises a TypeError that names its type."""
    from dppo_core.rewards import accuracy_reward, format_reward, math_reward, math_rewards
    from dppo_core.rollout import Completion

    right = Completion(token_ids=[1, 2], text="so the answer is \\boxed{80}", logprobs=[-0.1, -0.2],
                       finish_reason="stop")
    wrong = Completion(token_ids=[1], text="\\boxed{81}", logprobs=[-0.3], finish_reason="stop")
    assert math_reward(right, "80") == 1.0 and math_reward(wrong, "80") == 0.0
    assert math_rewards([right, wrong, right.text], ["80", "80", "80"]) == [1.0, 0.0, 1.0]
    conversation = [{"role": "assistant", "content": right.text}]
    for completion in (right, right.text, conversation):  # every kind a reward function is handed
        assert accuracy_reward(None, [completion], answer=["80"]) == [1.0]
        assert format_reward(None, [completion]) == [1.0]
    assert math_reward([], "80") == 0.0  # an empty conversation is an empty answer
    for bad in (None, 80, {"content": "\\boxed{80}"}):
        with pytest.raises(TypeError, match=type(bad).__name__):
            math_reward(bad, "80")
    with pytest.raises(TypeError, match="int"):
        math_rewards(["\\boxed{80}", 80], ["80", "80"])
    with pytest.raises(TypeError, match="NoneType"):
        accuracy_reward(None, [None], answer=["80"])
