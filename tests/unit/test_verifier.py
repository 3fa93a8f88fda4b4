"""The verifier on real benchmark answers: scientific notation and its rounding, lenient extraction,
matrices in any environment, and the fast path agreeing with the symbolic check (issue #23).

Tests that read the shared benchmark files skip when they are absent (see tests/conftest.py).
"""

from __future__ import annotations

import re
import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dppo_core.benchmark_data import EVAL_SUITE, BenchmarkRecord, load_benchmark
from dppo_core.grading import (
    LENIENT,
    STRICT,
    extract_answer,
    fast_equivalence,
    final_statement,
    matrix_cells,
    parse_written_number,
    symbolic_equivalence,
)
from dppo_core.rewards import math_reward, math_rewards


@pytest.fixture(scope="module")
def suite(benchmarks_dir):
    return {name: load_benchmark(name, data_dir=benchmarks_dir) for name in EVAL_SUITE}


def boxed(answer: str) -> str:
    return f"So the final answer is \\boxed{{{answer}}}."


# ---------------------------------------------------------------------------------------------------
# 1. Scientific notation, units, and the precision a rounded reference is written to
# ---------------------------------------------------------------------------------------------------

_E = re.compile(r"^(-?\d+(?:\.\d+)?)e([+-]?\d+)$")


def power_forms(answer: str) -> list[str]:
    """The same number as an e-notation reference, written the ways solutions write it."""
    m = _E.match(answer)
    a, n = m.group(1), int(m.group(2))
    return [f"{a} \\times 10^{{{n}}}", f"{a} \\cdot 10^{{{n}}}", f"{a}\\times10^{{{n}}}",
            f"{a} \\times 10^{{{n}}} \\mathrm{{~cm}}^{{-3}}", f"{a} \\times 10^{{{n}}} \\text{{ erg/s}}",
            f"{a} \\times 10^{{{n}}}\\,\\mathrm{{erg}}\\,\\mathrm{{s}}^{{-1}}", f"{a} \\times 10^{{{n}}} \\text{{ K}}",
            f"{a}\\times 10^{{{n}}}~\\mathrm{{m}}/\\mathrm{{s}}", f"L \\approx {a} \\times 10^{{{n}}}"]


@pytest.mark.parametrize("gold", ["1.07e16", "5.47e5", "4e33", "3.89e-10", "2.7778e-6"])  # Minerva references
def test_scientific_notation_forms_are_equivalent(gold):
    for form in power_forms(gold):
        assert math_reward(boxed(form), gold) == 1.0, form
    m = _E.match(gold)
    if abs(int(m.group(2))) < 10:  # 10^5 unbraced is 10^{5}
        assert math_reward(boxed(f"{m.group(1)} \\times 10^{m.group(2)} \\text{{ K}}"), gold) == 1.0


@pytest.mark.parametrize("pred, gold, expected", [
    ("1.068 \\times 10^{16}", "1.07e16", 1.0),  # rounds to the reference's 3 significant digits
    ("1.0749 \\times 10^{16}", "1.07e16", 1.0),
    ("1.076 \\times 10^{16}", "1.07e16", 0.0),
    ("1.1 \\times 10^{16}", "1.07e16", 0.0),  # less precise than asked, 2 digits
    ("1.06 \\times 10^{16}", "1.07e16", 0.0),
    ("4.4 \\times 10^{33}", "4e33", 1.0),  # one significant digit
    ("5 \\times 10^{33}", "4e33", 0.0),
    ("2.78 \\times 10^{-6}", "2.7778e-6", 1.0),  # 3 digits of a 5-digit reference: the reference rounds to it
    ("2.8 \\times 10^{-6}", "2.7778e-6", 0.0),  # 2 digits: too few
    ("1.25e-8", "1.24e-8", 0.0),  # math-verify's 6-decimal rounding calls these equal; they are not
    ("1.2449 \\times 10^{-8}", "1.24e-8", 1.0),
    ("41.8", "41.8", 1.0), ("0.1", "0.10", 1.0), ("0.3333333", "\\frac{1}{3}", 1.0),
    # a plain decimal is exact, as MATH-500's and OlympiadBench's are (real references)
    ("41.83", "41.8", 0.0), ("0.356", ".35625", 0.0), ("0.3563", ".35625", 0.0), ("326.54", "326.5", 0.0),
    ("3.214", "3.21", 0.0), ("1.254", "1.25", 0.0), ("62.46\\%", "62.5\\%", 0.0), ("4.49", "4.5", 0.0),
    ("0.333", "\\frac{1}{3}", 0.0), ("\\frac{1}{3}", "0.33", 0.0),
    ("6.63 \\times 10^{3}", "6630", 1.0), ("6.6 \\times 10^{3}", "6630", 0.0),  # integers are exact
    ("10^{16}", "1e16", 1.0), ("10^{-5}", "1e-5", 1.0),
])
def test_rounded_references(pred, gold, expected):
    assert math_reward(boxed(pred), gold) == expected


