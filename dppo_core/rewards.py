"""Rewards: the final answer of a completion, its equivalence to the reference answer, and reward functions.

A reward is computed for every completion of every RL step, so it has to be right *and* fast. The
correctness reward is

    r(completion, answer) = 1  if  extract_answer(completion, mode) ≡ answer  else 0

**Extraction** has two modes (:func:`extract_answer`):

- ``"strict"``, the RL reward's (:func:`math_reward`, :func:`accuracy_reward` and the trainer use it): the
  last ``\\boxed{}``, else GSM8K's ``#### N``, else an explicit "the answer is ..." ending. A policy is
  rewarded for stating its answer in the form the prompt asks for, so the format is learned.
- ``"lenient"``, evaluation's (``dppo eval`` and :func:`dppo_core.evaluate.evaluate_benchmarks` by default): the
  same, and when nothing is boxed, the final answer as a reader (or math-verify) finds it: the math right
  after "the answer is", else the last math of the last sentence that has any (inline ``$...$``, ``\\(...\\)``,
  display ``\\[...\\]``, ``$$...$$``, ``align``: its last line, the value after ``x =`` or at the end of a
  chain ``3 \\times 4 = 12``), else that sentence's last number ("so she has 18 left."). A completion that
  states a right answer without the box is judged right, as a human grader would.

**Equivalence** ≡ is decided by the first of these checks that applies:

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
   prediction that rounds to it at the precision it is written to, within half a unit of its last digit (``1.068
   \\times 10^{16}`` for ``1.07e16``, not ``1.06 \\times 10^{16}``), or a prediction written less precisely, to 3
   or more significant digits, that it rounds to (``2.78e-6`` for ``2.7778e-6``; see :func:`rounds_to`).
3. **Matrix fast path**: both sides are matrices in any usual environment (``pmatrix``, ``bmatrix``,
   ``Bmatrix``, ``matrix``, ``smallmatrix``, ``\\left[\\begin{array}{cc}...\\end{array}\\right]``), compared
   entry by entry with these checks; a different shape is False (:func:`matrix_cells`).
4. **Symbolic path** (milliseconds, sometimes seconds): the registry's ``math-verify`` parses both sides
   to SymPy and compares them (sets, intervals, matrices, expressions, equations), under a per-call time
   limit; e-notation is rewritten as a power of ten first and matrices as ``pmatrix`` (:func:`sympy_ready`).
   When the reference is a plain number and the prediction has a real value (``\\sqrt{2}/2``), the numeric
   rule of 2 decides on the parsed values, so the two paths never disagree on a number. A call that runs
   out of time scores 0.

Reward functions follow TRL's convention, ``fn(prompts, completions, **dataset_columns) -> list[float]``,
with completions as strings or as conversations (``[{"role": "assistant", "content": ...}]``), so TRL
reward functions and ours are interchangeable. :func:`math_rewards` scores many completions at once and
sends the symbolic checks to worker processes when there are many (the verifier is CPU-bound).

Departures from common practice, and why:

1. No "last number in the text" fallback in strict extraction: it rewards a policy for ending on any number
   and is an easy reward hack. The lenient mode, for evaluation only, reads the last sentence's number.
2. The numeric checks compare with a *relative* tolerance, where math-verify rounds both sides to 6
   decimals (which makes ``1.24e-8`` equal to ``1.25e-8``, and ``0.0000673`` equal to ``0.0000672``), and
   a rounded reference with the tolerance its own last digit implies. Scientific answers (Minerva) are
   therefore judged to the digits the reference gives, no more and no less.
3. Percent signs are decoration (``50\\%`` is 50, as benchmark answers write it), on both paths.
4. The time limit is our own (``signal.setitimer`` around parsing *and* comparison), not math-verify's
   (whole seconds, and separate for each step). Signals only work in a process's main thread, so a call
   from any other thread runs the symbolic check in a worker process and waits with a deadline.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds one symbolic equivalence check may take before it scores 0.
DEFAULT_TIMEOUT = 2.0
#: Relative tolerance of the numeric fast path.
REL_TOL = 1e-6
#: Extracted answers longer than this are not parsed (no real final answer is this long).
MAX_ANSWER_CHARS = 1_000
#: Lenient extraction reads at most this many characters at the end of a completion (or after "the answer is").
LENIENT_TAIL_CHARS = 4_000

#: Extraction mode of the RL reward: the answer must be stated in the form the prompt asks for (``\\boxed{}``).
STRICT = "strict"
#: Extraction mode of evaluation: when nothing is boxed, the final answer stated in the last sentence or display.
LENIENT = "lenient"
EXTRACTION_MODES: tuple[str, ...] = (STRICT, LENIENT)

Completion = str | list[dict[str, Any]]  # a string, or a TRL-style conversation
RewardFunction = Callable[..., list[float]]

# --------------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE
)


def completion_text(completion: Completion) -> str:
    """The text of a completion: the string itself, the content of a conversation's last message (TRL passes
    conversational completions as ``[{"role": "assistant", "content": "..."}]``), or the ``text`` of an object
    that has one (a :class:`dppo_core.rollout.Completion`). An empty conversation is ``""`` (it scores 0).

    Raises:
        TypeError: for anything else, naming its type, rather than scoring it 0 without a word.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        last = completion[-1]
        if isinstance(last, dict) and isinstance(last.get("content"), str):
            return last["content"]
    elif isinstance(getattr(completion, "text", None), str):
        return completion.text
    raise TypeError(f"a completion must be a string, a conversation (a list of {{'role', 'content'}} dicts) or have "
                    f"a .text string (a dppo_core.rollout.Completion); got {type(completion).__name__}: "
                    f"{str(completion)[:80]!r}")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The contents of the brace group opening at ``text[start] == "{"`` and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def find_boxed(text: str) -> list[tuple[str, int, int]]:
    """Every complete ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed X`` in ``text``: (content, start, end).

    Braces nest (``\\boxed{\\frac{1}{2}}``). ``\\boxed 5`` (no braces) takes the next token, up to a space,
    ``$`` or end of line. A box left open (a truncated completion) is not in the list.
    """
    found = []
    for cmd in _BOX_COMMANDS:
        pos = text.find(cmd)
        while pos >= 0:
            after = pos + len(cmd)
            nxt = pos + 1
            if after < len(text) and text[after] == "{":
                group = _braced(text, after)
                if group is not None:
                    found.append((group[0], pos, group[1]))
                    nxt = group[1]
            elif after < len(text) and text[after] == " ":
                m = re.match(r" +([^\s$]+)", text[after:])
                if m:
                    found.append((m.group(1), pos, after + m.end()))
                    nxt = after + m.end()
            pos = text.find(cmd, nxt)
    found.sort(key=lambda item: item[1])
    return found


