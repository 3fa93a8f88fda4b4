"""What the chapters call: the CPU kernel pins (:func:`pin_cpu_kernels`) and feedback on exercises
(:func:`check`).

Exercises, in place: ``check("ch03_grpo", 1, my_k3=my_k3)``.

Each chapter's solutions live in the package, ``dppo_core/assets/course/solutions/chNN_*.py``
(:data:`SOLUTIONS`): one function per exercise, whose parameters are the pieces a student writes (``def
exercise_1(my_k3=my_k3)``) and whose asserts prove them right. A notebook's exercise cell defines its own
version of those pieces and calls :func:`check`, which runs the *same* function with the student's pieces in
place of the solution's, so the feedback is exactly the solution's assertions:

- ``✓`` when they all hold;
- ``…`` "not done yet" while a piece still raises ``NotImplementedError`` (the stub as the chapter ships it);
- ``✗`` with the failing assert's line, or the error the student's code raised, otherwise, then a ``hint:``
  line: the solutions file's one sentence on that exercise (its ``HINTS``), the mistake to look for first.

:func:`check` never raises on a wrong answer (a notebook run top to bottom goes on); it returns whether the
exercise passed (a :class:`Verdict`, which a notebook does not echo). The solutions file is read from the
installed package, never from the network, so a chapter opened alone (Colab, a workshop laptop) checks
exercises offline.

The committed results the chapters read (:func:`dppo_core.tools.bench.report.committed_result`) ship inside
the package too, as a snapshot of the repository's files (:data:`RESULTS`): :func:`chapter_results` lists what
the chapters read, and ``python -m dppo_core.tools.course --sync-results`` (from a checkout) copies them again
after a committed result changes (tests/course/test_course.py checks the copies are current).
"""

from __future__ import annotations

import ast
import inspect
import json
import linecache
import re
import shutil
import sys
import sysconfig
import traceback
import types
from pathlib import Path

__all__ = ["CPU_KERNEL_PINS", "RESULTS", "SOLUTIONS", "Verdict", "chapter_results", "check", "load_solutions",
           "pin_cpu_kernels", "sync_results"]

#: The chapters' exercise solutions, one file per chapter (``ch03_grpo.py``), shipped in the package.
SOLUTIONS = Path(__file__).resolve().parents[1] / "assets" / "course" / "solutions"
#: The snapshot of the committed results the chapters read, under their paths in the repository
#: (``RESULTS / "benchmarks/results/cpu-peers/bench.json"``), shipped in the package.
RESULTS = Path(__file__).resolve().parents[1] / "assets" / "course" / "results"
#: The snapshot's list, one path a line, beside it (``assets/course/results.txt``): what the chapters read,
#: as :func:`sync_results` last found it. ``dppo doctor`` checks an install against it, so the list and the
#: copies change in one command.
RESULTS_LIST = "results.txt"