def test_written_precision():
    assert parse_written_number("1.07e16") == parse_written_number("1.07 \\times 10^{16}")
    n = parse_written_number("1.07 \\times 10^{16} \\mathrm{~cm}^{-3}")
    assert (n.value, n.ulp, n.digits) == (Fraction(107 * 10**14), Fraction(10**14), 3)
    assert parse_written_number("0.006").ulp == Fraction(1, 1000)
    assert parse_written_number("6630").ulp is None and parse_written_number("\\frac{1}{3}").ulp is None


@pytest.mark.parametrize("text", ["5 x", "5 \\text{ and } x", "5^{2}", "2 \\times 10^{3} + 1", "7.6 Z"])
def test_a_unit_is_not_a_variable(text):
    assert parse_written_number(text) is None


def test_minerva_references_in_e_notation(suite):
    golds = [r.answer for r in suite["minerva_math"] if _E.match(r.answer)]
    assert len(golds) >= 50
    completions, answers, wrong = [], [], []
    for gold in golds:
        for form in power_forms(gold):
            completions.append(boxed(form))
            answers.append(gold)
        g = parse_written_number(gold)
        wrong.append(boxed(str(g.value + g.ulp)))  # one unit off in the last written place
    assert math_rewards(completions, answers) == [1.0] * len(completions)
    assert math_rewards(wrong, golds) == [0.0] * len(golds)


# ---------------------------------------------------------------------------------------------------
# 2. Extraction: strict (the RL reward) and lenient (evaluation)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, lenient", [
    ("She makes 9 * 2 = $18 every day at the farmer's market.", "18"),  # GSM8K prose, a dollar sign
    ("She earns $18 and spends $5 on food. So she saves $13.", "13"),
    ("Therefore, the area of the circle is $12\\pi$.", "12\\pi"),
    ("Putting it together,\n\\[ x = \\frac{1}{2}. \\]", "\\frac{1}{2}"),  # display math, the value
    ("Thus $3 \\times 4 = 12$. I hope it is correct.", "12"),  # a closing sentence without math
    ("We get $x = \\frac{1}{3} \\approx 0.333$.", "\\frac{1}{3}"),  # the exact value before the approximation
    ("The equation is $y' + r y - r x(t) = 0$.", "y' + r y - r x(t) = 0"),  # an equation is the answer
    ("The answer is $\\frac{1}{2}$, in lowest terms.", "\\frac{1}{2}"),
    ("Final Answer: The final answer is $(2, 3)$. I hope it is correct.", "(2, 3)"),
    ("The answer is: **42**", "42"),
    ("To find the answer: we add the two numbers. So the total is 12.", "12"),  # "answer:" followed by prose
    ("**Final Answer**\n\n$$\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}$$", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("Hence the number of ways is 1,000.", "1,000"),
    ("\\begin{align*} \\sqrt{117} &= \\sqrt{9 \\cdot 13} \\\\\n &= 3\\sqrt{13}. \\end{align*}", "3\\sqrt{13}"),
    ("So $2\\cdot5!\\cdot5!=2\\cdot120\\cdot120=28800$.", "28800"),  # 5!= is a factorial
    ("There are $500 + 1 = 501$ values of $k$ that work.", "501"),  # not the bare variable
    ("Then $36 - 19 = 17 = x$.", "17"),
    ("The smallest value of $c$ is $\\pi.$", "\\pi"),  # a constant, not a variable
    ("She ends up facing $\\text{east}$ after turning 90 degrees.", "\\text{east}"),
    ("[asy]\nlabel(\"$5$\", (1,1));\n[/asy] So the length is $7$.\n[asy]\nlabel(\"$3$\");\n[/asy]", "7"),  # figures
    ("so \\boxed{7}. Then I say the answer is 8.", "7"),  # a box wins in both modes
    ("", None), ("No numbers here. None at all!", None),
])
def test_lenient_extraction(text, lenient):
    assert extract_answer(text, LENIENT) == lenient