def check_mode(mode: str) -> str:
    """``mode`` if it is an extraction mode (:data:`EXTRACTION_MODES`), else a ValueError naming them."""
    if mode not in EXTRACTION_MODES:
        raise ValueError(f"unknown answer extraction mode {mode!r}; choose {' or '.join(map(repr, EXTRACTION_MODES))}")
    return mode


def extract_answer(text: str, mode: str = STRICT) -> str | None:
    """The final answer of a completion, or None when it states none.

    ``mode="strict"`` (the RL reward's), in order of precedence:

    1. the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed X``);
    2. GSM8K's ``#### N``: the rest of the line after the last ``####``;
    3. fallback: the text after the last "the answer is", "final answer:" or "answer:", up to the end of
       its line, without a trailing period or ``$`` (e.g. "... so the answer is 42." gives ``"42"``).

    ``mode="lenient"`` (evaluation) takes 1 and 2 alike; then the math or the rest of the sentence right after
    the last "the answer is" / "answer:", unless that reads as prose; then the final answer stated at the end
    of the text: the last math (``$...$``, ``\\(...\\)``, ``\\[...\\]``, ``$$...$$``, ``equation``/``align``) of the
    last sentence that has any, else that sentence's last number (see :func:`final_statement`).

    Never raises on odd text: anything that is not a string gives None. An unknown ``mode`` is a ValueError.
    """
    check_mode(mode)
    if not isinstance(text, str):
        return None
    boxes = find_boxed(text)
    if boxes:
        return boxes[-1][0].strip()
    hashes = text.rfind("####")
    if hashes >= 0:
        answer = text[hashes + 4 :].strip().split("\n", 1)[0].strip()
        return answer or None
    last = max(_ANSWER_IS.finditer(text), key=lambda m: m.start(), default=None)
    if mode == LENIENT:
        stated = _stated_after(text[last.end() :]) if last is not None else None
        if stated and not _prose_like(stated):  # not "To find the answer: we add the two"
            return stated
        return final_statement(text)
    if last is not None:
        answer = text[last.end() :].split("\n", 1)[0].strip()
        answer = re.sub(r"[\s.$]+$", "", answer).strip().lstrip("$").strip()
        return answer or None
    return None


# --- lenient extraction: the final answer stated without a box -------------------------------------------

# display math first (unambiguous delimiters); single-dollar inline math is paired separately
_DISPLAY_MATH = re.compile(
    r"\$\$(?P<dd>.+?)\$\$|\\\[(?P<sq>.+?)\\\]|\\\((?P<pa>.+?)\\\)"
    r"|\\begin\{(?P<env>equation|align|gather|multline|displaymath|math)(?P<star>\*?)\}(?P<body>.+?)"
    r"\\end\{(?P=env)(?P=star)\}",
    re.DOTALL,
)
_DOLLAR = re.compile(r"(?<!\\)\$")
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}\b")
# a sentence ends at . ! or ? before white space (not a decimal point), or at a blank line
_SENTENCE_END = re.compile(r"(?<!\\)[.!?](?=\s)|\n\s*\n")
_LAST_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)")
_RELATION = re.compile(r"\\approx|\\simeq|(?<![<>\\])=(?!=)")  # 5!=120 is a factorial, \neq is LaTeX's "not equal"
_ARITHMETIC = re.compile(r"\\(?:frac|dfrac|tfrac|times|cdot|div|sqrt|left|right|pi)|\\[$%,!;:]|[\d\s+\-*/^().{}\[\],!]")
_ASY = re.compile(r"\[asy\].*?(?:\[/asy\]|\Z)", re.DOTALL)  # Asymptote figure code (MATH) states no answer
_GREEK = (r"(?:alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|xi|rho|"
          r"sigma|tau|upsilon|phi|varphi|chi|psi|omega|Gamma|Delta|Theta|Lambda|Xi|Sigma|Upsilon|Phi|Psi|Omega)\b")
_INDEX = r"(?:\s*_\s*(?:\{[^{}]*\}|\w))?(?:\s*(?:'|\^\s*\{?\s*\\prime\s*\}?))*"
# what an answer may name before its value: x, AB, f(x), a_n, \theta, \mathbf{v}, \text{Area}
_NAME = (rf"(?:[A-Za-z]{{1,3}}{_INDEX}(?:\s*\([^()]*\))?|\\{_GREEK}{_INDEX}"
         rf"|\\(?:mathbf|mathrm|text|vec|bar|hat|overline|boldsymbol|bold)\s*\{{[^{{}}]*\}}{_INDEX})")
# a bare variable (x, f(x), a_n, \theta) or emphasis: stated in prose ("the value of $x$"), seldom an answer
_VARIABLE = re.compile(rf"^\s*(?:[A-Za-z]{_INDEX}(?:\s*\([^()]*\))?|\\{_GREEK}{_INDEX}|\\emph\s*\{{[^{{}}]*\}})\s*$")
_IS_NAME = re.compile(rf"^\s*{_NAME}\s*$")