# The Makefile's pins (tests/course/test_course.py checks they agree): PyTorch's own kernels, MKL and oneDNN
# all at AVX2, so that a chapter runs with the kernels `make notebooks` stored its outputs with. Pins narrow
# the differences between CPUs without removing them; the outputs the tests compare do not depend on them.
CPU_KERNEL_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pin_cpu_kernels(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """Pin the CPU kernels as the Makefile does: a chapter opened with plain ``jupyter lab`` runs as it ran
    when ``make notebooks`` stored its outputs.

    Each chapter calls it in its first code cell, before anything imports torch: the pins are read when the
    libraries load. Only on a CPU with AVX2 (read from ``cpuinfo``; elsewhere, ARM or macOS, nothing is set);
    a variable already set (by the Makefile, or by you) is left alone. Returns the variables as they now are.
    If it has to set one after torch was imported, it says so: restart the kernel and run from the top.
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
        print(f"torch was imported before the kernel pins were set ({', '.join(unset)}): restart the kernel "
              "and run from the top to run it with the kernels `make test` uses")
    return {key: os.environ[key] for key in CPU_KERNEL_PINS}


_LOADED: dict[str, types.ModuleType] = {}
_STEM = re.compile(r"^ch\d\d[a-z]?_[a-z0-9_]+$")


def _solutions_path(stem: str) -> str:
    return f"dppo_core/assets/course/solutions/{stem}.py"


def load_solutions(stem: str) -> types.ModuleType:
    """The module ``dppo_core/assets/course/solutions/<stem>.py`` (e.g. ``"ch03_grpo"``), loaded once per
    process."""
    if not isinstance(stem, str) or not _STEM.match(stem):
        raise ValueError(f"check(): the first argument names a solutions file, like 'ch03_grpo' "
                         f"({_solutions_path('ch03_grpo')}); got {stem!r}")
    if stem not in _LOADED:
        path = SOLUTIONS / f"{stem}.py"
        if not path.is_file():
            have = sorted(p.stem for p in SOLUTIONS.glob("ch*.py"))
            raise FileNotFoundError(f"check(): dppo_core has no solutions file {stem}.py (it has "
                                    f"{', '.join(have)}); is the installed dppo_core older than this "
                                    "chapter? Reinstall it")
        filename, source = str(path), path.read_text(encoding="utf-8")
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
    """The last frame of the traceback inside ``filename``: (function, line number, source line; an ``assert``
    continued with a backslash shows its condition, the message being printed under it)."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == filename:
            line = linecache.getline(filename, lineno).strip()
            found = (frame.f_code.co_name, lineno, line.removesuffix("\\").rstrip())
    return found


class Verdict:
    """What :func:`check` returns: true when the exercise passed. Shows nothing as a cell's last value (the
    verdict line is already printed), so a stub cell's stored output is that line alone."""

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
    """Run exercise ``exercise`` of ``dppo_core/assets/course/solutions/<stem>.py`` with ``pieces`` in place
    of the solution's.

    ``pieces`` are the exercise function's parameters (the names the chapter's stub cell defines). Every
    parameter whose default is code (a function or a class) must be passed: left out, the solution's own would
    stand in for it and pass. A missing one, or a name the exercise does not take, is a mistake in the call
    and raises ``TypeError`` naming them. Prints one verdict line (after whatever the exercise prints) and
    returns a :class:`Verdict`, true when every assert held. A failed verdict (an assert of the solutions
    file, or an error the student's code raised) is followed by ``    hint: ...``, the exercise's entry in the
    solutions file's ``HINTS`` (none while a piece is not done yet, nor where the file has no entry). A wrong
    answer never raises; a solutions file the installed package does not have does.
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
        raise TypeError(f"check({stem!r}, {exercise}): exercise {exercise} takes "
                        f"{', '.join(parameters) or 'nothing'}, not {', '.join(unknown)}")
    missing = [n for n, p in parameters.items()
               if n not in pieces and (inspect.isfunction(p.default) or inspect.isclass(p.default))]
    if missing:
        raise TypeError(f"check({stem!r}, {exercise}): pass your {', '.join(missing)} too "
                        f"({', '.join(f'{n}={n}' for n in missing)}); left out, the solution's would be "
                        "checked")
    label = f"exercise {exercise}"
    try:
        function(**pieces)
    except Exception as err:
        innermost = _innermost(err.__traceback__)
        stub = next((n for n, piece in pieces.items() if innermost in _codes(piece)), None)
        if isinstance(err, NotImplementedError) and stub is not None:
            print(f"… {label}: not done yet (`{stub}` raises NotImplementedError): write it in this cell "
                  f"and run it again")
            return Verdict(False)
        if (isinstance(err, AssertionError) and innermost is not None
                and innermost.co_filename == module.__file__):
            where = _where(err.__traceback__, module.__file__)
            line = f" (line {where[1]} of solutions/{stem}.py):\n    {where[2]}" if where else ""
            detail = f"\n    {err}" if str(err) else ""
            print(f"✗ {label}: a check failed{line}{detail}")
        else:                                            # the student's code raised: say what and where
            frame = _user_frame(traceback.extract_tb(err.__traceback__), module.__file__)
            at = f" at line {frame.lineno} of {frame.name}()" if frame else ""
            print(f"✗ {label}: the code raised {type(err).__name__}{at}: {err}")
        hint = (getattr(module, "HINTS", None) or {}).get(exercise)
        if hint:
            print(f"    hint: {hint}")
        return Verdict(False)
    print(f"✓ {label}: every check of solutions/{stem}.py passed")
    return Verdict(True)


def _innermost(tb: types.TracebackType | None) -> types.CodeType | None:
    """The code object of the frame that raised."""
    frames = list(traceback.walk_tb(tb))
    return frames[-1][0].f_code if frames else None


def _codes(piece) -> set[types.CodeType]:
    """The code objects a piece runs as itself: a function's, or the methods of a class (or of an
    instance's)."""
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
    libraries.add(str(Path(__file__).resolve().parent))  # dppo_core itself, installed editable or not
    own = [f for f in frames if f.filename not in (__file__, solutions)
           and not any(str(Path(f.filename).resolve()).startswith(lib) for lib in libraries)]
    in_solutions = [f for f in frames if f.filename == solutions]
    return (own or in_solutions or list(frames) or [None])[-1]


def chapter_results(notebooks: str | Path) -> list[str]:
    """The committed files the chapters in ``notebooks`` read with ``committed_result("...")``, sorted.

    Read from the chapters' code cells without running them: a path is a string literal, or an f-string of
    names bound in the same cell by a literal loop (``for seed in (0, 1, 2):``) or an assignment of a string
    (``base = f"...{seed}"``), expanded for every value. A path built any other way raises ``ValueError``
    naming the chapter and the cell: write it in one of those forms, so the snapshot can be checked.
    """
    found: set[str] = set()
    for notebook in sorted(Path(notebooks).glob("[0-9][0-9]*_*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        for k, cell in enumerate(cells):
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "committed_result" not in source:
                continue
            # IPython lines (magics, shell escapes) are not Python: blank them, keeping the line numbers
            lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
            try:
                found.update(_read_paths(ast.parse("\n".join(lines)).body, {}))
            except (ValueError, SyntaxError) as err:
                raise ValueError(f"{notebook.name}, cell {k}: {err}") from err
    return sorted(found)


def _read_paths(statements: list[ast.stmt], names: dict[str, object]):
    """The paths passed to ``committed_result`` in ``statements``, with ``names`` the values bound so far."""
    for node in statements:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            try:
                values = list(ast.literal_eval(node.iter))
            except ValueError:                       # not a literal loop: its body once, its name unbound
                values = [_UNBOUND]
            for value in values:
                bound = dict(names) if value is _UNBOUND else {**names, node.target.id: value}
                yield from _read_paths(node.body, bound)
            continue
        if isinstance(node, (ast.If, ast.While, ast.With, ast.Try, ast.FunctionDef)):
            for part in ("body", "orelse", "finalbody"):
                yield from _read_paths(getattr(node, part, []), names)
            for handler in getattr(node, "handlers", []):
                yield from _read_paths(handler.body, names)
            continue
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, (ast.Constant, ast.JoinedStr))):
            try:
                names[node.targets[0].id] = _string(node.value, names)
            except ValueError:
                names.pop(node.targets[0].id, None)
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and _called(call.func) == "committed_result":
                if not call.args:
                    raise ValueError("committed_result() without a path")
                yield _string(call.args[0], names)


_UNBOUND = object()


def _called(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _string(node: ast.expr, names: dict[str, object]) -> str:
    """The value of a string literal or of an f-string whose fields are names in ``names``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                parts.append(str(part.value))
            elif (isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name)
                  and part.value.id in names and part.format_spec is None and part.conversion == -1):
                parts.append(str(names[part.value.id]))
            else:
                break
        else:
            return "".join(parts)
    raise ValueError(f"cannot tell which file committed_result({ast.unparse(node)}) reads: give it a string, "
                     "or an f-string of names bound in the cell by a literal loop or a string assignment")


def sync_results(root: str | Path | None = None) -> list[str]:
    """Copy the committed results the chapters read from the checkout ``root`` (default: the one this package
    is in) into the package's snapshot (:data:`RESULTS`), list them in :data:`RESULTS_LIST` beside it, and
    remove snapshot files no chapter reads any more. Returns the paths copied.
    ``python -m dppo_core.tools.course --sync-results`` runs it."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    if not (root / "notebooks").is_dir() or not (root / "benchmarks").is_dir():
        raise FileNotFoundError(f"{root} is not a checkout of the repository (no notebooks/ and "
                                "benchmarks/): run this from a clone, with dppo_core installed from it "
                                "(`make setup`)")
    paths = chapter_results(root / "notebooks")
    missing = [p for p in paths if not (root / p).is_file()]
    if missing:
        raise FileNotFoundError(f"the chapters read {', '.join(missing)}, not in {root}: commit them first")
    for path in paths:
        (RESULTS / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / path, RESULTS / path)
    listed = RESULTS.parent / RESULTS_LIST
    partial = listed.with_name(listed.name + ".partial")
    partial.write_text("".join(f"{path}\n" for path in paths), encoding="utf-8")
    partial.replace(listed)
    for stale in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        if stale.relative_to(RESULTS).as_posix() not in paths:
            stale.unlink()
    for folder in sorted((p for p in RESULTS.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                         reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    return paths


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dppo_core.tools.course", description=(
        "The course's files that ship in the package. --sync-results copies the committed results the "
        "chapters read into dppo_core/assets/course/results/ (run it from a clone after a committed result "
        "changes)."))
    parser.add_argument("--sync-results", action="store_true", help="copy the chapters' committed results")
    parser.add_argument("--root", type=Path, default=None,
                        help="the checkout (default: the one dppo_core is in)")
    args = parser.parse_args(argv)
    if not args.sync_results:
        parser.print_help()
        return 2
    paths = sync_results(args.root)
    print(f"copied {len(paths)} committed results the chapters read into {RESULTS}:")
    for path in paths:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
