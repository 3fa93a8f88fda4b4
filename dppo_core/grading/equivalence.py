"""Equivalence of a prediction to a reference: the reference's final answer, then the checks in order.

The string check and the numeric and matrix fast paths (:func:`dppo_core.grading.numbers.fast_equivalence`,
microseconds) decide first; when none does, the symbolic path under a time limit
(:func:`dppo_core.grading.symbolic.symbolic_equivalence`).
"""

from __future__ import annotations

from dppo_core.grading.extract import extract_answer
from dppo_core.grading.numbers import fast_equivalence
from dppo_core.grading.symbolic import DEFAULT_TIMEOUT, symbolic_equivalence


def reference_answer(answer: str) -> str:
    """The final answer inside a reference: a GSM8K ``#### N`` or a boxed solution gives N; else as is."""
    if "####" in answer or "\\boxed" in answer or "\\fbox" in answer:
        extracted = extract_answer(answer)
        if extracted is not None:
            return extracted
    return answer.strip()


def answers_equivalent(pred: str, gold: str, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Whether two bare answers are mathematically equivalent: the fast paths, else the symbolic check."""
    fast = fast_equivalence(pred, gold)
    if fast is not None:
        return fast
    return symbolic_equivalence(pred, gold, timeout)
