"""Every chapter keeps the course layout (notebooks/README.md, "How every chapter is laid out") and its Colab path.

What Colab runs is checked here without Colab: the badge opens the chapter's own file, and the first code cell
(the same install code in every chapter) pip-installs this package from ``DPPO_INSTALL`` (no default) only where it
is not installed, and stops with one line when it is unset or pip fails.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))
OWNER_REPO = "dppo-from-scratch/dppo-from-scratch"


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _number(notebook: Path) -> str:
    return notebook.name.split("_")[0]                                  # "03", "03b"


def test_there_are_chapters_00_to_09_and_03b():
    """03b (estimation) sits between GRPO (03) and the pruning chapters, without renumbering what others cite."""
    assert [_number(p) for p in CHAPTERS] == ["00", "01", "02", "03", "03b", "04", "05", "06", "07", "08", "09"]


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_layout(notebook):
    cells = _cells(notebook)
    first = _source(cells[0])
    assert cells[0]["cell_type"] == "markdown" and re.search(rf"^# Chapter {_number(notebook)} — ", first, re.M)
    badge = f"https://colab.research.google.com/github/{OWNER_REPO}/blob/main/notebooks/{notebook.name}"
    assert badge in first, f"{notebook.name}: the Colab badge must open this chapter ({badge})"
    assert "**Goal.**" in first
    markdown = "\n".join(_source(c) for c in cells if c["cell_type"] == "markdown")
    sections = re.findall(r"^## (\d+)\. ", markdown, re.M)
    assert sections and [int(s) for s in sections] == list(range(1, len(sections) + 1)), (notebook.name, sections)
    assert "## Summary" in markdown and "## Exercises" in markdown
    listed = (NOTEBOOKS / "README.md").read_text()
    assert f"]({notebook.name})" in listed, f"{notebook.name} is not in notebooks/README.md"


COLAB_BADGE = "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_colab_badge_sits_above_the_title(notebook):
    """Every chapter opens the same way: the badge on the first line, a blank line, then the `# Chapter NN` title."""
    lines = _source(_cells(notebook)[0]).splitlines()
    badge = f"{COLAB_BADGE}(https://colab.research.google.com/github/{OWNER_REPO}/blob/main/notebooks/{notebook.name})"
    assert lines[:2] == [badge, ""] and lines[2].startswith(f"# Chapter {_number(notebook)} — "), \
        f"{notebook.name}: the first cell should start with the Colab badge, then the title: {lines[:3]}"


def _list_breaks(markdown: str) -> list[str]:
    """Lines that end a numbered list between its items n and n+1: a non-blank line at column 0 after a blank line
    (a `$$` block that belongs to item n, say) closes the list in Markdown, so item n+1 renders as plain text
    inside the paragraph before it, or starts a new list. A line inside an item is indented under its text."""
    lines = markdown.splitlines()
    items = [(i, int(m.group(1))) for i, line in enumerate(lines) if (m := re.match(r"(\d+)\. ", line))]
    return [f"between items {n} and {n + 1}: {lines[k][:60]!r}"
            for (a, n), (b, m) in itertools.pairwise(items) if m == n + 1
            for k in range(a + 1, b)
            if lines[k].strip() and not lines[k][0].isspace() and not lines[k - 1].strip()]


def test_list_break_check_sees_a_display_formula_at_column_0():
    cut = "1. first\n2. second, so\n\n$$x = 1$$\n\n   more of item 2\n3. third\n"
    kept = cut.replace("\n$$x = 1$$", "\n   $$x = 1$$")
    assert _list_breaks(cut) == ["between items 2 and 3: '$$x = 1$$'"] and _list_breaks(kept) == []
    assert _list_breaks("1. one\n2. two\n\nA paragraph after the list.\n\n1. a new list\n") == []


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_numbered_lists_are_not_cut_by_a_column_0_line(notebook):
    breaks = [f"cell {k}, {b}" for k, c in enumerate(_cells(notebook)) if c["cell_type"] == "markdown"
              for b in _list_breaks(_source(c))]
    assert not breaks, f"{notebook.name}: indent these lines under their list item: {breaks}"


OBJECT_REPR = re.compile(r"<[^<>\n]* at 0x[0-9a-fA-F]+>")                # <torch._C.Generator at 0x7f...>


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_stored_outputs_show_no_object_reprs(notebook):
    """A cell whose last expression returns an object (``torch.manual_seed(0)`` returns the Generator) stores its
    repr with a memory address: noise for the reader, which nbval only passes because sanitize.cfg masks 0x..."""
    found = []
    for k, cell in enumerate(_cells(notebook)):
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [v for mime, v in out.get("data", {}).items() if mime.startswith("text/")]
            texts = [t if isinstance(t, str) else "".join(t) for t in texts]
            found += [f"cell {k}: {m}" for t in texts for m in OBJECT_REPR.findall(t)]
    assert not found, f"{notebook.name}: {found}"


#: The one place a chapter installs the package from: an environment variable, with no default (the package is not
#: on PyPI: a default name there would install whatever someone else publishes under it).
INSTALL_PLACE = 'DPPO_INSTALL = os.environ.get("DPPO_INSTALL", "")'


def _install_code(notebook: Path) -> str:
    """The first code cell's install code: its lines up to the first blank line."""
    return _source(next(c for c in _cells(notebook) if c["cell_type"] == "code")).split("\n\n", 1)[0] + "\n"


