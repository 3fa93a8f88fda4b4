"""Check that every commit since the rule began has a subject of at most 72 characters (details in the body).

    python scripts/check_commit_subjects.py            # the commits after RULE_SINCE up to HEAD (make lint)
    python scripts/check_commit_subjects.py --message FILE   # one message about to be committed (the hook)

The rule started after commit RULE_SINCE; earlier subjects are history and are not rewritten. In a shallow
clone that lacks RULE_SINCE, the commits present are checked. ``make hooks`` installs the commit-msg hook
(``.githooks/commit-msg``), which runs the second form before a commit is made.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_SUBJECT = 72
#: The last commit before the rule; the commits after it are checked.
RULE_SINCE = "76e8727"


def subject_problem(message: str) -> str | None:
    """Why a commit message breaks the rule (None when it keeps it): its first line is the subject."""
    lines = message.splitlines()
    subject = lines[0].rstrip() if lines else ""
    if not subject:
        return "the subject (first line) is empty"
    if len(subject) > MAX_SUBJECT:
        return f"the subject is {len(subject)} characters (at most {MAX_SUBJECT}): move the detail to the body"
    if len(lines) > 1 and lines[1].strip():
        return "the second line must be blank (subject, blank line, body)"
    return None


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def commits_to_check() -> list[str]:
    try:
        _git("cat-file", "-e", f"{RULE_SINCE}^{{commit}}")
        span = f"{RULE_SINCE}..HEAD"
    except subprocess.CalledProcessError:  # a shallow clone: what is there
        span = "HEAD"
    return _git("rev-list", "--no-merges", span).split()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--message", type=Path, help="check this commit message file instead of the history")
    args = parser.parse_args(argv)
    if args.message is not None:
        text = "\n".join(line for line in args.message.read_text().splitlines() if not line.startswith("#"))
        problem = subject_problem(text)
        if problem:
            print(f"commit message: {problem}", file=sys.stderr)
        return 1 if problem else 0
    bad = []
    for sha in commits_to_check():
        problem = subject_problem(_git("log", "-1", "--format=%B", sha))
        if problem:
            bad.append(f"{sha[:9]} {_git('log', '-1', '--format=%s', sha).strip()[:60]}...: {problem}")
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
