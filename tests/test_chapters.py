"""Every chapter keeps the course layout (notebooks/README.md, "How every chapter is laid out") and its Colab path.

What Colab runs is checked here without Colab: the badge opens the chapter's own file, and the first code cell,
run with a stand-in ``google.colab`` module, pip-installs this package (the name pyproject.toml declares) from the
repository the badge points to, and installs nothing outside Colab.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_first_code_cell_installs_the_package_in_colab_only(notebook, monkeypatch):
    cell = next(c for c in _cells(notebook) if c["cell_type"] == "code")
    source = _source(cell)
    assert source.startswith("# NBVAL_IGNORE_OUTPUT"), "versions differ between machines"
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    calls = []

    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
    monkeypatch.setattr(os, "environ", dict(os.environ))             # the kernel pins stay in this test
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


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_first_code_cell_pins_the_cpu_kernels_before_torch_loads(notebook):
    """Opened with plain `jupyter lab` (no Makefile), a chapter pins the kernels itself, before anything loads torch,
    so it computes the outputs stored in it (tests/test_course.py checks the pins are the Makefile's)."""
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