def _prose_like(content: str) -> bool:
    """Whether a ``$...$`` span reads as prose (two dollar amounts: ``$18 and spends $``), not as math:
    two or more words and no LaTeX command, ``^``, ``_`` or ``=``."""
    return not re.search(r"[\\^_=]", content) and len(_PROSE_WORD.findall(content)) >= 2


def math_spans(text: str) -> list[tuple[int, int, str]]:
    """The math of ``text`` as (start, end, content), in order: display math, ``\\(...\\)`` and ``$...$``.

    A ``$`` whose span up to the next ``$`` reads as prose is a dollar sign (GSM8K writes ``$18``), not math.
    """
    spans, masked = [], list(text)
    for m in _DISPLAY_MATH.finditer(text):
        content = next(g for g in (m.group("dd"), m.group("sq"), m.group("pa"), m.group("body")) if g is not None)
        spans.append((m.start(), m.end(), content))
        masked[m.start() : m.end()] = " " * (m.end() - m.start())
    rest = "".join(masked)
    dollars = [m.start() for m in _DOLLAR.finditer(rest)]
    i = 0
    while i + 1 < len(dollars):
        a, b = dollars[i], dollars[i + 1]
        content = rest[a + 1 : b]
        if content.strip() and "\n\n" not in content and not _prose_like(content):
            spans.append((a, b + 1, content))
            i += 2
        else:
            i += 1
    return sorted(spans)


def _split_relations(math: str) -> tuple[list[str], list[str]]:
    """``math`` split at its top-level ``=`` / ``\\approx`` (not inside braces): (parts, relations)."""
    parts, rels, depth, start = [], [], 0, 0
    for m in re.finditer(r"[{}]|" + _RELATION.pattern, math):
        tok = m.group(0)
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
        elif depth == 0:
            parts.append(math[start : m.start()])
            rels.append(tok)
            start = m.end()
    parts.append(math[start:])
    return parts, rels


_LINE_TOKENS = re.compile(r"\\begin\{[^{}]*\}|\\end\{[^{}]*\}|\\\\|[{}&]")


def _last_line(math: str) -> str:
    """The last non-empty line of a multi-line display (``align``), without its ``&`` alignment marks.

    Lines end at ``\\\\`` outside braces and environments (a matrix's rows are not lines).
    """
    depth, lines, start, marks = 0, [], 0, set()
    for m in _LINE_TOKENS.finditer(math):
        tok = m.group(0)
        if tok == "{" or tok.startswith("\\begin"):
            depth += 1
        elif tok == "}" or tok.startswith("\\end"):
            depth -= 1
        elif depth == 0 and tok == "&":
            marks.add(m.start())
        elif depth == 0:
            lines.append((start, m.start(), marks))
            start, marks = m.end(), set()
    lines.append((start, len(math), marks))
    for lo, hi, marks in reversed(lines):
        line = "".join(" " if math[i] == "&" and i in marks else math[i] for i in range(lo, hi))
        if line.strip():
            return line
    return ""


def final_value(math: str) -> str:
    """The answer a piece of math states: ``x = 3`` gives ``3``, ``3 \\times 4 = 12`` gives ``12``.

    Of a multi-line display (``align``) the last line counts. Splits at top-level ``=`` and ``\\approx`` and
    keeps the last part after an ``=`` that is not a bare variable (``x = \\frac13 \\approx 0.33`` gives
    ``\\frac13``, ``36 - 19 = 17 = x`` gives ``17``), when the left side is a name (``x``, ``f(x)``, ``a_n``),
    plain arithmetic, or the first of several relations; an equation with anything else on the left
    (``y' + y = 0``) is the answer itself. Trailing punctuation and spacing are dropped.
    """
    s = re.sub(r"(?:\\[,;:! ]|\\q?quad|[\s.,;])+$", "", _last_line(math).strip())
    parts, rels = _split_relations(s)
    if len(parts) == 1 or not parts[-1].strip():
        return s
    lhs = parts[0]
    if len(parts) == 2 and lhs.strip() and not (_IS_NAME.match(lhs) or not _ARITHMETIC.sub("", lhs).strip()):
        return s
    after = [i for i in range(1, len(parts)) if rels[i - 1] == "="] or [len(parts) - 1]
    keep = next((i for i in reversed(after) if not _VARIABLE.match(parts[i])), after[-1])
    return parts[keep].strip()


def _stated_after(tail: str) -> str | None:
    """The answer right after "the answer is": its math, else the rest of its sentence."""
    tail = tail[:LENIENT_TAIL_CHARS].lstrip(" \t*:").lstrip()
    spans = math_spans(tail)
    if spans and spans[0][0] == 0:
        return final_value(spans[0][2]) or None
    line = tail.split("\n", 1)[0]
    answer = _SENTENCE_END.split(line, maxsplit=1)[0]
    answer = re.sub(r"[\s.!?*$]+$", "", answer).strip().strip("*").strip()
    return answer or None


def final_statement(text: str, sentences: int = 3) -> str | None:
    """The final answer stated at the end of ``text`` without a box (lenient extraction), or None.

    Looks at the last ``sentences`` sentences, last first. In each, the value of its last math that is not
    a bare variable (:func:`final_value`) wins, then its last number outside math; a bare variable (``$x$``
    in "the value of $x$") only if nothing else is found. Sentences end at ``.``/``!``/``?`` before white space or
    at a blank line, outside math, so a display equation belongs to the sentence that introduces it.
    Asymptote code (``[asy]...[/asy]``) is skipped.
    """
    body = _ASY.sub(" ", text[-2 * LENIENT_TAIL_CHARS :]).rstrip()
    if len(body) > LENIENT_TAIL_CHARS:  # the end is where the answer is; start at a paragraph if one is near
        body = body[-LENIENT_TAIL_CHARS:]
        cut = body.find("\n\n")
        body = body[cut:] if 0 <= cut < LENIENT_TAIL_CHARS // 2 else body
    if not body.strip():
        return None
    spans = math_spans(body)
    inside = [False] * len(body)
    for a, b, _ in spans:
        inside[a:b] = [True] * (b - a)
    ends = [m.end() for m in _SENTENCE_END.finditer(body) if not inside[m.start()] and m.end() < len(body)]
    bounds = [0, *ends, len(body)]
    fallback = None
    for k in range(len(bounds) - 1, max(0, len(bounds) - 1 - sentences), -1):
        lo, hi = bounds[k - 1], bounds[k]
        values = [v for v in (final_value(c) for a, _, c in spans if lo <= a < hi) if v]
        stated = [v for v in values if not _VARIABLE.match(v)]
        if stated:
            return stated[-1]
        numbers = _LAST_NUMBER.findall("".join(" " if inside[i] else body[i] for i in range(lo, hi)))
        if numbers:
            return numbers[-1]
        fallback = fallback or (values[-1] if values else None)
    return fallback


