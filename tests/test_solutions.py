"""The chapters' exercise solutions (notebooks/solutions/chNN_*.py) run and pass their own checks.

Each solution file is plain Python: one function per exercise, with asserts that compare the answer to the
package (or to an exact computation), and a ``main()`` that runs them all. Here each file is one test; models
are the small ones the files build into ``$DPPO_CACHE_DIR`` (seconds), never the 5-minute warm start.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SOLUTIONS = sorted((NOTEBOOKS / "solutions").glob("ch[0-9][0-9]_*.py"))
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _exercises_cell(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    found = [c for c in cells if c["cell_type"] == "markdown" and "## Exercises" in "".join(c["source"])]
    assert found, f"{notebook.name} has no '## Exercises' section"
    text = "".join(found[-1]["source"])
    return text[text.index("## Exercises"):]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_file_runs_and_its_checks_pass(solution, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("DPPO_CACHE_DIR", str(cache_dir))   # the small models are built (once) where the tests' are
    runpy.run_path(str(solution), run_name="__main__")
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_exercises_with_solutions(notebook):
    """The chapter ends with 2-4 exercises; its solution file has one function per exercise and is named there."""
    solution = [s for s in SOLUTIONS if s.name.startswith(f"ch{notebook.name[:2]}_")]
    assert len(solution) == 1, f"expected one notebooks/solutions/ch{notebook.name[:2]}_*.py, found {solution}"
    text = _exercises_cell(notebook)
    items = re.findall(r"^(\d+)\. ", text, flags=re.M)
    functions = re.findall(r"^def (exercise_\d+)\(", solution[0].read_text(), flags=re.M)
    assert 2 <= len(items) <= 4, f"{notebook.name}: {len(items)} exercises"
    assert functions == [f"exercise_{i}" for i in range(1, len(items) + 1)], (notebook.name, items, functions)
    assert f"solutions/{solution[0].name}" in text, f"{notebook.name} does not point to its solutions"