def test_every_chapter_installs_the_package_with_the_same_code():
    """One install code for all chapters, configurable in one place (``DPPO_INSTALL``), with nothing in it that
    needs GitHub: Colab, a workshop wheel or an index install all go through it."""
    codes = {nb.name: _install_code(nb) for nb in CHAPTERS}
    first = codes[CHAPTERS[0].name]
    differ = sorted(name for name, code in codes.items() if code != first)
    assert not differ, f"these chapters' first code cell must start with {CHAPTERS[0].name}'s install code: {differ}"
    assert INSTALL_PLACE in first, f"the install code must read the place to install from as {INSTALL_PLACE}"
    assert "check=True" not in first and "github.com" not in first and "google.colab" not in first, first
    assert "capture_output=True" in first and "SystemExit" in first, first


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_first_code_cell_installs_the_package_only_where_it_is_missing(notebook, monkeypatch):
    """Installed (``make setup``): the cell installs nothing. Missing (Colab) with ``DPPO_INSTALL`` unset: one line
    that says to set it, and no pip call (no name from an index). Set: one ``pip install`` of it. pip failing: one
    line that names DPPO_INSTALL, pip's error and what to do, not a CalledProcessError traceback."""
    import importlib.util
    import subprocess

    source = _source(next(c for c in _cells(notebook) if c["cell_type"] == "code"))
    assert source.startswith("# NBVAL_IGNORE_OUTPUT"), "versions differ between machines"
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    calls, answer = [], {"returncode": 0, "stderr": ""}

    def pip(cmd, **kwargs):
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, answer["returncode"], "", answer["stderr"])

    monkeypatch.setattr(subprocess, "run", pip)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "DPPO_INSTALL"})
    with torch.random.fork_rng():                                      # the cell seeds torch's global RNG
        exec(compile(source, notebook.name, "exec"), {})               # installed: installs nothing
    assert calls == []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",                   # as if dppo_core were not installed
                        lambda module, *a, **kw: None if module == "dppo_core" else real(module, *a, **kw))
    install = compile(_install_code(notebook), notebook.name, "exec")
    with pytest.raises(SystemExit) as unset:
        exec(install, {})
    assert calls == [] and "\n" not in str(unset.value) and "%env DPPO_INSTALL=" in str(unset.value), unset.value
    assert name.replace("-", "_") in str(unset.value) and "WORKSHOP.md" in str(unset.value), unset.value
    wheel = "/content/dppo_core-0.1.0-py3-none-any.whl"
    os.environ["DPPO_INSTALL"] = wheel                                 # %env DPPO_INSTALL=... in the notebook
    exec(install, {})
    assert len(calls) == 1, calls
    cmd, kwargs = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and cmd[-1] == wheel, cmd
    assert kwargs.get("capture_output") is True and not kwargs.get("check"), kwargs
    answer.update(returncode=1, stderr=f"ERROR: Could not find a version that satisfies the requirement\n"
                                       f"ERROR: No matching distribution found for {wheel}\n")
    with pytest.raises(SystemExit) as stopped:
        exec(install, {})
    message = str(stopped.value)
    assert "\n" not in message and f"DPPO_INSTALL={wheel!r}" in message, message
    assert f"No matching distribution found for {wheel}" in message and "%env DPPO_INSTALL=" in message, message
    assert "make dist" in message and "WORKSHOP.md" in message, message


