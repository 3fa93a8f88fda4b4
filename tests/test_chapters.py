"""Every chapter keeps the course layout (notebooks/README.md, "How every chapter is laid out") and its Colab path.

What Colab runs is checked here without Colab: the badge opens the chapter's own file, and the first code cell,
run with a stand-in ``google.colab`` module, pip-installs this package (the name pyproject.toml declares) from the
repository the badge points to, and installs nothing outside Colab.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
OWNER_REPO = "dppo-from-scratch/dppo-from-scratch"


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def test_there_are_chapters_00_to_09():
    assert [p.name[:2] for p in CHAPTERS] == [f"{i:02d}" for i in range(10)]


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_layout(notebook):
    cells = _cells(notebook)
    first = _source(cells[0])
    assert cells[0]["cell_type"] == "markdown" and re.search(rf"^# Chapter {notebook.name[:2]} — ", first, re.M)
    badge = f"https://colab.research.google.com/github/{OWNER_REPO}/blob/main/notebooks/{notebook.name}"
    assert badge in first, f"{notebook.name}: the Colab badge must open this chapter ({badge})"
    assert "**Goal.**" in first
    markdown = "\n".join(_source(c) for c in cells if c["cell_type"] == "markdown")
    sections = re.findall(r"^## (\d+)\. ", markdown, re.M)
    assert sections and [int(s) for s in sections] == list(range(1, len(sections) + 1)), (notebook.name, sections)
    assert "## Summary" in markdown and "## Exercises" in markdown
    listed = (NOTEBOOKS / "README.md").read_text()
    assert f"]({notebook.name})" in listed, f"{notebook.name} is not in notebooks/README.md"


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_first_code_cell_installs_the_package_in_colab_only(notebook, monkeypatch):
    cell = next(c for c in _cells(notebook) if c["cell_type"] == "code")
    source = _source(cell)
    assert source.startswith("# NBVAL_IGNORE_OUTPUT"), "versions differ between machines"
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    calls = []

    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
    code = compile(source, notebook.name, "exec")
    with torch.random.fork_rng():                                      # the cell seeds torch's global RNG
        exec(code, {})                                                 # outside Colab: installs nothing
        assert calls == []
        monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
        exec(code, {})                                                 # in Colab: one pip install
    assert len(calls) == 1
    cmd, kwargs = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and kwargs.get("check") is True
    assert f"{name} @ git+https://github.com/{OWNER_REPO}" in cmd, cmd
