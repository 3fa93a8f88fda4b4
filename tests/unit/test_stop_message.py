"""Ctrl-C's last words: a training loop's stop says once what it wrote and what to run next, with no stray
"interrupted" line after it; an abort (a second Ctrl-C) or a Ctrl-C outside training still says "interrupted"."""

from __future__ import annotations

import os
import signal

import pytest

from dppo_core.run import StopRequest
from dppo_core.tools import cli


def _run(monkeypatch, capsys, command) -> tuple[int, str, str]:
    monkeypatch.setattr(cli, "cmd_doctor", lambda args: command())  # `dppo doctor` stands in for any command
    code = cli.main(["doctor", "--quick"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(autouse=True)
def _default_sigint():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # SIG_IGN in a background job
    yield
    signal.signal(signal.SIGINT, before)


def test_a_stop_after_a_step_is_not_followed_by_interrupted(monkeypatch, capsys):
    def train():
        with StopRequest() as stop:
            _ctrl_c()
            assert stop.requested
            print("stopped at step 1: checkpoint written to run/checkpoint-1; continue with --resume")
            raise KeyboardInterrupt                                      # as the trainer does after its message

    code, out, err = _run(monkeypatch, capsys, train)
    assert code == 130 and "stopping after this step" in out and "stopped at step 1: checkpoint" in out
    assert "interrupted" not in out + err, out + err


def test_an_abort_or_a_ctrl_c_outside_training_says_interrupted(monkeypatch, capsys):
    def abort():
        with StopRequest():
            _ctrl_c()
            _ctrl_c()                                                    # the second one raises at once

    code, _, err = _run(monkeypatch, capsys, abort)
    assert code == 130 and err.strip() == "interrupted", err

    def after_a_finished_loop():
        with StopRequest():
            pass
        raise KeyboardInterrupt                                          # e.g. during the final evaluation

    code, _, err = _run(monkeypatch, capsys, after_a_finished_loop)
    assert code == 130 and err.strip() == "interrupted", err

    def no_loop():
        raise KeyboardInterrupt

    code, _, err = _run(monkeypatch, capsys, no_loop)
    assert code == 130 and err.strip() == "interrupted", err
