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
(:func:`dppo_core.tools.bench.report.committed_result`).
"""

from __future__ import annotations

import inspect
import linecache
import re
import sys
import sysconfig
import traceback
import types
from pathlib import Path

__all__ = ["CPU_KERNEL_PINS", "Verdict", "check", "load_solutions", "pin_cpu_kernels"]

# The Makefile's pins (tests/test_course.py checks they agree): PyTorch's own kernels, MKL and oneDNN all at
# AVX2, so that a chapter runs with the kernels `make test` runs it with. Pins narrow the differences between CPUs
# without removing them; the outputs the tests compare do not depend on them.
CPU_KERNEL_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pin_cpu_kernels(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """Pin the CPU kernels as ``make`` does: a notebook opened with plain ``jupyter lab`` runs as ``make test`` runs it.

    Each chapter calls it in its first code cell, before anything imports torch: the pins are read when the
    libraries load. Only on a CPU with AVX2 (read from ``cpuinfo``; elsewhere, ARM or macOS, nothing is set); a
    variable already set (by the Makefile, or by you) is left alone. Returns the variables as they now are. If
    it has to set one after torch was imported, it says so: restart the kernel and run from the top.
    """
    import os

    path = Path(cpuinfo)
    try:
        flags = path.read_text() if path.is_file() else ""
    except OSError:
        flags = ""
    if not re.search(r"\bavx2\b", flags):
        return {}
    unset = [key for key in CPU_KERNEL_PINS if key not in os.environ]
    for key, value in CPU_KERNEL_PINS.items():
        os.environ.setdefault(key, value)
    if unset and "torch" in sys.modules:
        # too late for what has already loaded (MKL and oneDNN read theirs once; PyTorch at its first kernel)
        print(f"torch was imported before the kernel pins were set ({', '.join(unset)}): restart the kernel and "
              "run from the top to run it with the kernels `make test` uses")
    return {key: os.environ[key] for key in CPU_KERNEL_PINS}


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
            from dppo_core.tools.bench.report import REPOSITORY_RAW_URL, committed_result

            filename, source = f"{REPOSITORY_RAW_URL}/{relative}", committed_result(relative)
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        module = types.ModuleType(stem)
        module.__file__ = filename
        sys.modules[stem] = module                # dataclasses and pickling look a module up by name
        try:
            # optimize=0: the asserts are the checks, so they run even under `python -O`
            exec(compile(source, filename, "exec", dont_inherit=True, optimize=0), module.__dict__)
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

    ``pieces`` are the exercise function's parameters (the names the chapter's stub cell defines). Every parameter
    whose default is code (a function or a class) must be passed: left out, the solution's own would stand in for
    it and pass. A missing one, or a name the exercise does not take, is a mistake in the call and raises
    ``TypeError`` naming them. Prints one verdict line (after whatever the exercise prints) and returns a
    :class:`Verdict`, true when every assert held. A wrong answer never raises; a solutions file that cannot be
    found (outside a checkout and offline) does.
    """
    module = load_solutions(stem)
    name = f"exercise_{exercise}"
    function = getattr(module, name, None)
    if function is None:
        have = sorted(n for n in vars(module) if n.startswith("exercise_"))
        raise ValueError(f"check(): {_solutions_path(stem)} has no {name}; it has {', '.join(have)}")
    parameters = inspect.signature(function).parameters
    unknown = sorted(set(pieces) - set(parameters))
    if unknown:
        raise TypeError(f"check({stem!r}, {exercise}): exercise {exercise} takes {', '.join(parameters) or 'nothing'}, "
                        f"not {', '.join(unknown)}")
    missing = [n for n, p in parameters.items()
               if n not in pieces and (inspect.isfunction(p.default) or inspect.isclass(p.default))]
    if missing:
        raise TypeError(f"check({stem!r}, {exercise}): pass your {', '.join(missing)} too "
                        f"({', '.join(f'{n}={n}' for n in missing)}); left out, the solution's would be checked")
    label = f"exercise {exercise}"
    try:
        function(**pieces)
    except Exception as err:
        innermost = _innermost(err.__traceback__)
        stub = next((n for n, piece in pieces.items() if innermost in _codes(piece)), None)
        if isinstance(err, NotImplementedError) and stub is not None:
            print(f"… {label}: not done yet (`{stub}` raises NotImplementedError): write it in this cell "
                  f"and run it again")
        elif isinstance(err, AssertionError) and innermost is not None and innermost.co_filename == module.__file__:
            where = _where(err.__traceback__, module.__file__)
            line = f" (line {where[1]} of solutions/{stem}.py):\n    {where[2]}" if where else ""
            detail = f"\n    {err}" if str(err) else ""
            print(f"✗ {label}: a check failed{line}{detail}")
        else:                                            # the student's code raised: say what and where
            frame = _user_frame(traceback.extract_tb(err.__traceback__), module.__file__)
            at = f" at line {frame.lineno} of {frame.name}()" if frame else ""
            print(f"✗ {label}: the code raised {type(err).__name__}{at}: {err}")
        return Verdict(False)
    print(f"✓ {label}: every check of solutions/{stem}.py passed")
    return Verdict(True)


def _innermost(tb: types.TracebackType | None) -> types.CodeType | None:
    """The code object of the frame that raised."""
    frames = list(traceback.walk_tb(tb))
    return frames[-1][0].f_code if frames else None


def _codes(piece) -> set[types.CodeType]:
    """The code objects a piece runs as itself: a function's, or the methods of a class (or of an instance's)."""
    if inspect.isfunction(piece) or inspect.ismethod(piece):
        return {piece.__code__}
    cls = piece if inspect.isclass(piece) else type(piece)
    return {getattr(v, "__code__", None) for k in inspect.getmro(cls) if k is not object
            for v in vars(k).values()} - {None}


def _user_frame(frames: traceback.StackSummary, solutions: str):
    """The last frame in the student's code (a notebook cell or a file outside the installed libraries), else
    the last frame in the solutions file, else the last one."""
    paths = sysconfig.get_paths()
    libraries = {str(Path(p).resolve()) for p in (paths["stdlib"], paths["purelib"], paths["platlib"])}
    libraries.add(str(Path(__file__).resolve().parent))                 # dppo_core itself, installed editable or not
    own = [f for f in frames if f.filename not in (__file__, solutions)
           and not any(str(Path(f.filename).resolve()).startswith(lib) for lib in libraries)]
    in_solutions = [f for f in frames if f.filename == solutions]
    return (own or in_solutions or list(frames) or [None])[-1]
