"""Model directories on disk: where the models the package builds are cached, how a directory is written so
that a crash never leaves half of one, and transformers kept quiet while it loads or saves.

- :func:`default_cache_dir`: ``$DPPO_CACHE_DIR``, else ``$XDG_CACHE_HOME/dppo_core``, else
  ``~/.cache/dppo_core`` (the tiny model and its warm start, :mod:`dppo_core.models` and
  :mod:`dppo_core.warm_start`; the models of a published shape, :mod:`dppo_core.shapes`).
- :func:`atomic_dir`: write into a temporary sibling, then rename into place.
- :func:`quiet_transformers`: transformers' per-file progress bars hidden inside a block (used wherever the
  package loads or saves weights: the builders, the policy, checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    """Where built models go: ``$DPPO_CACHE_DIR``, else ``$XDG_CACHE_HOME/dppo_core``, else
    ``~/.cache/dppo_core``."""
    if os.environ.get("DPPO_CACHE_DIR"):
        return Path(os.environ["DPPO_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dppo_core"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-file progress bars (weights loading/writing) inside the block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def atomic_dir(target: Path, write: Callable[[Path], None], *, replace: bool = False) -> Path:
    """Run ``write(tmp)`` into a temporary sibling of ``target`` and rename it into place.

    A crash or Ctrl-C leaves no half-written ``target``; a concurrent builder that finished first wins.
    ``replace`` (a forced rebuild): a ``target`` already there is swapped out only once the new one is
    complete, so a rebuild that fails or is interrupted leaves it as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with quiet_transformers():
            write(tmp)
        if replace and target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except OSError:
                os.rename(old, target)  # the old copy back in place, as if the rebuild had not run
                raise
            shutil.rmtree(old, ignore_errors=True)
            return target
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