# --------------------------------------------------------------------------------------------------
# Equivalence: string check and numeric fast path
# --------------------------------------------------------------------------------------------------

_SPACING = re.compile(r"\\left|\\right|\\[!,;: ]|\\displaystyle|\\quad|\\qquad|~|\s+")
_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}$")


def normalize_answer(answer: str) -> str:
    """A canonical string for the string check: LaTeX spacing and decoration removed.

    Only transformations that cannot change the value: ``$``, ``\\left``/``\\right``, spacing commands
    and whitespace, ``\\dfrac``/``\\tfrac`` → ``\\frac``, a trailing period, a ``\\text{...}`` around the
    whole answer.
    """
    s = answer.strip().strip("$").strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING.sub("", s)
    s = s.rstrip(".")
    m = _TEXT_WRAP.match(s)
    if m:
        s = m.group(1)
    return s


_UNIT_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_TIMES_TEN = re.compile(r"^(.*?)\s*(?:\\times|\\cdot|\*|x)\s*10\s*\^\s*\{?\s*([+-]?\d{1,4})\s*\}?$")
_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,4})?$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^([+-]?)\\frac(?:\{\s*([+-]?\d+)\s*\}\{\s*([+-]?\d+)\s*\}|(\d)(\d))$")
_SLASH = re.compile(r"^([+-]?\d+)\s*/\s*([+-]?\d+)$")
_UNIT_WORDS = re.compile(r"^(.*?\d\.?)\s*\b(?!(?:and|or|to)\b)[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})?\.?$")


@dataclass(frozen=True)
class Number:
    """A plain-number answer: its exact value and, for a rounded decimal, the precision it is written to.

    ``ulp`` is the unit in the last written place (``1.07e16``: 1e14; ``41.8``: 0.1; ``4e33``: 1e33) and
    ``digits`` the significant digits (3, 3, 1), for numbers written with a decimal point or a power of ten;
    None and 0 for integers and fractions, which are exact.
    """

    value: Fraction
    ulp: Fraction | None = None
    digits: int = 0
    scientific: bool = False  # written with a power of ten (1.07e16, 6.5 \times 10^{-2})


def _written(mantissa: str, exponent: int, power: bool) -> Number:
    """The :class:`Number` written as ``mantissa`` times ``10**exponent`` (``power``: with a power of ten)."""
    value = Fraction(mantissa) * Fraction(10) ** exponent if exponent else Fraction(mantissa)
    if "." not in mantissa and not power:
        return Number(value)
    whole, _, frac = mantissa.lstrip("+-").partition(".")
    digits = len((whole + frac).lstrip("0")) or 1
    return Number(value, Fraction(10) ** (exponent - len(frac)), digits, power)


def parse_number(answer: str) -> Fraction | None:
    """The value of a plain-number answer as an exact fraction, or None if it is not a plain number.

    Accepts ``42``, ``-3.5``, ``1,000``, ``1{,}000``, ``1.2e-8``, ``6.5 \\times 10^{-2}``, ``10^{16}``,
    ``3/4``, ``\\frac{3}{4}``, ``\\frac34``, with ``$``/``\\$``, ``%``/``\\%``, degrees and units around them
    (``5\\text{ cm}``, ``18 dollars``, ``1.07 \\times 10^{16} \\mathrm{~cm}^{-3}``, ``3 \\times 10^8 m/s``). A
    percent sign is a decoration, not a division by 100: ``50\\%`` is 50, as benchmark answers write it.
    """
    number = parse_written_number(answer)
    return None if number is None else number.value


def parse_written_number(answer: str) -> Number | None:
    """:func:`parse_number` with the precision the number is written to (a :class:`Number`), or None."""
    s = answer.strip()
    if not s or len(s) > 100:
        return None
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("{,}", ",").replace(",\\!", ",").replace("\\!", "").replace("\\,", "")
    s = _DEGREES.sub("", s)
    number = _plain_number(s)
    return number if number is not None else _number_with_unit(s)


def _plain_number(s: str) -> Number | None:
    s = _UNIT_TEXT.sub("", s).strip()
    m = _UNIT_WORDS.match(s)
    if m and not re.search(r"\b(?:and|or|to)\b", s):
        s = m.group(1)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip().rstrip(".").strip()
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1].strip()
    if not s:
        return None
    exponent = 0
    m = _TIMES_TEN.match(s)
    power = m is not None
    if m:
        s, exponent = m.group(1).strip(), int(m.group(2))
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _NUMBER.match(s):
        mantissa, _, exp = s.lower().partition("e")
        if abs(int(exp or 0) + exponent) > 400:  # keep exact arithmetic cheap
            return None
        return _written(mantissa, exponent + int(exp or 0), power or bool(exp))
    value = None
    m = _FRAC.match(s)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        if int(den) == 0 or len(num) > 50 or len(den) > 50:
            return None
        value = Fraction(int(num), int(den)) * (-1 if m.group(1) == "-" else 1)
    else:
        m = _SLASH.match(s)
        if m and int(m.group(2)) != 0 and len(s) <= 100:
            value = Fraction(int(m.group(1)), int(m.group(2)))
    if value is None:
        return None
    return Number(value * Fraction(10) ** exponent if exponent else value)