def test_strict_extraction_is_unchanged():
    # the RL reward needs the answer boxed (or '#### N' / 'the answer is', as before)
    assert extract_answer("Therefore, the area of the circle is $12\\pi$.", STRICT) is None
    assert extract_answer("Therefore, the area of the circle is $12\\pi$.") is None  # strict by default
    assert extract_answer("The answer is $\\frac{1}{2}$, in lowest terms.") == "\\frac{1}{2}$, in lowest terms"
    assert math_reward("She makes $18 every day.", "18") == 0.0
    assert math_reward("She makes $18 every day.", "18", mode=LENIENT) == 1.0
    with pytest.raises(ValueError, match="extraction mode 'loose'"):
        math_reward("\\boxed{1}", "1", mode="loose")


def test_lenient_extraction_on_real_answers(suite):
    # MATH-500 and OlympiadBench references stated in display or inline math, GSM8K's in prose, none boxed
    math_golds = [r.answer for name in ("math500", "olympiadbench") for r in suite[name] if "$" not in r.answer]
    display = [f"Putting everything together, we get\n\\[{g}\\]\nwhich is what we wanted." for g in math_golds]
    inline = [f"Hence the final result is ${g}$. I hope it is correct." for g in math_golds]
    gsm = suite["gsm8k"]
    prose = [f"Adding these up, she has {r.answer} left over in the end." for r in gsm]
    for texts, golds in ((display, math_golds), (inline, math_golds), (prose, [r.answer for r in gsm])):
        lenient = math_rewards(texts, golds, mode=LENIENT)
        misses = [(t, g) for t, g, x in zip(texts, golds, lenient, strict=True) if x != 1.0]
        assert len(misses) <= 0.005 * len(golds), misses[:10]
        assert math_rewards(texts, golds) == [0.0] * len(golds)  # strict: nothing boxed, nothing counts


def test_lenient_extraction_on_real_solutions(suite, benchmarks_dir):
    """MATH-500 reference solutions with their boxes and closing "The answer is: ..." removed: the answer is
    then only stated in the text, as in a completion that forgot the box."""
    from dppo_core.benchmark_data import BOX_INSTRUCTION, read_jsonl
    from dppo_core.grading import find_boxed

    solutions = {s.problem.strip(): s.solution for s in read_jsonl(benchmarks_dir / "math500_solutions.jsonl")}
    texts, golds = [], []
    for r in suite["math500"]:
        text = re.sub(r"\s*The answer is:.*\Z", "", solutions[r.problem.replace(BOX_INSTRUCTION, "").strip()],
                      flags=re.DOTALL)
        for content, start, end in reversed(find_boxed(text)):
            text = text[:start] + content + text[end:]
        texts.append(text)
        golds.append(r.answer)
    lenient = sum(math_rewards(texts, golds, mode=LENIENT))
    strict = sum(math_rewards(texts, golds))
    assert lenient >= 0.92 * len(golds) and strict <= 0.1 * len(golds), (lenient, strict)  # measured: 471, 37


