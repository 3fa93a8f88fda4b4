"""Rewards: the final answer of a completion, its equivalence to the reference answer, and reward functions.

A reward is computed for every completion of every RL step, so it has to be right *and* fast. The
correctness reward is

    r(completion, answer) = 1  if  extract_answer(completion) ≡ answer  else 0

where ≡ is mathematical equivalence, decided by the first of three checks that applies:

1. **String check** (microseconds): both sides equal after removing LaTeX spacing and decoration
   (``\\left``, ``\\!``, ``$``, ``\\dfrac`` → ``\\frac``, a trailing period). Equal strings are equal values.
2. **Numeric fast path** (microseconds): both sides are plain numbers (integers, decimals, scientific
   notation, ``a/b`` and ``\\frac{a}{b}``, thousands separators, with ``$``, ``\\%``, degrees and unit
   words stripped). They are compared as exact rationals: integers exactly, other numbers within a
   relative tolerance of 1e-6 (so ``0.333333`` matches ``1/3``).
3. **Symbolic path** (milliseconds, sometimes seconds): the registry's ``math-verify`` parses both sides
   to SymPy and compares them (sets, intervals, matrices, expressions, equations), under a per-call time
   limit. A call that runs out of time scores 0.

Reward functions follow TRL's convention, ``fn(prompts, completions, **dataset_columns) -> list[float]``,
with completions as strings or as conversations (``[{"role": "assistant", "content": ...}]``), so TRL
reward functions and ours are interchangeable. :func:`math_rewards` scores many completions at once and
sends the symbolic checks to worker processes when there are many (the verifier is CPU-bound).

Departures from common practice, and why:

1. No "last number in the text" fallback in :func:`extract_answer`: it rewards a policy for ending on
   any number and is an easy reward hack. Only ``\\boxed{}``, GSM8K's ``#### N`` and an explicit
   "the answer is ..." ending count.
2. The numeric fast path compares with a *relative* tolerance, where math-verify rounds both sides to
   6 decimals (which makes ``1.24e-8`` equal to ``1.25e-8``). Scientific answers (Minerva) are therefore
   judged strictly to the digits given.
3. The time limit is our own (``signal.setitimer`` around parsing *and* comparison), not math-verify's
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
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds one symbolic equivalence check may take before it scores 0.
DEFAULT_TIMEOUT = 2.0
#: Relative tolerance of the numeric fast path.
REL_TOL = 1e-6
#: Extracted answers longer than this are not parsed (no real final answer is this long).
MAX_ANSWER_CHARS = 1_000

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
    """The text of a completion: the string itself, or the content of a conversation's last message.

    TRL passes conversational completions as ``[{"role": "assistant", "content": "..."}]``.
    Anything else becomes ``""`` (which scores 0), so a reward function never raises on odd input.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion:
        last = completion[-1]
        if isinstance(last, dict) and isinstance(last.get("content"), str):
            return last["content"]
    return ""


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


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when it states none.

    In order of precedence:

    1. the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed X``);
    2. GSM8K's ``#### N``: the rest of the line after the last ``####``;
    3. fallback: the text after the last "the answer is", "final answer:" or "answer:", up to the end of
       its line, without a trailing period or ``$`` (e.g. "... so the answer is 42." gives ``"42"``).

    Never raises: anything that is not a string gives None.
    """
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
    if last is not None:
        answer = text[last.end() :].split("\n", 1)[0].strip()
        answer = re.sub(r"[\s.$]+$", "", answer).strip().lstrip("$").strip()
        return answer or None
    return None


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


def parse_number(answer: str) -> Fraction | None:
    """The value of a plain-number answer as an exact fraction, or None if it is not a plain number.

    Accepts ``42``, ``-3.5``, ``1,000``, ``1{,}000``, ``1.2e-8``, ``6.5 \\times 10^{-2}``, ``3/4``,
    ``\\frac{3}{4}``, ``\\frac34``, with ``$``/``\\$``, ``%``/``\\%``, degrees and unit words around them
    (``5\\text{ cm}``, ``18 dollars``). A percent sign is a decoration, not a division by 100: ``50\\%``
    is 50, as benchmark answers write it.
    """
    s = answer.strip()
    if not s or len(s) > 100:
        return None
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("{,}", ",").replace(",\\!", ",").replace("\\!", "").replace("\\,", "")
    s = _DEGREES.sub("", s)
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
    if m:
        s, exponent = m.group(1).strip(), int(m.group(2))
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    value = None
    if _NUMBER.match(s):
        mantissa, _, exp = s.lower().partition("e")
        if abs(int(exp or 0) + exponent) > 400:  # keep exact arithmetic cheap
            return None
        value = Fraction(mantissa)
        if exp:
            exponent += int(exp)
    else:
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
    return value * Fraction(10) ** exponent if exponent else value


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


def fast_equivalence(pred: str, gold: str) -> bool | None:
    """The verdict of the string check and the numeric fast path, or None when neither decides.

    True when the normalised strings match or both are plain numbers with equal values; False when
    both are plain numbers with different values; None otherwise (the symbolic path decides).
    """
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    a, b = parse_number(pred), parse_number(gold)
    if a is None or b is None:
        return None
    return numbers_equal(a, b)


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


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import verify

    gold_parsed, pred_parsed = _parse(gold), _parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
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


def math_reward(completion: Completion, answer: str, *, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to ``answer``, else 0.0.

    ``answer`` is the reference's final answer (a worked solution ending in ``#### N`` or containing a
    ``\\boxed{}`` works too). A comparison that takes longer than ``timeout`` seconds scores 0.0.
    Never raises.
    """
    try:
        pred = extract_answer(completion_text(completion))
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
) -> list[float]:
    """:func:`math_reward` of each (completion, answer) pair, in parallel where it pays.

    The string check and numeric fast path run here for every pair (microseconds). Of the rest, the
    distinct (prediction, reference) pairs are checked symbolically: in ``num_workers`` worker processes
    when there are at least ``min_parallel`` of them, else here one by one. Same result as calling
    :func:`math_reward` on each pair.
    """
    if len(completions) != len(answers):
        raise ValueError(
            f"got {len(completions)} completions but {len(answers)} answers; pass one answer per completion "
            "(repeat a prompt's answer for each of its completions)"
        )
    rewards = [0.0] * len(completions)
    todo: dict[tuple[str, str], list[int]] = {}
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        try:
            pred = extract_answer(completion_text(completion))
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
