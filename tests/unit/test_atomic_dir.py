"""``atomic_dir``: a directory appears whole or not at all, and a forced rebuild (``replace``) keeps the old copy
until the new one is complete (build_tiny_model, warm_start and build_pretrained all write through it)."""

from __future__ import annotations

import pytest

from dppo_core.model_files import atomic_dir


def _writer(text: str):
    def write(out):
        (out / "config.json").write_text(text)
    return write


def _fails(out):
    (out / "config.json").write_text("half")
    raise RuntimeError("the rebuild failed")


def test_a_failed_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        atomic_dir(tmp_path / "model", _fails)
    assert list(tmp_path.iterdir()) == []


def test_without_replace_the_copy_already_there_wins(tmp_path):
    target = atomic_dir(tmp_path / "model", _writer("first"))
    assert atomic_dir(target, _writer("second")) == target  # a concurrent builder that finished first wins
    assert (target / "config.json").read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_failed_forced_rebuild_keeps_the_old_copy(tmp_path):
    target = atomic_dir(tmp_path / "model", _writer("old"))
    with pytest.raises(RuntimeError):
        atomic_dir(target, _fails, replace=True)
    assert (target / "config.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_forced_rebuild_replaces_the_old_copy_once_complete(tmp_path):
    target = atomic_dir(tmp_path / "model", _writer("old"))
    (target / "stale").write_text("from the old build")
    assert atomic_dir(target, _writer("new"), replace=True) == target
    assert (target / "config.json").read_text() == "new" and not (target / "stale").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # nothing left beside it


def test_a_forced_rebuild_that_cannot_move_in_puts_the_old_copy_back(tmp_path, monkeypatch):
    import os

    from dppo_core import model_files

    target = atomic_dir(tmp_path / "model", _writer("old"))
    real = os.rename

    def rename(src, dst):
        if str(src).startswith(str(tmp_path / ".model.")) and ".old-" not in str(src) and dst == target:
            raise OSError("the new copy cannot move in")
        return real(src, dst)

    monkeypatch.setattr(model_files.os, "rename", rename)
    with pytest.raises(OSError, match="cannot move in"):
        atomic_dir(target, _writer("new"), replace=True)
    assert (target / "config.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model"]
