"""The chapters' exercise solutions (dppo_core/assets/course/solutions/chNN_*.py) run and pass their own checks.

Each solution file is plain Python: one function per exercise, with asserts that compare the answer to the
package (or to an exact computation), a ``HINTS`` sentence per exercise that ``check()`` prints under a failed
verdict, and a ``main()`` that runs them all. Here each file is one test; models are the small ones the files
build into ``$DPPO_CACHE_DIR`` (seconds), never the 5-minute warm start.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import runpy
from pathlib import Path

import pytest

from dppo_core.tools.course import check, load_solutions

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


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_exercise_has_one_hint(solution):
    """Right after the imports, ``HINTS`` holds one sentence per ``exercise_N`` of the file (what ``check()`` prints
    under a failed verdict) and none for an exercise the file does not have. Read from the source, not run."""
    body = ast.parse(solution.read_text(encoding="utf-8")).body
    exercises = sorted(int(node.name.removeprefix("exercise_")) for node in body
                       if isinstance(node, ast.FunctionDef) and re.fullmatch(r"exercise_\d+", node.name))
    found = [k for k, node in enumerate(body) if isinstance(node, (ast.Assign, ast.AnnAssign))
             and any(isinstance(t, ast.Name) and t.id == "HINTS"
                     for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    assert len(found) == 1, f"{solution.name}: one module-level HINTS = {{N: '...'}}, an entry per exercise_N"
    imports = [k for k, node in enumerate(body) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert found[0] == imports[-1] + 1, f"{solution.name}: HINTS comes right after the imports"
    hints = ast.literal_eval(body[found[0]].value)
    assert sorted(hints) == exercises, f"{solution.name}: HINTS has {sorted(hints)}, the exercises are {exercises}"
    for n, hint in hints.items():
        where = f"{solution.name}, HINTS[{n}]: {hint!r}"
        assert isinstance(hint, str) and hint.isascii() and "\n" not in hint and len(hint) <= 160, where
        assert hint.endswith(".") and ". " not in hint, f"{where}: one sentence, printed on one line"


def test_a_failed_check_prints_the_exercises_hint(capsys):
    """After the verdict of a failed assert of the solutions file, and of an error in the student's code, the
    exercise's own hint."""
    hints = load_solutions("ch03_grpo").HINTS

    def my_k3(logp, ref_logp):                     # forgot the "- d" term: an assert of the solutions file fails
        return (ref_logp - logp).exp() - 1

    assert not check("ch03_grpo", 1, my_k3=my_k3)
    out = capsys.readouterr().out
    assert "✗ exercise 1: a check failed (line" in out and out.endswith(f"\n    hint: {hints[1]}\n"), out
    assert out.count("hint:") == 1

    def my_advantages(rewards, scale):
        return rewards.mean(dim=2)                 # no dimension 2: the student's code raises

    assert not check("ch03_grpo", 2, my_advantages=my_advantages)
    out = capsys.readouterr().out
    assert "✗ exercise 2: the code raised IndexError" in out and out.endswith(f"\n    hint: {hints[2]}\n"), out


def test_a_stub_not_done_yet_prints_no_hint(capsys):
    """While a piece still raises NotImplementedError there is nothing to correct yet (and a chapter's stored
    outputs stay the one "not done yet" line); a pass prints none either."""
    def my_k3(logp, ref_logp):
        raise NotImplementedError  # your code here

    assert not check("ch03_grpo", 1, my_k3=my_k3)
    out = capsys.readouterr().out
    assert "… exercise 1: not done yet" in out and "hint:" not in out
    assert check("ch03_grpo", 1, my_k3=load_solutions("ch03_grpo").my_k3)
    assert "hint:" not in capsys.readouterr().out