# A number, optionally times a power of ten (or a bare power of ten), then a unit: what _plain_number cannot
# read because the unit has a power or a slash (\mathrm{~cm}^{-3}, \mathrm{ergs} / \mathrm{s}) or is bare
# after a power of ten (3 \times 10^8 m/s).
_SCIENTIFIC = re.compile(
    r"^(?:10\s*\^\s*(?:\{\s*(?P<p1>[+-]?\d{1,4})\s*\}|(?P<p2>[+-]?\d{1,4}))"
    r"|(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,4})?)"
    r"(?:\s*(?:\\times|\\cdot)\s*10\s*\^\s*(?:\{\s*(?P<e1>[+-]?\d{1,4})\s*\}|(?P<e2>[+-]?\d{1,4})))?)"
    r"(?P<tail>.*)$",
    re.DOTALL,
)
_UNIT_GROUP = re.compile(r"\\(?:text|textrm|textnormal|mathrm|mbox|rm|operatorname)\s*\{([^{}]*)\}")
_UNIT_SYMBOL = re.compile(r"\\(?:mu|AA|Omega|odot|circ|prime|ell|hbar)(?![A-Za-z])")
_UNIT_POWER = re.compile(r"\^\s*(?:\{\s*[+-]?\s*\d+(?:\.\d+)?\s*\}|[+-]?\d)")
_UNIT_JOINS = re.compile(r"\\[,;:! ]|\\cdot|\\quad|_|[~/*(){}\s]")
_NOT_UNITS = frozenset("and or to for if is are when where with not but than then so no yes else all any".split())


def _is_unit(tail: str, bare_ok: bool) -> bool:
    """Whether ``tail`` (what follows a number) is a unit: words and unit symbols with powers and slashes.

    Bare words count only after a power of ten (``bare_ok``); elsewhere a unit must be in ``\\text{}`` or
    ``\\mathrm{}`` (a bare ``x`` after a number is a variable). English joining words are never units.
    """
    wrapped = bool(_UNIT_GROUP.search(tail))
    if not (wrapped or bare_ok):
        return False
    words = _UNIT_JOINS.sub(" ", _UNIT_POWER.sub(" ", _UNIT_SYMBOL.sub(" u ", _UNIT_GROUP.sub(r" \1 ", tail))))
    words = words.split()
    return bool(words) and all(w.isascii() and w.isalpha() and w.lower() not in _NOT_UNITS for w in words)


def _unit_match(s: str) -> re.Match | None:
    """The :data:`_SCIENTIFIC` match of ``s`` when what follows its number is nothing or a unit."""
    m = _SCIENTIFIC.match(s.strip())
    if not m:
        return None
    tail = m.group("tail").strip().rstrip(".").strip()
    power = any(m.group(g) is not None for g in ("e1", "e2", "p1", "p2")) or "e" in (m.group("num") or "").lower()
    return m if not tail or _is_unit(tail, bare_ok=power) else None


def _number_with_unit(s: str) -> Number | None:
    m = _unit_match(s)
    if not m:
        return None
    power = any(m.group(g) is not None for g in ("e1", "e2", "p1", "p2"))
    mantissa, _, exp = (m.group("num") or "1").lower().partition("e")
    exponent = int(m.group("e1") or m.group("e2") or m.group("p1") or m.group("p2") or 0) + int(exp or 0)
    if abs(exponent) > 400:
        return None
    if m.group("num") is None:  # a bare power of ten is exact
        return Number(Fraction(10) ** exponent)
    return _written(mantissa, exponent, power or bool(exp))


def numbers_equal(a: Fraction, b: Fraction, rel_tol: float = REL_TOL) -> bool:
    """Equal exactly; or, unless both are integers, within ``rel_tol`` of the larger magnitude.

    Integers compare exactly however large (1450001 is not 1450000); the tolerance is for decimals
    that round a fraction (``0.333333`` for ``1/3``).
    """
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False
    return abs(a - b) <= Fraction(str(rel_tol)) * max(abs(a), abs(b))


def rounds_to(pred: Fraction, gold: Number, pred_written: Number | None = None) -> bool:
    """Whether ``pred`` agrees with a rounded ``gold`` to the precision ``gold`` is written to.

    True when ``pred`` rounds to ``gold`` (within half a unit of its last place: 1.068e16 for 1.07e16), or
    when ``pred`` is itself written less precisely, to 3 or more significant digits, and ``gold`` rounds to it
    (2.78e-6 for 2.7778e-6). Only for a ``gold`` written with a power of ten (Minerva Math's measurements): a
    plain decimal is taken as exact, as MATH's and OlympiadBench's are (``326.54`` is not ``326.5``), and an
    integer or a fraction always is.
    """
    if gold.ulp is None or not gold.scientific:
        return False
    diff = abs(pred - gold.value)
    slack = Fraction(1, 10**12) * max(abs(pred), abs(gold.value))  # float noise of a symbolic value
    if diff <= gold.ulp / 2 + slack:
        return True
    p = pred_written
    return bool(p is not None and p.ulp is not None and p.ulp > gold.ulp and p.digits >= 3
                and diff <= p.ulp / 2 + slack)


_ASSIGNED = re.compile(rf"^\s*(?:{_NAME}\s*)?(?:=|\\approx|\\simeq)\s*(?P<value>.+)$", re.DOTALL)


def assigned_value(answer: str) -> str | None:
    """The value of ``x = 5``, ``L \\approx 4.5 \\times 10^{33}``, ``f(x) = 2``: the part after the relation."""
    m = _ASSIGNED.match(answer) if len(answer) <= MAX_ANSWER_CHARS else None
    if not m or _RELATION.search(m.group("value")):
        return None
    return m.group("value")


