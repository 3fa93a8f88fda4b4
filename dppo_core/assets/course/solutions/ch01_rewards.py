"""Chapter 01 exercises, solved and checked: scientific notation, pass@k, a format reward.

Run: python dppo_core/assets/course/solutions/ch01_rewards.py   (seconds, no model;
tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from itertools import combinations

from dppo_core.evaluate import pass_at_k
from dppo_core.grading import REL_TOL, numbers_equal, parse_number
from dppo_core.rewards import format_reward

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Keep the mantissa and the power of ten exact with Fraction(10) ** k: a float anywhere on the way, "
        "like float('1.2e-8'), makes the value inexact."),
    2: ("pass@k is one minus the chance that all k draws without replacement miss: count with math.comb(n - "
        "c, k) over math.comb(n, k), not (1 - c/n) ** k."),
    3: ("Count braces to find where the box closes (nested \\frac{}{} included), score a conversation by its "
        "last message, and allow 40 characters after the box."),
}

# --------------------------------------------------------------------------------------------------
# Exercise 1: scientific notation in the numeric fast path
# --------------------------------------------------------------------------------------------------


def my_number_sci(s: str) -> Fraction | None:
    """The chapter's my_number, plus `1.2e-8` and `6.5 \\times 10^{-2}` (an exact power of ten, no float)."""
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    s = re.sub(r"\\text\{[^{}]*\}", "", s).strip()
    exponent = 0
    if m := re.fullmatch(r"(.+?)\s*(?:\\times|\\cdot)\s*10\^\{?([+-]?\d+)\}?", s):
        s, exponent = m[1].strip(), int(m[2])
    if m := re.fullmatch(r"(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)", s):
        s, exponent = m[1], exponent + int(m[2])
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    value = None
    if m := re.fullmatch(r"(-?)\\d?frac\{(\d+)\}\{(\d+)\}", s):
        value = Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1)
    elif m := re.fullmatch(r"(-?\d+)/(\d+)", s):
        value = Fraction(int(m[1]), int(m[2]))
    elif re.fullmatch(r"-?\d+(\.\d+)?", s):
        value = Fraction(s)
    return None if value is None else value * Fraction(10) ** exponent


def exercise_1(my_number_sci=my_number_sci) -> None:
    cases = ["6.5 \\times 10^{-2}", "1.2e-8", "-3E4", "2.5 \\times 10^3", "7 \\cdot 10^{2}", "4.1E+5",
             "1,000", "\\frac{3}{4}", "0.065", "42", "\\$18.00", "-7/8"]
    for s in cases:
        assert my_number_sci(s) == parse_number(s), (s, my_number_sci(s), parse_number(s))
        assert isinstance(my_number_sci(s), Fraction), \
            f"{s!r}: return a Fraction (exact), not {type(my_number_sci(s))}"
    assert my_number_sci("6.5 \\times 10^{-2}") == my_number_sci("0.065") == Fraction(13, 200)
    assert my_number_sci("1.2e-8") == Fraction(12, 10**9)                 # exactly: Fraction(1.2e-8) is not
    print(f"my_number_sci == dppo_core.grading.parse_number on {len(cases)} answers, scientific notation "
          "included")
    # 1.24e-8 and 1.25e-8 differ by 0.8% of their size: two different measurements, not a rounding of one
    # number. A tolerance on the absolute difference (1e-10 < 1e-6) would call them equal; the package's
    # tolerance is relative (REL_TOL of the larger magnitude), so tiny numbers are compared at their scale.
    a, b = my_number_sci("1.24e-8"), my_number_sci("1.25e-8")
    assert a != b and abs(a - b) < Fraction(1, 10**6) and not numbers_equal(a, b)
    assert numbers_equal(my_number_sci("0.333333333"), Fraction(1, 3))  # a rounded 1/3 still matches
    print(f"1.24e-8 vs 1.25e-8: equal under an absolute 1e-6 tolerance, not under the relative {REL_TOL:g}")


# --------------------------------------------------------------------------------------------------
# Exercise 2: pass@k from its definition
# --------------------------------------------------------------------------------------------------


