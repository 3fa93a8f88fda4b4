"""Extraction: the final answer a completion states, in the strict mode (the RL reward's) or the lenient one.

``"strict"``: the last ``\\boxed{}``, else GSM8K's ``#### N``, else an explicit "the answer is ..." ending.
``"lenient"``: the same, and when nothing is boxed, the final answer as a reader finds it (the math right
after "the answer is", else the last math or number of the last sentence that has any). See
:func:`extract_answer` and :mod:`dppo_core.grading`.
"""

from __future__ import annotations

import re

#: Extracted answers longer than this are not parsed (no real final answer is this long).
MAX_ANSWER_CHARS = 1_000
#: Lenient extraction reads at most this many characters at the end of a completion (or after "the answer
#: is").
LENIENT_TAIL_CHARS = 4_000

#: Extraction mode of the RL reward: the answer must be stated in the form the prompt asks for
#: (``\\boxed{}``).
STRICT = "strict"
#: Extraction mode of evaluation: when nothing is boxed, the final answer stated in the last sentence or
#: display.
LENIENT = "lenient"
EXTRACTION_MODES: tuple[str, ...] = (STRICT, LENIENT)

# --------------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------------

#: The commands that box a final answer.
BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE
)


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
    for cmd in BOX_COMMANDS:
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
        raise ValueError(f"unknown answer extraction mode {mode!r}; choose "
                         f"{' or '.join(map(repr, EXTRACTION_MODES))}")
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
    of the text: the last math (``$...$``, ``\\(...\\)``, ``\\[...\\]``, ``$$...$$``, ``equation``/``align``)
    of the last sentence that has any, else that sentence's last number (see :func:`final_statement`).

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
# 5!=120 is a factorial, \neq is LaTeX's "not equal"
_RELATION = re.compile(r"\\approx|\\simeq|(?<![<>\\])=(?!=)")
_ARITHMETIC = re.compile(r"\\(?:frac|dfrac|tfrac|times|cdot|div|sqrt|left|right|pi)|\\[$%,!;:]|"
                         r"[\d\s+\-*/^().{}\[\],!]")
_ASY = re.compile(r"\[asy\].*?(?:\[/asy\]|\Z)", re.DOTALL)  # Asymptote figure code (MATH) states no answer
_GREEK = (r"(?:alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|xi|"
          r"rho|sigma|tau|upsilon|phi|varphi|chi|psi|omega|Gamma|Delta|Theta|Lambda|Xi|Sigma|Upsilon|Phi|Psi|"
          r"Omega)\b")
_INDEX = r"(?:\s*_\s*(?:\{[^{}]*\}|\w))?(?:\s*(?:'|\^\s*\{?\s*\\prime\s*\}?))*"
# what an answer may name before its value: x, AB, f(x), a_n, \theta, \mathbf{v}, \text{Area}
_NAME = (rf"(?:[A-Za-z]{{1,3}}{_INDEX}(?:\s*\([^()]*\))?|\\{_GREEK}{_INDEX}"
         rf"|\\(?:mathbf|mathrm|text|vec|bar|hat|overline|boldsymbol|bold)\s*\{{[^{{}}]*\}}{_INDEX})")
# a bare variable (x, f(x), a_n, \theta) or emphasis: stated in prose ("the value of $x$"), seldom an answer
_VARIABLE = re.compile(rf"^\s*(?:[A-Za-z]{_INDEX}(?:\s*\([^()]*\))?|\\{_GREEK}{_INDEX}"
                       rf"|\\emph\s*\{{[^{{}}]*\}})\s*$")
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
        content = next(g for g in (m.group("dd"), m.group("sq"), m.group("pa"), m.group("body"))
                       if g is not None)
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
    in "the value of $x$") only if nothing else is found. Sentences end at ``.``/``!``/``?`` before white
    space or at a blank line, outside math, so a display equation belongs to the sentence that introduces it.
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


# --- the value an answer assigns: x = 5 reads as 5 (the fast paths and the symbolic path use it) ---------

_ASSIGNED = re.compile(rf"^\s*(?:{_NAME}\s*)?(?:=|\\approx|\\simeq)\s*(?P<value>.+)$", re.DOTALL)


def assigned_value(answer: str) -> str | None:
    """The value of ``x = 5``, ``L \\approx 4.5 \\times 10^{33}``, ``f(x) = 2``: the part after the
    relation."""
    m = _ASSIGNED.match(answer) if len(answer) <= MAX_ANSWER_CHARS else None
    if not m or _RELATION.search(m.group("value")):
        return None
    return m.group("value")
