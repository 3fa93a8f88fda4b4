"""A run's files: its output directory, checkpoints and logs, written so that a crash or Ctrl-C never leaves a
state that cannot resume (the :class:`~dppo_core.run.Run` decides when; this module, how).

A checkpoint ``checkpoint-<step>/`` holds the model or adapter (``model/``), the optimizer state, the run's
own state (a JSON file the run names: the trainer's prompt history) and the step with the torch RNG state. It
is written to a temp dir and renamed into place (atomic); old ones are moved out of sight before they are
deleted, so ``--resume`` never picks a half-written or half-deleted one. Everything a checkpoint holds is read
and checked before any of it is applied, so a damaged file raises a :class:`~dppo_core.config.ConfigError`
that says which checkpoint to delete, and leaves the trainer as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from dppo_core.config import ConfigError
from dppo_core.grouplog import FILENAME as GROUP_LOG

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedConfig, PreTrainedModel

CHECKPOINT_PREFIX = "checkpoint-"
LOG_FILES = ("metrics.jsonl", "eval.jsonl", GROUP_LOG)
#: What makes a directory hold a run (besides ``checkpoint-N/``): a fresh run there would replace them.
RUN_FILES = ("config.json", *LOG_FILES, "final")
#: Every name a run writes into its output directory, besides those starting with :data:`WRITTEN_PREFIXES`:
#: the RUN_FILES, TensorBoard's events and the temp copy of a log being truncated on resume. A file a run
#: starts writing is added here, the one list of them (a bench's ``--resume`` removes these from an unfinished
#: run).
WRITTEN_FILES = (*RUN_FILES, "tensorboard", *(f".tmp-{name}" for name in LOG_FILES))
#: Checkpoints, and the temp dirs of a checkpoint or ``final/`` being written or deleted.
WRITTEN_PREFIXES = (CHECKPOINT_PREFIX, f".tmp-{CHECKPOINT_PREFIX}", ".tmp-final-")


class RunExistsError(ConfigError):
    """``output_dir`` holds a run and neither resume nor overwrite was asked for: nothing was changed."""


def check_output_dir(output_dir: Path) -> None:
    """Raise :class:`ConfigError` naming ``output_dir`` if a run cannot be written there: it is a file, a part
    of its path is a file, or it cannot be created."""
    for part in (output_dir, *output_dir.parents):
        if part.exists() and not part.is_dir():
            where = "is a file" if part == output_dir else f"lies under {part}, which is a file"
            raise ConfigError(f"output_dir={str(output_dir)!r} {where}; choose a directory (--output-dir "
                              "DIR)")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir={str(output_dir)!r} cannot be created ({exc.strerror}); choose a "
                          "directory you can write (--output-dir DIR)") from exc
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={str(output_dir)!r} is not writable; choose a directory you can write "
                          "(--output-dir DIR)")


def run_files(output_dir: Path) -> list[str]:
    """The names in ``output_dir`` that belong to a run (logs, config.json, final/, checkpoints), sorted."""
    if not output_dir.is_dir():
        return []
    names = [name for name in RUN_FILES if (output_dir / name).exists()]
    return names + [d.name for d in list_checkpoints(output_dir)]


def writes(name: str) -> bool:
    """Whether a run writes a file or directory of this ``name`` into its output directory."""
    return name in WRITTEN_FILES or name.startswith(WRITTEN_PREFIXES)


def aside_path(output_dir: Path) -> Path:
    """Where :func:`move_aside` would put ``output_dir``'s run: ``<name>.previous-<n>`` beside it, the first n
    free."""
    output_dir = output_dir.resolve()
    n = 1
    while (candidate := output_dir.with_name(f"{output_dir.name}.previous-{n}")).exists():
        n += 1
    return candidate


def move_aside(output_dir: Path) -> Path:
    """Rename ``output_dir`` (the whole directory, one atomic step) to :func:`aside_path` and create it again
    empty; nothing is deleted. Returns where the earlier run is now."""
    target = aside_path(output_dir)
    os.rename(output_dir, target)
    output_dir.mkdir()
    return target


def must_move_aside(output_dir: Path, found: list[str], *, resume: bool, overwrite: bool, what: str = "a run",
                    resume_hint: str = "continue it with --resume", reads: Iterable[str | Path] = ()) -> bool:
    """Whether a new run must first move ``output_dir`` aside (:func:`move_aside`), given ``found``, the files
    of an earlier run there (:func:`run_files`): not when there are none, or with ``resume``; with
    ``overwrite``, yes; otherwise :class:`RunExistsError`. Nothing is changed here. ``reads``: paths the new
    run reads, which ``overwrite`` must not move away (the model), nor the current directory."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in the output dir and --overwrite moves it aside: pass "
                          "one")
    if not found or resume:
        return False
    if not overwrite:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise RunExistsError(f"output_dir={str(output_dir)!r} holds {what} ({shown}); {resume_hint}, or pass "
                             f"--overwrite to move it to {aside_path(output_dir).name} first, or choose "
                             "another --output-dir. Nothing was changed")
    here = output_dir.resolve()
    for path in (Path.cwd(), *map(Path, reads)):
        if path.exists() and path.resolve().is_relative_to(here):
            raise ConfigError(f"--overwrite would move {path} away with output_dir={str(output_dir)!r}, and "
                              "the run needs it; choose another --output-dir")
    return True


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete checkpoints in ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for d in output_dir.glob(f"{CHECKPOINT_PREFIX}*"):
        if d.is_dir() and (d / "trainer_state.json").is_file() and d.name[len(CHECKPOINT_PREFIX):].isdigit():
            found.append(d)
    return sorted(found, key=lambda d: int(d.name[len(CHECKPOINT_PREFIX):]))


