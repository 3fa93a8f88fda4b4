"""The runnable examples in examples/: each runs as a script, a couple of steps, and says what it did.

Run as subprocesses from the repository root with this process's environment (DPPO_CACHE_DIR included, so the
warm start is the cached one); their outputs go to a temporary directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, out: Path, steps: int = 2, timeout: float = 300, stderr: list | None = None) -> str:
    """Run examples/<name> for ``steps`` steps into ``out``; return its stdout (fails on a non-zero exit). Its
    stderr is appended to ``stderr`` when given."""
    proc = subprocess.run([sys.executable, f"examples/{name}", "--steps", str(steps), "--output-dir", str(out)],
                          cwd=REPO_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    if stderr is not None:
        stderr.append(proc.stderr)
    return proc.stdout


def test_own_loop(tmp_path):
    """The hand-written loop takes its steps and prunes: fewer completions trained than rolled out."""
    stdout = run_example("own_loop.py", tmp_path)
    lines = re.findall(r"^step (\d+) .*prompts (\d+)/(\d+) .*completions (\d+)/(\d+) .*loss [-+]\d+\.\d+$",
                       stdout, re.MULTILINE)
    steps = [tuple(map(int, line)) for line in lines]  # (step, prompts kept, window, trained, rolled out)
    assert [s[0] for s in steps] == [1, 2], stdout
    assert all(kept <= window and trained <= rolled for _, kept, window, trained, rolled in steps), stdout
    assert any(trained < rolled for _, _, _, trained, rolled in steps), stdout  # completions pruned
    assert (tmp_path / "estimator.json").is_file()  # the estimator's state, written to --output-dir


def test_estimator_doc_quotes_own_loop():
    """docs/estimator.md's "A hand-written loop" shows lines of examples/own_loop.py as they are (dedented)."""
    doc = (REPO_ROOT / "docs" / "estimator.md").read_text()
    section = doc.split("## A hand-written loop", 1)[1].split("\n## ", 1)[0]
    excerpt = section.split("```python\n", 1)[1].split("```", 1)[0]
    source = (REPO_ROOT / "examples" / "own_loop.py").read_text()
    # the excerpt is main()'s body, less its indentation
    assert textwrap.indent(excerpt, "    ") in source, "docs/estimator.md's excerpt differs from examples/own_loop.py"


def test_trl_dppo(tmp_path):
    """DPPOGRPOTrainer takes its steps and prunes completions (TRL's output directory: a temporary one)."""
    pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'dppo-core[bench]'")
    stderr: list[str] = []
    stdout = run_example("trl_dppo.py", tmp_path, timeout=400, stderr=stderr)
    # filtered once in the example, with the reason: TRL's vLLM-version warning (five times), bitsandbytes' kernel note
    assert "TRL currently supports vLLM versions" not in stderr[0] and "gemm_4bit_forward" not in stderr[0], stderr
    kept = re.findall(r"^step (\d+) .*completions kept (\d\.\d+)", stdout, re.MULTILINE)
    assert [int(s) for s, _ in kept] == [1, 2], stdout
    assert any(float(share) < 1 for _, share in kept), stdout  # completions pruned
    assert "done: 2 steps" in stdout
