"""The string check and the fast paths: normalization, plain numbers (units, scientific notation, the
precision a rounded reference is written to) and matrices, decided in microseconds
(:func:`fast_equivalence`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from dppo_core.grading.extract import MAX_ANSWER_CHARS, assigned_value

#: Relative tolerance of the numeric fast path.
REL_TOL = 1e-6

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
_NOT_UNITS = frozenset(("and or to for if is are when where with not but than then so no yes else all "
                        "any").split())


def _is_unit(tail: str, bare_ok: bool) -> bool:
    """Whether ``tail`` (what follows a number) is a unit: words and unit symbols with powers and slashes.

    Bare words count only after a power of ten (``bare_ok``); elsewhere a unit must be in ``\\text{}`` or
    ``\\mathrm{}`` (a bare ``x`` after a number is a variable). English joining words are never units.
    """
    wrapped = bool(_UNIT_GROUP.search(tail))
    if not (wrapped or bare_ok):
        return False
    text = _UNIT_JOINS.sub(" ", _UNIT_POWER.sub(" ", _UNIT_SYMBOL.sub(" u ", _UNIT_GROUP.sub(r" \1 ", tail))))
    words = text.split()
    return bool(words) and all(w.isascii() and w.isalpha() and w.lower() not in _NOT_UNITS for w in words)


def unit_match(s: str) -> re.Match | None:
    """The :data:`_SCIENTIFIC` match of ``s`` when what follows its number is nothing or a unit."""
    m = _SCIENTIFIC.match(s.strip())
    if not m:
        return None
    tail = m.group("tail").strip().rstrip(".").strip()
    power = (any(m.group(g) is not None for g in ("e1", "e2", "p1", "p2"))
             or "e" in (m.group("num") or "").lower())
    return m if not tail or _is_unit(tail, bare_ok=power) else None


def _number_with_unit(s: str) -> Number | None:
    m = unit_match(s)
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
    if ((m.group("env") == "array") != bool(m.group("spec"))
            or (m.group("env") == "array" and not m.group("open"))):
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