# strings made of the pieces lenient extraction looks for reach its branches far more often than plain text
_pieces = st.lists(st.sampled_from(list("0123456789+-=^_{}()[].,;!?$&\\ \nxyz") + [
    "\\[", "\\]", "\\(", "\\)", "$$", "\\frac", "\\begin{align*}", "\\end{align*}", "\\begin{pmatrix}",
    "\\end{pmatrix}", "\\\\", "\\approx", "[asy]", "[/asy]", "the answer is ", "So ", ". ", "\\text{ cm}",
    "\\times 10^{", "e5", "\\boxed{"]), max_size=40).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=200), _pieces), answer=st.one_of(st.text(max_size=20), _pieces))
def test_lenient_never_raises_and_bounded_time(text, answer):
    t0 = time.perf_counter()
    extracted = extract_answer(text, LENIENT)
    assert extracted is None or isinstance(extracted, str)
    assert math_reward(text, answer, mode=LENIENT, timeout=0.5) in (0.0, 1.0)
    assert time.perf_counter() - t0 < 5.0


def test_final_statement_looks_back_a_few_sentences_only():
    assert final_statement("The total is 12. I hope this helps! Let me know.") == "12"
    assert final_statement("The total is 12. One. Two. Three. Four.") is None


# ---------------------------------------------------------------------------------------------------
# 3. Matrices in any environment, element by element
# ---------------------------------------------------------------------------------------------------

_ENVIRONMENTS = [
    ("\\begin{bmatrix}", "\\end{bmatrix}"), ("\\begin{Bmatrix}", "\\end{Bmatrix}"),
    ("\\left(\\begin{matrix}", "\\end{matrix}\\right)"), ("\\begin{smallmatrix}", "\\end{smallmatrix}"),
    ("\\left[\\begin{array}{ccc}", "\\end{array}\\right]"), ("\\left[ \\begin{array}{c}", "\\\\ \\end{array} \\right]"),
    ("\\mathbf{v} = \\begin{pmatrix}", "\\end{pmatrix}"),
]


def rewrite_matrix(gold: str, begin: str, end: str, cell=lambda c: c) -> str:
    rows = matrix_cells(gold)
    return f"{begin} " + " \\\\ ".join(" & ".join(cell(c) for c in row) for row in rows) + f" {end}"


def as_dfrac(cell: str) -> str:
    m = re.fullmatch(r"(-?)(\d+)/(\d+)", cell.strip())
    return f"{m.group(1)}\\dfrac{{{m.group(2)}}}{{{m.group(3)}}}" if m else cell


def test_matrices_in_any_environment(suite):
    golds = [r.answer for r in suite["math500"] if "pmatrix" in r.answer]
    assert len(golds) >= 5
    for gold in golds:
        for begin, end in _ENVIRONMENTS:
            assert math_reward(boxed(rewrite_matrix(gold, begin, end, as_dfrac)), gold) == 1.0, (begin, gold)
        cells = matrix_cells(gold)
        cells[0][0] = f"{cells[0][0]}+1"
        changed = "\\left[\\begin{array}{ccc} " + " \\\\ ".join(" & ".join(r) for r in cells) + " \\end{array}\\right]"
        assert math_reward(boxed(changed), gold) == 0.0, changed


@pytest.mark.parametrize("pred, expected", [
    ("\\left[\\begin{array}{cc} -1 & 0 \\\\ 0 & -1 \\end{array}\\right]", 1.0),
    ("\\begin{bmatrix} -1 & 0 \\\\[2pt] 0 & -1 \\\\ \\hline \\end{bmatrix}", 1.0),
    ("\\begin{pmatrix} -1 & 0 \\\\ 0 & 1 \\end{pmatrix}", 0.0),
    ("\\begin{pmatrix} -1 & 0 & 0 \\\\ 0 & -1 & 0 \\end{pmatrix}", 0.0),  # another shape
    ("\\begin{vmatrix} -1 & 0 \\\\ 0 & -1 \\end{vmatrix}", 0.0),  # a determinant, not a matrix
])
def test_matrix_forms(pred, expected):
    assert math_reward(boxed(pred), "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}") == expected


