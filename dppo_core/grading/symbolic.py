"""The symbolic path: math-verify's verdict under our own time limit, in this thread or in worker processes.

The time limit is a ``signal.setitimer`` alarm around parsing *and* comparison. Signals only work in a
process's main thread, so a call from any other thread runs the check in a worker process
(:class:`_VerifierPool`) and waits with a deadline; :func:`symbolic_equivalence_in_workers` sends many checks
to the workers at once.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import multiprocessing
import re
import signal
import sys
import threading
import time
from fractions import Fraction
from typing import TYPE_CHECKING

from dppo_core.grading.extract import MAX_ANSWER_CHARS, assigned_value
from dppo_core.grading.numbers import (
    Number,
    matrix_cells,
    numbers_equal,
    parse_written_number,
    rounds_to,
    unit_match,
)

if TYPE_CHECKING:
    from multiprocessing.pool import Pool

logger = logging.getLogger(__name__)

#: Seconds one symbolic equivalence check may take before it scores 0.
DEFAULT_TIMEOUT = 2.0

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
        m = unit_match(answer)
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
        self._pool: Pool | None = None
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
            logger.warning("reward workers missed their deadline; restarting them (unfinished checks "
                           "score 0)")
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


def symbolic_equivalence_in_workers(
    chunks: list[list[tuple[str, str]]], timeout: float, processes: int
) -> list[list[bool]]:
    """math-verify's verdict on each (pred, gold) pair of each chunk, in ``processes`` worker processes.

    Each chunk is one task; a check gets ``timeout`` seconds, and chunks not finished by the pool's deadline
    get all False (the workers are then restarted).
    """
    return _POOL.run(chunks, timeout, processes)