_MATRIX = re.compile(
    r"^(?P<open>\\left\s*[\[(]|[\[(])?\s*\\begin\{(?P<env>pmatrix|bmatrix|Bmatrix|matrix|smallmatrix|array)\}"
    r"(?P<spec>\s*\{[^{}]*\})?(?P<body>.*)\\end\{(?P=env)\}\s*(?P<close>\\right\s*[\])]|[\])])?$",
    re.DOTALL,
)
_ROW_BREAK = re.compile(r"\\\\(?:\s*\[[^\]]*\])?")
_RULES = re.compile(r"\\(?:hline|hdashline|cline\s*\{[^{}]*\})")


def matrix_cells(answer: str) -> list[list[str]] | None:
    """The entries of a matrix answer, row by row, or None when ``answer`` is not one matrix.

    Any usual environment: ``pmatrix``, ``bmatrix``, ``Bmatrix``, ``matrix``, ``smallmatrix``, or ``array``
    between brackets (``\\left[\\begin{array}{cc} ... \\end{array}\\right]``), with an optional ``M =`` in
    front. ``vmatrix`` is a determinant, not a matrix, and a bare ``array`` may be a table: neither counts.
    """
    if "\\begin" not in answer or len(answer) > MAX_ANSWER_CHARS:
        return None
    s = answer.strip().strip("$").strip()
    value = assigned_value(s)
    m = _MATRIX.match(value.strip() if value is not None else s)
    if not m or bool(m.group("open")) != bool(m.group("close")):
        return None
    body = m.group("body")
    if (m.group("env") == "array") != bool(m.group("spec")) or (m.group("env") == "array" and not m.group("open")):
        return None
    if "\\begin" in body or "\\end" in body:
        return None
    rows = []
    for row in _ROW_BREAK.split(_RULES.sub(" ", body)):
        if row.strip():
            rows.append([cell.strip() for cell in _split_top_level(row, "&")])
    if not rows or any(len(r) != len(rows[0]) for r in rows) or any(not c for r in rows for c in r):
        return None
    return rows