def remove_stale_temp_dirs(output_dir: Path) -> None:
    """Temp dirs of a run killed while writing or deleting a checkpoint: never checkpoints, so removed."""
    for stale in output_dir.glob(f".tmp-{CHECKPOINT_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def _remove_out_of_sight(path: Path, output_dir: Path) -> None:
    """Rename ``path`` into a temp dir (one atomic step), then delete it: never half-deleted in place."""
    trash = Path(tempfile.mkdtemp(prefix=f".tmp-{CHECKPOINT_PREFIX}", dir=output_dir))
    with contextlib.suppress(OSError):
        os.rename(path, trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(output_dir: Path, step: int, model: torch.nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, state: dict[str, Any], run_state: dict[str, Any],
                    state_file: str, keep: int = 2) -> Path:
    """Write ``checkpoint-<step>`` atomically (temp dir, then rename) and keep the newest ``keep``.

    ``state``: JSON-serialisable trainer state (config, model path); the step and torch RNG are added.
    ``run_state``: the run's own JSON-serialisable state, written to ``state_file``.
    """
    from dppo_core.model_files import quiet_transformers

    target = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    if target.exists():
        return target
    remove_stale_temp_dirs(output_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{CHECKPOINT_PREFIX}", dir=output_dir))
    try:
        with quiet_transformers():
            cast("PreTrainedModel | PeftModel", model).save_pretrained(str(tmp / "model"))
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / state_file).write_text(json.dumps(run_state))
        full_state = {"step": step, **state, "torch_rng": torch.get_rng_state().tolist()}
        (tmp / "trainer_state.json").write_text(json.dumps(full_state))
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(output_dir)[:-keep]:
        _remove_out_of_sight(old, output_dir)
    return target


@dataclass
class Checkpoint:
    """Everything a checkpoint holds, read and checked, not yet applied."""

    path: Path
    step: int
    torch_rng: list[int]
    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    run_state: dict[str, Any] | None  # None: a checkpoint written before the run's state was saved


def _fail(path: Path, what: str, exc: BaseException) -> ConfigError:
    return ConfigError(f"checkpoint {path}: {what} ({type(exc).__name__}: {exc}); delete the checkpoint to "
                       "resume from the one before")


def read_checkpoint(path: Path, state_file: str, check_state: Callable[[dict[str, Any]], object]
                    ) -> Checkpoint:
    """Read and check every file of a checkpoint; a damaged one raises ConfigError naming it. ``state_file``:
    the run's own state (:func:`save_checkpoint`), checked by ``check_state``, which raises ValueError on a
    bad one."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        step, torch_rng = int(state["step"]), list(state["torch_rng"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"checkpoint {path} is incomplete or corrupt ({exc}); delete it to resume from "
                          "the one before, or start without --resume") from exc
    run_state = None
    if (path / state_file).is_file():
        try:
            run_state = json.loads((path / state_file).read_text())
            check_state(run_state)
        except ValueError as exc:
            raise ConfigError(f"checkpoint {path}: {state_file} is corrupt ({exc}); delete the checkpoint to "
                              "resume from the one before") from exc
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    try:
        for f in sorted((path / "model").glob("*.safetensors")):
            weights.update(load_file(f))
    except Exception as exc:  # a truncated or overwritten file: safetensors raises its own error types
        raise _fail(path, "its model weights cannot be read", exc) from exc
    if not weights:
        raise ConfigError(f"checkpoint {path} has no model weights (*.safetensors); delete it and resume "
                          "again")
    try:
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
    except Exception as exc:
        raise _fail(path, "optimizer.pt is missing or cannot be read", exc) from exc
    return Checkpoint(path, step, torch_rng, weights, optimizer_state, run_state)


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], update_mode: str,
                 path: Path) -> None:
    """Load a checkpoint's weights: the whole model (``full``) or the LoRA adapter (the others)."""
    if update_mode == "full":
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if cast("PreTrainedConfig", model.config).tie_word_embeddings:  # save_pretrained drops the tied copy
            missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise ConfigError(f"checkpoint {path} does not match the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}); was it written with another model or "
                              "update_mode?")
    else:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)


def truncate_logs(output_dir: Path, step: int, final: bool) -> None:
    """Drop log lines of steps after ``step``, the resumed checkpoint's (they will be run again).

    Also dropped: a line cut off by a crash (a run killed mid-write; it does not parse), and, when the
    run resumes at its last step (``final``), the final evaluation (it is run again). Records without a
    step are kept. The file is replaced atomically, so a crash here loses nothing.
    """
    for name in LOG_FILES:
        f = output_dir / name
        if not f.exists():
            continue
        text = f.read_text(errors="replace")
        kept = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # blank, or cut off by a crash
                continue
            s = record.get("step") if isinstance(record, dict) else None
            if isinstance(s, (int, float)) and (s > step or (final and name == "eval.jsonl" and s == step)):
                continue  # will be run and logged again
            kept.append(line)
        new = "".join(line + "\n" for line in kept)
        if new != text:
            tmp = f.with_name(f".tmp-{name}")
            tmp.write_text(new)
            os.replace(tmp, f)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One write of one whole line, handed to the OS at once (the file is closed, hence flushed, per record):
    a crash loses at most the line being written, and a cut-off last line is dropped on resume."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def save_final(output_dir: Path, model: torch.nn.Module, tokenizer: Any) -> None:
    """Write ``final/`` (model and tokenizer) atomically: a temp dir, renamed into place."""
    from dppo_core.model_files import quiet_transformers

    tmp = Path(tempfile.mkdtemp(prefix=".tmp-final-", dir=output_dir))
    try:
        with quiet_transformers():
            cast("PreTrainedModel | PeftModel", model).save_pretrained(str(tmp))
            tokenizer.save_pretrained(tmp)
        target = output_dir / "final"
        # out of the way first: "final" is never half-written (at worst absent until resume)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=".tmp-final-old-", dir=output_dir))
            os.rename(target, old / "final")
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
