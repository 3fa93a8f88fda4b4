"""The chapters' exercise solutions (dppo_core/assets/course/solutions/chNN_*.py) run and pass their own checks.

Each solution file is plain Python: one function per exercise, with asserts that compare the answer to the
package (or to an exact computation), and a ``main()`` that runs them all. Here each file is one test; models
are the small ones the files build into ``$DPPO_CACHE_DIR`` (seconds), never the 5-minute warm start.
"""

from __future__ import annotations

import inspect
import json
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SOLUTIONS_DIR = "dppo_core/assets/course/solutions"       # in the package: check() reads them there, offline
SOLUTIONS = sorted((ROOT / SOLUTIONS_DIR).glob("ch[0-9][0-9]*_*.py"))
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))


def _exercises(notebook: Path) -> tuple[str, list[tuple[int, str, dict]]]:
    """The "## Exercises" cell's text, and each exercise after it: (number, its markdown, its code cell)."""
    cells = json.loads(notebook.read_text())["cells"]
    starts = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and "## Exercises" in "".join(c["source"])]
    assert starts, f"{notebook.name} has no '## Exercises' section"
    intro, rest = "".join(cells[starts[-1]]["source"]), cells[starts[-1] + 1:]
    found = []
    for i, cell in enumerate(rest):
        text = "".join(cell["source"])
        heading = re.match(r"### Exercise (\d+)\. ", text)
        if cell["cell_type"] == "markdown" and heading:
            assert i + 1 < len(rest) and rest[i + 1]["cell_type"] == "code", \
                f"{notebook.name}: exercise {heading[1]} has no code cell under it"
            found.append((int(heading[1]), text, rest[i + 1]))
    return intro, found


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_file_runs_and_its_checks_pass(solution, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("DPPO_CACHE_DIR", str(cache_dir))   # the small models are built (once) where the tests' are
    runpy.run_path(str(solution), run_name="__main__")
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_exercises_with_solutions_and_checks(notebook):
    """The chapter ends with 2-4 exercises; each has a stub cell whose ``check()`` runs the solution's asserts.

    The solution file has one function per exercise; its parameters are the pieces the student writes, each
    defined (``def``/``class``) in the exercise's cell and passed to ``check`` by name, so every exercise is
    checked on code the student wrote, never on numbers typed by hand. As the chapter ships, the stub raises
    ``NotImplementedError`` and the stored output says the exercise is not done yet.
    """
    chapter = notebook.name.split("_")[0]
    solution = [s for s in SOLUTIONS if s.name.startswith(f"ch{chapter}_")]
    assert len(solution) == 1, f"expected one {SOLUTIONS_DIR}/ch{chapter}_*.py, found {solution}"
    stem = solution[0].stem
    intro, exercises = _exercises(notebook)
    link = f"[`{SOLUTIONS_DIR}/{solution[0].name}`](../{SOLUTIONS_DIR}/{solution[0].name})"
    assert link in intro, f"{notebook.name} does not point to its solutions: {link}"
    assert 2 <= len(exercises) <= 4, f"{notebook.name}: {len(exercises)} exercises"
    assert [n for n, _, _ in exercises] == list(range(1, len(exercises) + 1)), notebook.name
    module = runpy.run_path(str(solution[0]), run_name=stem)
    functions = sorted(name for name in module if re.fullmatch(r"exercise_\d+", name))
    assert functions == [f"exercise_{n}" for n, _, _ in exercises], (notebook.name, functions)
    for n, _, cell in exercises:
        code = "".join(cell["source"])
        call = re.search(rf'check\("{stem}", {n}((?:, \w+=\w+)*)\)', code)
        assert call, f'{notebook.name}, exercise {n}: its cell must call check("{stem}", {n}, piece=piece, ...)'
        pieces = re.findall(r"(\w+)=(\w+)", call[1])
        parameters = inspect.signature(module[f"exercise_{n}"]).parameters
        takes = list(parameters)
        assert pieces and all(a == b for a, b in pieces), (notebook.name, n, pieces)
        code_pieces = [k for k, p in parameters.items() if inspect.isfunction(p.default) or inspect.isclass(p.default)]
        assert {k for k, _ in pieces} >= set(code_pieces), \
            f"{notebook.name}, exercise {n}: every piece of code exercise_{n} takes is passed ({code_pieces})"
        for name, _ in pieces:
            assert name in takes, f"{notebook.name}, exercise {n}: exercise_{n} takes {takes}, not {name}"
            assert re.search(rf"^(def|class) {name}\b", code, re.M), \
                f"{notebook.name}, exercise {n}: {name} is passed to check() but not written in the cell"
        assert "NotImplementedError" in code, f"{notebook.name}, exercise {n}: the stub must raise NotImplementedError"
        shown = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
        assert f"exercise {n}: not done yet" in shown, \
            f"{notebook.name}, exercise {n}: the stored output should be the stub's 'not done yet'"