def _split_top_level(s: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _matrices_equivalence(pred: list[list[str]], gold: list[list[str]]) -> bool | None:
    if len(pred) != len(gold) or len(pred[0]) != len(gold[0]):
        return False
    verdicts = [fast_equivalence(p, g) for prow, grow in zip(pred, gold, strict=True)
                for p, g in zip(prow, grow, strict=True)]
    if False in verdicts:
        return False
    return True if all(verdicts) else None


def fast_equivalence(pred: str, gold: str) -> bool | None:
    """The verdict of the string check and the fast paths, or None when none decides.

    True when the normalised strings match, or both are plain numbers that agree (:func:`numbers_equal`
    or, for a rounded decimal reference, :func:`rounds_to`), or both are matrices of the same shape whose
    entries all agree; False when plain numbers differ, matrices differ in shape or in an entry the fast
    path decides; None otherwise (the symbolic path decides). A prediction ``x = 5`` is read as ``5``.
    """
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    if "\\begin" in pred or "\\begin" in gold:
        mp, mg = matrix_cells(pred), matrix_cells(gold)
        if mp is not None and mg is not None:
            return _matrices_equivalence(mp, mg)
        return None
    b = parse_written_number(gold)
    if b is None:
        return None
    a = parse_written_number(pred)
    if a is None:
        value = assigned_value(pred)
        a = parse_written_number(value) if value is not None else None
    if a is None:
        return None
    return numbers_equal(a.value, b.value) or rounds_to(a.value, b, a)


# --------------------------------------------------------------------------------------------------
# Symbolic path with a time limit
# --------------------------------------------------------------------------------------------------


class VerifierTimeout(BaseException):
    """Raised inside a symbolic check when its time is up.

    A ``BaseException`` so that the ``except Exception`` blocks inside SymPy and math-verify do not
    swallow it and carry on.
    """


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own timeout is off; ours is on, so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


@functools.lru_cache(maxsize=8192)
def _parse(answer: str):
    """math-verify's parse of one bare answer (cached: a group's G completions often agree)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(f"${answer}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=None)


_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,4})(?![\w.])")


def sympy_ready(answer: str) -> str:
    """``answer`` as math-verify reads it right: e-notation as a power of ten (math-verify reads ``1.07e16``
    as ``1.07 \\cdot e \\cdot 16``), a matrix in any environment as a ``pmatrix``, a plain number without its
    unit or percent sign (as :func:`parse_number` reads it)."""
    def power(m: re.Match) -> str:
        return f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}"

    cells = matrix_cells(answer)
    if cells is not None:
        rows = " \\\\ ".join(" & ".join(sympy_ready(c) for c in row) for row in cells)
        return f"\\begin{{pmatrix}} {rows} \\end{{pmatrix}}"
    if len(answer) <= 100 and parse_written_number(answer) is not None:
        answer = answer.replace("\\%", "").replace("%", "")  # a percent sign is a decoration (parse_number)
        m = _unit_match(answer)
        if m is not None and m.group("tail").strip():  # a number and its unit: the number
            answer = answer.strip()[: m.start("tail")]
    return _E_NOTATION.sub(power, answer)


def _real_value(expr) -> Fraction | None:
    """The value of a parsed real number (``x = 5`` gives 5), or None for anything else.

    Exact for integers and fractions, else to 30 digits; None for a power tower or a huge power, whose
    evaluation could run in C code that the time limit cannot stop.
    """
    import sympy

    if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Symbol):
        expr = expr.rhs
    if not isinstance(expr, sympy.Expr) or not expr.is_number:
        return None
    if expr.is_Rational:
        return Fraction(int(expr.p), int(expr.q))
    if any(not p.exp.is_Atom or abs(p.exp) > 1000 for p in expr.atoms(sympy.Pow)) or expr.is_real is not True:
        return None
    value = sympy.N(expr, 30)
    return Fraction(str(value)) if value.is_finite else None


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import verify

    gold_parsed, pred_parsed = _parse(sympy_ready(gold)), _parse(sympy_ready(pred))
    if not gold_parsed or not pred_parsed:
        return False
    gold_written = parse_written_number(gold)
    if gold_written is not None:
        # a plain-number reference: the fast path's rule on the parsed values, not math-verify's rounding to
        # 6 decimals (which makes 1.25e-8 equal to 1.24e-8), and a rounded reference's precision
        pred_value, gold_value = _real_value(pred_parsed[0]), _real_value(gold_parsed[0])
        if pred_value is not None and gold_value is not None:
            gold_written = Number(gold_value, gold_written.ulp, gold_written.digits)
            pred_written = parse_written_number(assigned_value(pred) or pred)
            return numbers_equal(pred_value, gold_value) or rounds_to(pred_value, gold_written, pred_written)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _on_alarm(signum, frame):
    raise VerifierTimeout


def _signals_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def symbolic_equivalence_in_thread(pred: str, gold: str, timeout: float) -> bool:
    """math-verify's verdict, with a ``timeout``-second alarm. Must run in a main thread.

    A timed-out or failed comparison is False. An alarm the caller had set (e.g. pytest-timeout) is
    restored afterwards with its remaining time.
    """
    previous_handler = signal.signal(signal.SIGALRM, _on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout)
    start = time.monotonic()
    try:
        return _math_verify_equal(pred, gold)
    except VerifierTimeout:
        logger.debug("symbolic check timed out after %.1f s", timeout)
        return False
    except Exception:  # a parser or SymPy error on odd input means "not shown equal"
        logger.debug("symbolic check failed", exc_info=True)
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:
            remaining = max(previous_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, previous_interval)


def _verify_pairs(pairs: list[tuple[str, str]], timeout: float) -> list[bool]:
    """Worker-process entry point: the symbolic verdict of each (pred, gold) pair."""
    out = []
    for pred, gold in pairs:
        try:
            out.append(symbolic_equivalence_in_thread(pred, gold, timeout))
        except VerifierTimeout:  # the alarm fired between the check and its cleanup
            out.append(False)
    return out


def _ping(_: int) -> None:
    time.sleep(0.05)  # long enough that every worker takes one ping, so all have started


def _warm_worker() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
    import math_verify  # noqa: F401  (import once per worker, before any deadline runs)


class _VerifierPool:
    """Worker processes for symbolic checks, created on first use and reused.

    On Linux the workers are forked: they start at once with math-verify already imported, and unlike
    ``spawn``/``forkserver`` they do not re-run the parent's ``__main__`` (a training script without an
    ``if __name__ == "__main__":`` guard would otherwise start again in every worker). A forked child
    of a multi-threaded parent (torch) is safe here because it only runs pure-Python SymPy code, never
    torch. Elsewhere (macOS, Windows) the platform's default ``spawn`` is used. Workers run each task
    in their main thread, so the alarm works there.
    A pool that misses a deadline is terminated (that is the only way to stop a check stuck in C code)
    and recreated on the next call.
    """

    def __init__(self) -> None:
        self._pool = None
        self._size = 0
        self._lock = threading.Lock()

    def get(self, processes: int):
        with self._lock:
            if self._pool is None or self._size != processes:
                self.close()
                ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
                self._pool = ctx.Pool(processes, initializer=_warm_worker)
                self._size = processes
                # wait for the workers to start and import math-verify, outside any check's deadline
                self._pool.map(_ping, range(2 * processes), chunksize=1)
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def run(self, chunks: list[list[tuple[str, str]]], timeout: float, processes: int) -> list[list[bool]]:
        """Verdicts for each chunk; chunks not finished by the deadline get all False."""
        pool = self.get(processes)
        pending = [pool.apply_async(_verify_pairs, (chunk, timeout)) for chunk in chunks]
        rounds = math.ceil(len(chunks) / processes)
        longest = max(len(c) for c in chunks)
        deadline = time.monotonic() + rounds * longest * timeout + 5.0
        results: list[list[bool]] = []
        stuck = False
        for chunk, job in zip(chunks, pending, strict=True):
            try:
                results.append(job.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except multiprocessing.TimeoutError:
                stuck = True
                results.append([False] * len(chunk))
        if stuck:
            logger.warning("reward workers missed their deadline; restarting them (unfinished checks score 0)")
            with self._lock:
                self.close()
        return results


_POOL = _VerifierPool()
atexit.register(_POOL.close)


def symbolic_equivalence(pred: str, gold: str, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """math-verify's verdict on ``pred ≡ gold`` within ``timeout`` seconds (False when time runs out).

    In a main thread the check runs here under an alarm; in any other thread it runs in a worker
    process (signals only work in main threads), so the time limit holds everywhere.
    """
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    if _signals_usable():
        return symbolic_equivalence_in_thread(pred, gold, timeout)
    return _POOL.run([[(pred, gold)]], timeout, processes=1)[0][0]


# --------------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------------


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


def math_reward(completion: Completion, answer: str, *, timeout: float = DEFAULT_TIMEOUT, mode: str = STRICT) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to ``answer``, else 0.0.

    ``answer`` is the reference's final answer (a worked solution ending in ``#### N`` or containing a
    ``\\boxed{}`` works too). ``mode`` is how the completion's answer is found (:func:`extract_answer`):
    ``"strict"`` for RL rewards (the default), ``"lenient"`` for evaluation. A comparison that takes longer
    than ``timeout`` seconds scores 0.0. Never raises, except a ValueError for an unknown ``mode`` and a TypeError
    for a ``completion`` that is none (:func:`completion_text`).
    """
    check_mode(mode)
    text = completion_text(completion)  # a TypeError for what is no completion, not a silent 0
    try:
        pred = extract_answer(text, mode)
        if pred is None or not isinstance(answer, str):
            return 0.0
        gold = reference_answer(answer)
        fast = fast_equivalence(pred, gold)
        if fast is not None:
            return float(fast)
        return float(symbolic_equivalence(pred, gold, timeout))
    except (Exception, VerifierTimeout):
        logger.debug("math_reward failed; scoring 0", exc_info=True)
        return 0.0


