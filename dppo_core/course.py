"""What the chapters call: the CPU kernel pins (:func:`pin_cpu_kernels`) and feedback on exercises (:func:`check`).

Exercises, in place: ``check("ch03_grpo", 1, my_k3=my_k3)``.

Each chapter's solutions live in ``notebooks/solutions/chNN_*.py``: one function per exercise, whose parameters
are the pieces a student writes (``def exercise_1(my_k3=my_k3)``) and whose asserts prove them right. A notebook's
exercise cell defines its own version of those pieces and calls :func:`check`, which runs the *same* function
with the student's pieces in place of the solution's, so the feedback is exactly the solution's assertions:

- ``✓`` when they all hold;
- ``…`` "not done yet" while a piece still raises ``NotImplementedError`` (the stub as the chapter ships it);
- ``✗`` with the failing assert's line, or the error the student's code raised, otherwise.

:func:`check` never raises on a wrong answer (a notebook run top to bottom goes on); it returns whether the
exercise passed (a :class:`Verdict`, which a notebook does not echo). The solutions file is read from the
checkout the notebook runs in, or, opened alone (Colab), downloaded from the repository
(:func:`dppo_core.bench.report.committed_result`).
"""

from __future__ import annotations

import inspect
import linecache
import re
import sys
import traceback
import types
from pathlib import Path

__all__ = ["CPU_KERNEL_PINS", "Verdict", "check", "load_solutions", "pin_cpu_kernels"]

# The Makefile's pins (tests/test_course.py checks they agree): PyTorch's own kernels, MKL and oneDNN all at
# AVX2, so that sums run in one order on every x86-64 CPU with AVX2, with or without AVX-512.
CPU_KERNEL_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pin_cpu_kernels(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """Pin the CPU kernels as ``make`` does, so a notebook opened with plain ``jupyter lab`` gives its stored outputs.

    Each chapter calls it in its first code cell, before anything imports torch: the pins are read when the
    libraries load. Only on a CPU with AVX2 (read from ``cpuinfo``; elsewhere, ARM or macOS, nothing is set); a
    variable already set (by the Makefile, or by you) is left alone. Returns the variables as they now are. If
    torch was imported before, with other values, it says so: restart the kernel and run from the top.
    """
    import os

    path = Path(cpuinfo)
    try:
        flags = path.read_text() if path.is_file() else ""
    except OSError:
        flags = ""
    if not re.search(r"\bavx2\b", flags):
        return {}
    for key, value in CPU_KERNEL_PINS.items():
        os.environ.setdefault(key, value)
    now = {key: os.environ[key] for key in CPU_KERNEL_PINS}
    if "torch" in sys.modules and now != CPU_KERNEL_PINS:
        print("torch was imported before the kernel pins were set: restart the kernel and run from the top "
              "to get this notebook's stored outputs")
    return now

_LOADED: dict[str, types.ModuleType] = {}
_STEM = re.compile(r"^ch\d\d[a-z]?_[a-z0-9_]+$")


def _solutions_path(stem: str) -> str:
    return f"notebooks/solutions/{stem}.py"


def load_solutions(stem: str) -> types.ModuleType:
    """The module ``notebooks/solutions/<stem>.py`` (e.g. ``"ch03_grpo"``), loaded once per process."""
    if not isinstance(stem, str) or not _STEM.match(stem):
        raise ValueError(f"check(): the first argument names a solutions file, like 'ch03_grpo' "
                         f"(notebooks/solutions/ch03_grpo.py); got {stem!r}")
    if stem not in _LOADED:
        relative = _solutions_path(stem)
        here = next((base / relative for base in (Path.cwd().resolve(), *Path.cwd().resolve().parents)
                     if (base / relative).is_file()), None)
        if here is not None:
            filename, source = str(here), here.read_text()
        else:
            from dppo_core.bench.report import REPOSITORY_RAW_URL, committed_result

            filename, source = f"{REPOSITORY_RAW_URL}/{relative}", committed_result(relative)
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        module = types.ModuleType(stem)
        module.__file__ = filename
        sys.modules[stem] = module                # dataclasses and pickling look a module up by name
        try:
            exec(compile(source, filename, "exec"), module.__dict__)
        except BaseException:
            sys.modules.pop(stem, None)
            raise
        _LOADED[stem] = module
    return _LOADED[stem]


def _where(tb: types.TracebackType | None, filename: str) -> tuple[str, int, str] | None:
    """The last frame of the traceback inside ``filename``: (function, line number, source line)."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == filename:
            found = (frame.f_code.co_name, lineno, linecache.getline(filename, lineno).strip())
    return found


class Verdict:
    """What :func:`check` returns: true when the exercise passed. Shows nothing as a cell's last value (the verdict
    line is already printed), so a stub cell's stored output is that line alone."""

    __slots__ = ("passed",)

    def __init__(self, passed: bool):
        self.passed = passed

    def __bool__(self) -> bool:
        return self.passed

    def __eq__(self, other) -> bool:
        return bool(self) == other if isinstance(other, (bool, Verdict)) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"Verdict(passed={self.passed})"

    def _ipython_display_(self) -> None:
        pass


def check(stem: str, exercise: int, **pieces) -> Verdict:
    """Run exercise ``exercise`` of ``notebooks/solutions/<stem>.py`` with ``pieces`` in place of the solution's.

    ``pieces`` are the exercise function's parameters (the names the chapter's stub cell defines); a name the
    exercise does not take is a mistake in the call and raises ``TypeError`` naming the ones it takes. Prints
    one verdict line (after whatever the exercise prints) and returns a :class:`Verdict`, true when every assert held.
    """
    module = load_solutions(stem)
    name = f"exercise_{exercise}"
    function = getattr(module, name, None)
    if function is None:
        have = sorted(n for n in vars(module) if n.startswith("exercise_"))
        raise ValueError(f"check(): {_solutions_path(stem)} has no {name}; it has {', '.join(have)}")
    takes = list(inspect.signature(function).parameters)
    unknown = sorted(set(pieces) - set(takes))
    if unknown:
        raise TypeError(f"check({stem!r}, {exercise}): exercise {exercise} takes {', '.join(takes) or 'nothing'}, "
                        f"not {', '.join(unknown)}")
    label = f"exercise {exercise}"
    try:
        function(**pieces)
    except NotImplementedError as err:
        culprit = next((n for n, f in pieces.items() if _raises_in(err.__traceback__, f)), None)
        what = f"`{culprit}`" if culprit else "a piece you pass"
        print(f"… {label}: not done yet ({what} raises NotImplementedError): write it in this cell "
              f"and run it again")
        return Verdict(False)
    except AssertionError as err:
        where = _where(err.__traceback__, module.__file__)
        line = f" (line {where[1]} of solutions/{stem}.py):\n    {where[2]}" if where else ""
        detail = f"\n    {err}" if str(err) else ""
        print(f"✗ {label}: a check failed{line}{detail}")
        return Verdict(False)
    except Exception as err:                                # the student's code raised: say what and where
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
        at = f" at line {frames[-1].lineno} of {frames[-1].name}()" if frames else ""
        print(f"✗ {label}: the code raised {type(err).__name__}{at}: {err}")
        return Verdict(False)
    print(f"✓ {label}: every check of solutions/{stem}.py passed")
    return Verdict(True)


def _raises_in(tb: types.TracebackType | None, piece) -> bool:
    code = getattr(piece, "__code__", None) or getattr(getattr(piece, "__init__", None), "__code__", None)
    return code is not None and any(frame.f_code is code for frame, _ in traceback.walk_tb(tb))
