"""The commit-subject rule (scripts/check_commit_subjects.py, run by `make lint` and the `make hooks` hook)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_commit_subjects.py"
spec = importlib.util.spec_from_file_location("check_commit_subjects", SCRIPT)
rule = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rule)


@pytest.mark.parametrize("message, problem", [
    ("Trainer corrects the rollout engine's mismatch\n\nThe detail.", None),
    ("x" * 72, None),
    ("x" * 73, "73 characters (at most 72)"),
    ("", "empty"),
    ("A subject\nand a body on the second line", "second line must be blank"),
])
def test_a_subject_is_at_most_72_characters_then_a_blank_line(message, problem):
    found = rule.subject_problem(message)
    assert found is None if problem is None else problem in found


def test_the_hook_form_reads_the_message_file_and_skips_comments(tmp_path):
    msg = tmp_path / "COMMIT_EDITMSG"
    msg.write_text("# a comment git adds\nShort subject\n\nbody\n")
    assert subprocess.run([sys.executable, str(SCRIPT), "--message", str(msg)]).returncode == 0
    msg.write_text("y" * 80 + "\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--message", str(msg)], capture_output=True, text=True)
    assert proc.returncode == 1 and "80 characters" in proc.stderr


def test_every_commit_since_the_rule_keeps_it():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist or a copy): no history to check")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