def default_num_workers() -> int:
    """Worker processes for batch scoring: the CPU cores available to this process, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def math_rewards(
    completions: Sequence[Completion],
    answers: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    num_workers: int | None = None,
    min_parallel: int = 32,
    mode: str = STRICT,
) -> list[float]:
    """:func:`math_reward` of each (completion, answer) pair, in parallel where it pays.

    The string check and numeric fast path run here for every pair (microseconds). Of the rest, the
    distinct (prediction, reference) pairs are checked symbolically: in ``num_workers`` worker processes
    when there are at least ``min_parallel`` of them, else here one by one. Same result as calling
    :func:`math_reward` on each pair (with the same extraction ``mode``).
    """
    check_mode(mode)
    if len(completions) != len(answers):
        raise ValueError(
            f"got {len(completions)} completions but {len(answers)} answers; pass one answer per completion "
            "(repeat a prompt's answer for each of its completions)"
        )
    rewards = [0.0] * len(completions)
    todo: dict[tuple[str, str], list[int]] = {}
    texts = [completion_text(c) for c in completions]  # a TypeError for what is no completion, not a silent 0
    for i, (text, answer) in enumerate(zip(texts, answers, strict=True)):
        try:
            pred = extract_answer(text, mode)
            if pred is None or not isinstance(answer, str):
                continue
            gold = reference_answer(answer)
            fast = fast_equivalence(pred, gold)
        except Exception:
            logger.debug("fast check failed; scoring 0", exc_info=True)
            continue
        if fast is not None:
            rewards[i] = float(fast)
        elif len(pred) <= MAX_ANSWER_CHARS and len(gold) <= MAX_ANSWER_CHARS:
            todo.setdefault((pred, gold), []).append(i)
    pairs = list(todo)
    workers = default_num_workers() if num_workers is None else num_workers
    if len(pairs) >= min_parallel and workers > 1:
        size = max(1, min(16, math.ceil(len(pairs) / (4 * workers))))
        chunks = [pairs[j : j + size] for j in range(0, len(pairs), size)]
        verdicts = [v for chunk in _POOL.run(chunks, timeout, workers) for v in chunk]
    else:
        verdicts = [symbolic_equivalence(pred, gold, timeout) for pred, gold in pairs]
    for pair, ok in zip(pairs, verdicts, strict=True):
        for i in todo[pair]:
            rewards[i] = float(ok)
    return rewards


def _answers_column(columns: dict[str, Any], n: int) -> list[str]:
    for key in ("answer", "solution"):
        if columns.get(key) is not None:
            values = list(columns[key])
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
            return [str(v) for v in values]
    raise ValueError(
        f"accuracy_reward needs the reference answers as a dataset column named 'answer' (or 'solution', "
        f"as TRL names it); got columns {sorted(columns)}"
    )


def accuracy_reward(prompts: Sequence[Any] | None, completions: Sequence[Completion], **columns: Any) -> list[float]:
    """TRL-style correctness reward: :func:`math_reward` of each completion against its row's answer.

    The answers come from the dataset column ``answer`` (or ``solution``, TRL's name).
    """
    return math_rewards(completions, _answers_column(columns, len(completions)))


def format_ok(text: str, max_tail_chars: int = 40) -> bool:
    """Whether a completion is well formed: exactly one non-empty ``\\boxed{}``, near the end.

    "Near the end" means at most ``max_tail_chars`` characters follow the box (a closing ``$``,
    ``\\]`` or sentence), so a completion that keeps talking after its answer, or was cut off inside
    the box, does not pass.
    """
    boxes = find_boxed(text)
    opened = sum(text.count(cmd) for cmd in _BOX_COMMANDS)
    if len(boxes) != 1 or opened != 1:
        return False
    content, _, end = boxes[0]
    return bool(content.strip()) and len(text[end:].strip()) <= max_tail_chars


def format_reward(prompts: Sequence[Any] | None, completions: Sequence[Completion], **columns: Any) -> list[float]:
    """TRL-style format reward: 1.0 where :func:`format_ok` holds, else 0.0."""
    return [float(format_ok(completion_text(c))) for c in completions]


def combine_rewards(
    reward_funcs: Sequence[RewardFunction], weights: Sequence[float] | None = None
) -> RewardFunction:
    """One reward function that returns ``Σ_j w_j · f_j(prompts, completions, **columns)``.

    Works with any TRL-style reward functions (ours or a TRL user's). ``weights`` defaults to all 1.
    """
    funcs = list(reward_funcs)
    ws = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
    if not funcs or len(ws) != len(funcs):
        raise ValueError(
            f"combine_rewards needs one or more reward functions and one weight per function; got "
            f"{len(funcs)} functions and {len(ws)} weights"
        )

    def combined(prompts: Sequence[Any] | None, completions: Sequence[Completion], **columns: Any) -> list[float]:
        total = [0.0] * len(completions)
        for fn, w in zip(funcs, ws, strict=True):
            scores = fn(prompts=prompts, completions=completions, **columns)
            if len(scores) != len(completions):
                raise ValueError(
                    f"reward function {getattr(fn, '__name__', fn)!r} returned {len(scores)} scores for "
                    f"{len(completions)} completions"
                )
            total = [t + w * (0.0 if s is None else s) for t, s in zip(total, scores, strict=True)]
        return total

    combined.__name__ = "+".join(f"{w:g}*{getattr(f, '__name__', 'reward')}" for f, w in zip(funcs, ws, strict=True))
    return combined