#: Runs a chapter's install code (argv[1]) as if dppo_core were missing, and prints what the cell stops with.
AS_IF_MISSING = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **kw: None if name == "dppo_core" else real(name, *a, **kw)
try:
    exec(compile(open(sys.argv[1]).read(), "install code", "exec"), {})
except SystemExit as stopped:
    print(stopped)
"""


@pytest.mark.parametrize("no_color", [True, False], ids=["as-written", "without---no-color"])
def test_a_real_failing_install_under_force_color_shows_pips_error(tmp_path, no_color):
    """A real ``pip install`` of a path that does not exist, with ``FORCE_COLOR=1`` (ipykernel 7 sets it, and pip
    then colours its lines): the cell's one line carries pip's ERROR line, with no colour code in it. The cell
    passes ``--no-color`` and also strips ANSI codes; each alone is enough (the second case leaves the flag out)."""
    import subprocess

    code = _install_code(CHAPTERS[0])                                  # the same in every chapter (test above)
    if not no_color:
        assert code.count('"--no-color", ') == 1
        code = code.replace('"--no-color", ', "")
    (tmp_path / "install.py").write_text(code)
    wheel = tmp_path / "missing" / "dppo_core-0.1.0-py3-none-any.whl"
    env = {**os.environ, "FORCE_COLOR": "1", "DPPO_INSTALL": f"{wheel}[course]", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("NO_COLOR", None)
    run = subprocess.run([sys.executable, "-c", AS_IF_MISSING, str(tmp_path / "install.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    message = run.stdout.strip()
    assert run.returncode == 0 and message.startswith("pip could not install DPPO_INSTALL="), run.stdout + run.stderr
    assert "\n" not in message and "\x1b" not in message and "[0m" not in message, message
    said = message.partition(" (ERROR: ")[2]                          # pip's own words, not "([0m)"
    assert said and str(wheel) in said and "): point DPPO_INSTALL at the package" in said, message


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_first_code_cell_pins_the_cpu_kernels_before_torch_loads(notebook):
    """Opened with plain `jupyter lab` (no Makefile), a chapter pins the kernels itself, before anything loads torch,
    so it computes the outputs stored in it (tests/course/test_course.py checks the pins are the Makefile's)."""
    source = _source(next(c for c in _cells(notebook) if c["cell_type"] == "code"))
    lines = source.splitlines()
    pin = next((i for i, line in enumerate(lines) if line.startswith("pin_cpu_kernels()")), None)
    assert pin is not None, f"{notebook.name}: the first code cell must call pin_cpu_kernels()"
    loads = [i for i, line in enumerate(lines)
             if re.match(r"(import|from) (torch|transformers|peft|vllm|dppo_core\.(?!(tools\.)?course))", line)]
    assert all(i > pin for i in loads), f"{notebook.name}: line {loads[0] + 1} imports before the pins"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_ends_with_its_references(notebook):
    """The last cell lists the works the chapter relies on, each with where to find it (arXiv, journal, URL)."""
    last = _cells(notebook)[-1]
    text = _source(last)
    assert last["cell_type"] == "markdown" and text.startswith("## References"), \
        f"{notebook.name}: the last cell should be '## References'"
    entries = re.findall(r"^- .+", text, re.M)
    assert entries, f"{notebook.name}: no references listed"
    assert all(re.search(r"\(\d{4}\)", e) for e in entries), f"{notebook.name}: every entry names its year"
    assert re.search(r"arXiv:\d{4}\.\d{4,5}", text), f"{notebook.name}: no arXiv reference"
