"""Chapter 01 exercises, solved and checked: scientific notation, pass@k, a format reward.

Run: python notebooks/solutions/ch01_rewards.py   (seconds, no model; tests/test_solutions.py runs it too)
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from itertools import combinations

from dppo_core.evaluate import pass_at_k
from dppo_core.rewards import REL_TOL, format_reward, numbers_equal, parse_number

# --------------------------------------------------------------------------------------------------
# Exercise 1: scientific notation in the numeric fast path
# --------------------------------------------------------------------------------------------------


def my_number(s: str) -> Fraction | None:
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


def exercise_1() -> None:
    cases = ["6.5 \\times 10^{-2}", "1.2e-8", "-3E4", "2.5 \\times 10^3", "7 \\cdot 10^{2}", "1,000", "\\frac{3}{4}",
             "0.065", "42", "\\$18.00"]
    for s in cases:
        assert my_number(s) == parse_number(s), (s, my_number(s), parse_number(s))
    assert my_number("6.5 \\times 10^{-2}") == my_number("0.065") == Fraction(13, 200)
    print(f"my_number == dppo_core.rewards.parse_number on {len(cases)} answers, scientific notation included")
    # 1.24e-8 and 1.25e-8 differ by 0.8% of their size: two different measurements, not a rounding of one
    # number. A tolerance on the absolute difference (1e-10 < 1e-6) would call them equal; the package's
    # tolerance is relative (REL_TOL of the larger magnitude), so tiny numbers are compared at their scale.
    a, b = parse_number("1.24e-8"), parse_number("1.25e-8")
    assert abs(a - b) < Fraction(1, 10**6) and not numbers_equal(a, b)
    assert numbers_equal(parse_number("0.333333333"), Fraction(1, 3))  # a rounded 1/3 still matches
    print(f"1.24e-8 vs 1.25e-8: equal under an absolute 1e-6 tolerance, not under the relative {REL_TOL:g}")


# --------------------------------------------------------------------------------------------------
# Exercise 2: pass@k from its definition
# --------------------------------------------------------------------------------------------------


def my_pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from the n is correct) = 1 - C(n-c, k)/C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def exercise_2() -> None:
    checked = 0
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(my_pass_at_k(n, c, k), pass_at_k(n, c, k), abs_tol=1e-12)
                checked += 1
    print(f"my pass@k == dppo_core.evaluate.pass_at_k on {checked} (n, c, k) with n <= 16")
    # The definition, by brute force: the share of the k-subsets of n samples (c correct) with a correct one.
    n, c, k = 8, 2, 3
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    assert math.isclose(sum(any(samples[i] for i in s) for s in subsets) / len(subsets), pass_at_k(n, c, k))
    # The plug-in estimate 1 - (1 - c/n)^k (as if sampling with replacement) is biased low:
    plug_in = 1 - (1 - c / n) ** k
    print(f"n={n}, c={c}, k={k}: pass@k {pass_at_k(n, c, k):.4f}, plug-in 1-(1-c/n)^k {plug_in:.4f}")
    assert plug_in < pass_at_k(n, c, k)
    assert pass_at_k(n, c, 1) == c / n  # pass@1 is the accuracy


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


def exercise_3() -> None:
    completions = [
        "9 * 2 = 18, so \\boxed{18}.",                      # well formed
        "\\boxed{\\frac{1}{2}}",                            # nested braces
        "\\boxed{17} or maybe \\boxed{18}",                 # two boxes
        "It is 18",                                         # no box
        "\\boxed{}",                                        # empty box
        "\\boxed{18",                                      # cut off inside the box
        "\\boxed{18} " + "and then I kept talking about something else entirely",  # answer not at the end
        [{"role": "assistant", "content": "so the answer is $\\boxed{4}$"}],  # a conversation
    ]
    ours = my_format_reward(None, completions)
    package = format_reward(None, completions)
    print(f"format rewards {ours} == dppo_core.rewards.format_reward: {ours == package}")
    assert ours == package == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 01 solutions: all checks passed")


if __name__ == "__main__":
    main()
