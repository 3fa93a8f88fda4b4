"""Answer grading: the final answer of a completion, and its equivalence to the reference answer.

A completion is right when ``extract_answer(completion, mode) ≡ answer``; the reward functions built on that
(:func:`dppo_core.rewards.math_reward` and the others) live in :mod:`dppo_core.rewards`. Grading runs for
every completion of every RL step, so it has to be right *and* fast.

**Extraction** has two modes (:func:`extract_answer`, in :mod:`~dppo_core.grading.extract`):

- ``"strict"``, the RL reward's (:func:`dppo_core.rewards.math_reward`,
  :func:`dppo_core.rewards.accuracy_reward` and the trainer use it): the last ``\\boxed{}``, else GSM8K's
  ``#### N``, else an explicit "the answer is ..." ending. A policy is rewarded for stating its answer in the
  form the prompt asks for, so the format is learned.
- ``"lenient"``, evaluation's (``dppo eval`` and :func:`dppo_core.evaluate.evaluate_benchmarks` by default):
  the same, and when nothing is boxed, the final answer as a reader (or math-verify) finds it: the math right
  after "the answer is", else the last math of the last sentence that has any (inline ``$...$``,
  ``\\(...\\)``, display ``\\[...\\]``, ``$$...$$``, ``align``: its last line, the value after ``x =`` or at
  the end of a chain ``3 \\times 4 = 12``), else that sentence's last number ("so she has 18 left."). A
  completion that states a right answer without the box is judged right, as a human grader would.

**Equivalence** ≡ is decided by the first of these checks that applies (:func:`answers_equivalent`, in
:mod:`~dppo_core.grading.equivalence`):

1. **String check** (microseconds): both sides equal after removing LaTeX spacing and decoration
   (``\\left``, ``\\!``, ``$``, ``\\dfrac`` → ``\\frac``, a trailing period). Equal strings are equal values.
2. **Numeric fast path** (microseconds): both sides are plain numbers: integers, decimals, ``a/b`` and
   ``\\frac{a}{b}``, thousands separators, and scientific notation in any of its forms (``1.07e16``,
   ``1.07 \\times 10^{16}``, ``1.07 \\cdot 10^{16}``, ``10^{16}``), with ``$``, ``\\%``, degrees and a unit
   stripped (``5\\text{ cm}``, ``18 dollars``, ``4.5 \\times 10^{33} \\mathrm{erg} \\mathrm{s}^{-1}``,
   ``3 \\times 10^8 m/s``); a prediction ``x = 5`` or ``L \\approx 5`` reads as ``5``. They are compared as
   exact rationals: two integers exactly however large, anything else within a relative tolerance of 1e-6
   (so ``0.333333`` matches ``1/3``). A reference written with a power of ten (Minerva Math's ``1.07e16``,
   ``4e33``: rounded measurements; a plain decimal such as ``326.5`` is exact, as MATH's are) also matches a
   prediction that rounds to it at the precision it is written to, within half a unit of its last digit
   (``1.068 \\times 10^{16}`` for ``1.07e16``, not ``1.06 \\times 10^{16}``), or a prediction written less
   precisely, to 3 or more significant digits, that it rounds to (``2.78e-6`` for ``2.7778e-6``; see
   :func:`rounds_to`).
3. **Matrix fast path**: both sides are matrices in any usual environment (``pmatrix``, ``bmatrix``,
   ``Bmatrix``, ``matrix``, ``smallmatrix``, ``\\left[\\begin{array}{cc}...\\end{array}\\right]``), compared
   entry by entry with these checks; a different shape is False (:func:`matrix_cells`).
4. **Symbolic path** (milliseconds, sometimes seconds): the registry's ``math-verify`` parses both sides
   to SymPy and compares them (sets, intervals, matrices, expressions, equations), under a per-call time
   limit; e-notation is rewritten as a power of ten first and matrices as ``pmatrix`` (:func:`sympy_ready`).
   When the reference is a plain number and the prediction has a real value (``\\sqrt{2}/2``), the numeric
   rule of 2 decides on the parsed values, so the two paths never disagree on a number. A call that runs
   out of time scores 0.

Checks 1-3 are :func:`fast_equivalence` (:mod:`~dppo_core.grading.numbers`), check 4 is
:func:`symbolic_equivalence` (:mod:`~dppo_core.grading.symbolic`, with the worker processes it uses).

Departures from common practice, and why:

1. No "last number in the text" fallback in strict extraction: as a reward it pays a policy for ending on any
   number, an easy reward hack (:mod:`dppo_core.rewards`). The lenient mode, for evaluation only, reads the
   last sentence's number.
2. The numeric checks compare with a *relative* tolerance, where math-verify rounds both sides to 6
   decimals (which makes ``1.24e-8`` equal to ``1.25e-8``, and ``0.0000673`` equal to ``0.0000672``), and
   a rounded reference with the tolerance its own last digit implies. Scientific answers (Minerva) are
   therefore judged to the digits the reference gives, no more and no less.
3. Percent signs are decoration (``50\\%`` is 50, as benchmark answers write it), on both paths.
4. The time limit is our own (``signal.setitimer`` around parsing *and* comparison), not math-verify's
   (whole seconds, and separate for each step). Signals only work in a process's main thread, so a call
   from any other thread runs the symbolic check in a worker process and waits with a deadline.
"""

from dppo_core.grading.equivalence import answers_equivalent, reference_answer
from dppo_core.grading.extract import (
    BOX_COMMANDS,
    EXTRACTION_MODES,
    LENIENT,
    LENIENT_TAIL_CHARS,
    MAX_ANSWER_CHARS,
    STRICT,
    assigned_value,
    check_mode,
    extract_answer,
    final_statement,
    final_value,
    find_boxed,
    math_spans,
)
from dppo_core.grading.numbers import (
    REL_TOL,
    Number,
    fast_equivalence,
    matrix_cells,
    normalize_answer,
    numbers_equal,
    parse_number,
    parse_written_number,
    rounds_to,
    unit_match,
)
from dppo_core.grading.symbolic import (
    DEFAULT_TIMEOUT,
    VerifierTimeout,
    symbolic_equivalence,
    symbolic_equivalence_in_thread,
    symbolic_equivalence_in_workers,
    sympy_ready,
)

__all__ = [
    "BOX_COMMANDS",
    "DEFAULT_TIMEOUT",
    "EXTRACTION_MODES",
    "LENIENT",
    "LENIENT_TAIL_CHARS",
    "MAX_ANSWER_CHARS",
    "REL_TOL",
    "STRICT",
    "Number",
    "VerifierTimeout",
    "answers_equivalent",
    "assigned_value",
    "check_mode",
    "extract_answer",
    "fast_equivalence",
    "final_statement",
    "final_value",
    "find_boxed",
    "math_spans",
    "matrix_cells",
    "normalize_answer",
    "numbers_equal",
    "parse_number",
    "parse_written_number",
    "reference_answer",
    "rounds_to",
    "symbolic_equivalence",
    "symbolic_equivalence_in_thread",
    "symbolic_equivalence_in_workers",
    "sympy_ready",
    "unit_match",
]