# ---------------------------------------------------------------------------------------------------
# 4. The fast path never disagrees with the symbolic check on the benchmarks' reference answers
# ---------------------------------------------------------------------------------------------------


def alternative_forms(gold: str) -> list[str]:
    """Forms of a reference answer the fast path decides: equal ones and near misses."""
    forms = [gold]
    n = parse_written_number(gold)
    if n is not None:
        v = n.value
        if _E.match(gold):
            forms += power_forms(gold)[:3]
        if n.ulp is not None:
            forms += [str(v + n.ulp), str(v - 2 * n.ulp)]  # one and two units off in the last place
            m = re.fullmatch(r"(-?\d+\.\d+)", gold)
            if m:
                forms.append(gold + "4")  # more digits that round to it
        elif v.denominator == 1 and abs(v) < 10**15:
            forms += [f"{v}.0", str(v + 1), f"x = {v}", f"{v} \\text{{ cm}}"]
            if abs(v) >= 1000:
                forms.append(f"{int(v):,}".replace(",", "{,}"))
        else:
            forms += [f"\\frac{{{v.numerator}}}{{{v.denominator}}}", f"{v.numerator}/{v.denominator}",
                      f"\\dfrac{{{v.numerator + 1}}}{{{v.denominator}}}"]
        if v:
            forms.append(f"-({gold})" if not gold.startswith("-") else gold[1:])
    if matrix_cells(gold) is not None:
        forms += [rewrite_matrix(gold, "\\left[\\begin{array}{ccc}", "\\end{array}\\right]"),
                  rewrite_matrix(gold, "\\begin{bmatrix}", "\\end{bmatrix}", as_dfrac)]
    return forms


@pytest.mark.parametrize("name", EVAL_SUITE)
def test_fast_path_agrees_with_symbolic_check(suite, name):
    checked, disagreements = 0, []
    for r in suite[name]:
        for form in dict.fromkeys(alternative_forms(r.answer)):
            fast = fast_equivalence(form, r.answer)
            if fast is None:
                continue
            checked += 1
            symbolic = symbolic_equivalence(form, r.answer, timeout=10.0)
            if symbolic != fast:
                disagreements.append((form, r.answer, fast, symbolic))
    assert checked >= len(suite[name])  # every reference against itself at least
    assert not disagreements, disagreements[:20]


# ---------------------------------------------------------------------------------------------------
# 5. `dppo eval`: lenient by default, says so, and takes --extraction strict
# ---------------------------------------------------------------------------------------------------


class _ProseEngine:
    """Answers every problem in prose, without a box."""

    name = "prose"

    def generate(self, prompts, num_generations=1, sampling=None):
        from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup

        return RolloutBatch([RolloutGroup(p, [0], [Completion([1], "So the total is $3$.", [0.0], "stop")
                                                   for _ in range(num_generations)]) for p in prompts])


def test_evaluate_benchmarks_is_lenient_by_default():
    from dppo_core.evaluate import evaluate_benchmarks

    recs = {"toy": [BenchmarkRecord("q", "3", "toy-0", "toy")]}
    ev = evaluate_benchmarks(_ProseEngine(), recs, progress=False)
    assert ev.results["toy"].pass_at_1 == 1.0 and ev.settings["extraction"] == "lenient"
    ev = evaluate_benchmarks(_ProseEngine(), recs, progress=False, extraction="strict")
    assert ev.results["toy"].pass_at_1 == 0.0 and ev.settings["extraction"] == "strict"

