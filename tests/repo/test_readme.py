"""The README's quick start can be followed verbatim in a fresh shell, and says what the code says.

A fresh shell has no activated environment: every command of the quick start is a `make` target of the Makefile or
a program under `.venv/bin/` that `make setup` installs, and its block is valid bash. The demo's time in the README
is the one the demo prints (:data:`dppo_core.tools.bench.presets.DEMO_TIME`).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from dppo_core.tools.bench.presets import BENCH_PRESETS, DEMO_TIME

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Programs of `.venv/bin` that are not the package's own scripts: the interpreter, and what the dev extra installs.
VENV_PROGRAMS = {"python", "pip", "jupyter"}


def quick_start() -> str:
    text = README.read_text()
    return text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]


def quick_start_commands() -> list[str]:
    """The commands of the quick start's bash block, one per line, without their comments."""
    block = re.search(r"```bash\n(.*?)```", quick_start(), re.S)
    assert block, "README.md's quick start has no ```bash block"
    return [line.split(" #", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def _scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def command_problems(command: str) -> list[str]:
    """Why ``command`` would not run as written in a fresh shell at the clone's top, or nothing."""
    words = shlex.split(command)
    program, args = words[0], words[1:]
    found = []
    if program == "make":
        found += [f"no make target {t!r}" for t in args if "=" not in t and t not in _make_targets()]
    elif program.startswith(".venv/bin/"):
        name = program.removeprefix(".venv/bin/")
        if name not in _scripts() | VENV_PROGRAMS:
            found.append(f"{program}: neither a script of pyproject.toml nor {sorted(VENV_PROGRAMS)}")
    else:
        found.append(f"{program!r} needs an activated environment: write make ... or .venv/bin/{program}")
    for arg in args:  # the files and directories it names exist in the clone
        if not arg.startswith("-") and ("/" in arg or arg.endswith(".py")) and not (ROOT / arg).exists():
            found.append(f"{arg} does not exist")
    return found


def test_quick_start_block_is_bash_that_needs_no_activated_environment():
    commands = quick_start_commands()
    assert commands and commands[0] == "make demo", commands
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    block = "\n".join(commands) + "\n"
    syntax = subprocess.run([bash, "-n"], input=block, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    problems = {c: command_problems(c) for c in commands if command_problems(c)}
    assert not problems, problems


def test_the_checker_sees_what_a_fresh_shell_cannot_run():
    assert command_problems("make demo") == [] and command_problems(".venv/bin/dppo doctor") == []
    assert command_problems(".venv/bin/python examples/own_loop.py") == []
    assert command_problems("make demmo") == ["no make target 'demmo'"]
    assert command_problems("python examples/own_loop.py") == [
        "'python' needs an activated environment: write make ... or .venv/bin/python"]
    assert command_problems(".venv/bin/python examples/no_such.py") == ["examples/no_such.py does not exist"]
    assert command_problems(".venv/bin/dpo doctor")


def test_every_command_in_the_quick_start_table_exists():
    """The table's first column: `make X` targets and `.venv/bin/...` programs, each checked as above."""
    rows = [line for line in quick_start().splitlines() if line.startswith("| `")]
    commands = [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]
    assert "make demo" in commands and "make setup" in commands, commands
    problems = {c: command_problems(c) for c in commands if command_problems(c)}
    assert not problems, problems


def test_readme_runs_examples_with_the_environments_python():
    """`python examples/...` fails with "No module named 'torch'" unless the environment is active."""
    bare = re.findall(r"(?<![/\w])python3? (?:examples|scripts)/\S+", README.read_text())
    assert not bare, f"write .venv/bin/python: {bare}"


def test_demo_time_is_one_constant_the_demo_prints_and_the_readme_says():
    assert BENCH_PRESETS["demo"].runtime.startswith(DEMO_TIME)
    row = next(line for line in quick_start().splitlines() if line.startswith("| `make demo` |"))
    said = row.rstrip(" |").rsplit(" | ", 1)[1]                       # the last column: how long it takes
    assert said == DEMO_TIME, f"README.md says the demo takes {said!r}; DEMO_TIME (presets.py) is {DEMO_TIME!r}"
    assert not re.search(r"\b\d+(\.\d+)? minutes?\b", row.replace(DEMO_TIME, "")), row