def my_pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from the n is correct) = 1 - C(n-c, k)/C(n,
    k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def exercise_2(my_pass_at_k=my_pass_at_k) -> None:
    checked = 0
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(my_pass_at_k(n, c, k), pass_at_k(n, c, k), abs_tol=1e-12), (n, c, k)
                checked += 1
    print(f"my pass@k == dppo_core.evaluate.pass_at_k on {checked} (n, c, k) with n <= 16")
    # The definition, by brute force: the share of the k-subsets of n samples (c correct) with a correct one.
    n, c, k = 8, 2, 3
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    assert math.isclose(sum(any(samples[i] for i in s) for s in subsets) / len(subsets),
                        my_pass_at_k(n, c, k))
    assert my_pass_at_k(n, c, 1) == c / n  # pass@1 is the accuracy
    # Unbiased: if each of the n samples is right with probability p, c ~ Binomial(n, p) and the estimator's
    # expectation is exactly the true pass@k, 1 - (1 - p)^k. The plug-in 1 - (1 - c/n)^k is below the
    # estimator for every c (strictly when 0 < c < n and k >= 2), so its expectation is biased low.
    n, p = 10, Fraction(3, 10)
    binomial = [math.comb(n, c) * p**c * (1 - p) ** (n - c) for c in range(n + 1)]
    for k in range(1, n + 1):
        expected = sum(float(w) * my_pass_at_k(n, c, k) for c, w in enumerate(binomial))
        plug_in = sum(float(w) * (1 - (1 - c / n) ** k) for c, w in enumerate(binomial))
        truth = 1 - (1 - float(p)) ** k
        assert math.isclose(expected, truth, rel_tol=1e-9), (k, expected, truth)
        assert k == 1 or plug_in < truth
    print(f"n={n}, p={float(p)}, k=4: E[pass@k estimate] = {1 - (1 - float(p)) ** 4:.4f} (the truth); "
          f"E[plug-in] = {sum(float(w) * (1 - (1 - c / n) ** 4) for c, w in enumerate(binomial)):.4f} (low)")


# --------------------------------------------------------------------------------------------------
# Exercise 3: a format reward from scratch, TRL style
# --------------------------------------------------------------------------------------------------


def my_format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 for exactly one non-empty \\boxed{...} (braces counted) with at most 40 characters after it."""
    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        opened = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]
        ok = False
        if len(opened) == 1 and text.startswith("{", opened[0]):
            i = j = opened[0] + 1                       # just inside the brace
            depth = 1
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            ok = depth == 0 and bool(text[i : j - 1].strip()) and len(text[j:].strip()) <= 40
        out.append(float(ok))
    return out


def exercise_3(my_format_reward=my_format_reward) -> None:
    completions = [
        "9 * 2 = 18, so \\boxed{18}.",                      # well formed
        "\\boxed{\\frac{1}{2}}",                            # nested braces
        "\\boxed{17} or maybe \\boxed{18}",                 # two boxes
        "It is 18",                                         # no box
        "\\boxed{}",                                        # empty box
        "\\boxed{ }",                                       # a box of spaces only
        "\\boxed{18",                                      # cut off inside the box
        "\\boxed{18} " + "and then I kept talking about something else entirely",  # answer not at the end
        "\\boxed{18}" + "x" * 40,                           # 40 characters after the box: still fine
        "\\boxed{18}" + "x" * 41,                           # 41: too many
        "\\fbox{7}",                                        # an fbox counts as a box too
        [{"role": "assistant", "content": "so the answer is $\\boxed{4}$"}],  # a conversation
        [{"role": "assistant", "content": "\\boxed{4} \\boxed{4}"}],          # a conversation, two boxes
    ]
    ours = my_format_reward(None, completions)
    package = format_reward(None, completions)
    print(f"format rewards {ours} == dppo_core.rewards.format_reward: {ours == package}")
    assert len(ours) == len(completions) and all(isinstance(x, float) for x in ours)
    for completion, mine, theirs in zip(completions, ours, package, strict=True):
        assert mine == theirs, f"{completion!r}: yours {mine}, dppo_core {theirs}"
    assert my_format_reward(prompts=["q"], completions=["\\boxed{1}"], answer=["1"]) == [1.0]  # TRL's call


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 01 solutions: all checks passed")


if __name__ == "__main__":
    main()
