"""DPPO's prompt pruning on verl's v1 synchronous trainer: ``trainer.v1.trainer_mode=dppo_sync``.

Importing this module registers :class:`DPPOSyncTrainer` in verl's trainer registry (``register_trainer``)
under :data:`~dppo_core.integrations.verl.TRAINER_MODE`; ``main_ppo`` then builds it instead of
``PPOTrainerSync``. It is verl's synchronous trainer, unchanged but for three points:

1. **Prompts are drawn before rollout.** ``_next_train_batch`` takes verl's ``data.train_batch_size``
   candidates from its dataloader, as verl does, then keeps each with the installed estimator's π_q
   (:func:`~dppo_core.integrations.verl.select_prompt_rows`, seeded by verl's global step) and sends only
   the kept prompts to rollout. ``_step_once`` then waits for the kept count instead of the whole batch.
   verl's ``_balance_batch`` pads the rolled-out rows up to a multiple of ``ppo_mini_batch_size × n``
   with its no-op sequences (128 tokens each, zero loss mask), so a pruned prompt costs no rollout and,
   in the log-prob and update passes, G short rows instead of its completions.
2. **Completions are weighed in the advantages.** The advantage estimator
   :data:`~dppo_core.integrations.verl.ADV_ESTIMATOR` gives each kept completion A·1/(π_q p_qi) and each
   dropped one A = 0, with the normaliser C = ``data.train_batch_size × n`` in the policy loss. It updates
   the prompt history with every rolled-out group. Dropped completions still pass through the update with
   a zero loss: completion pruning saves nothing here, only prompt pruning does.
3. **The prompt history is checkpointed.** It is written into verl's checkpoint folder
   (``global_step_N/dppo_prompt_history.json``, atomically, before verl's own files and its
   ``latest_checkpointed_iteration.txt``) and read back on resume. The draws are a function of the seed,
   verl's global step and the history, so a resumed run draws what an uninterrupted one would.

The config is checked when the trainer is built (:func:`~dppo_core.integrations.verl.check_config`), so
an override at launch that would bias the loss, or a ``rollout.n`` other than the G the estimator was
installed with (every group dropped as failed: a run that trains on nothing), stops the run before any
rollout.

What is unbiased is what dppo_core.integrations.verl says: the loss and its gradient at the parameters of the
draw, not the optimizer's update. Not covered:

- A drawn group that comes back with fewer than G completions (some of its sessions failed) is dropped
  whole, and one that never comes back is missing: both are counted (``dppo/failed_groups``,
  ``dppo/lost_groups``) and warned about. Rollouts that verl refills are rolled out whole (π = 1).
- The entropy bonus acts on the kept rows unweighted.
- Multi-turn agent loops and per-prompt ``rollout.n``: groups of another size than G are dropped as failed.

Tested on CPU against verl 0.9.1's real trainer methods (its dataloader fetch, its advantage path, its
registry), not end to end: verl's v1 trainer needs Ray, TransferQueue and GPU rollout servers.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

try:
    from verl.trainer.ppo.v1 import register_trainer  # type: ignore[import-not-found, unused-ignore]
    from verl.trainer.ppo.v1.trainer_sync import (  # type: ignore[import-not-found, unused-ignore]
        PPOTrainerSync,
    )
except ImportError as exc:  # verl (with its verl-core extra: TransferQueue) is not a dependency of dppo_core
    raise ImportError("dppo_core.integrations.verl_trainer needs verl's v1 trainer (tested with verl==0.9.1 "
                      "and TransferQueue 0.1.11: pip install 'verl[verl-core]==0.9.1'; "
                      "see examples/verl/)") from exc

from dppo_core.integrations import verl as dv

__all__ = ["HISTORY_FILE", "DPPOSyncTrainer"]

HISTORY_FILE = "dppo_prompt_history.json"
logger = logging.getLogger(__name__)


@register_trainer(dv.TRAINER_MODE)
class DPPOSyncTrainer(PPOTrainerSync):  # type: ignore[misc, unused-ignore]
    """verl's ``PPOTrainerSync`` with DPPO's prompt draw before rollout (module docstring)."""

    _dppo_candidates = 0
    _dppo_kept = 0

    def __init__(self, config: Any) -> None:
        if dv.installed_estimator() is None:
            raise ValueError(f"trainer.v1.trainer_mode={dv.TRAINER_MODE} needs DPPO's estimator installed in "
                             "the driver (dppo_core.integrations.verl.install, e.g. by "
                             "examples/verl/dppo_plugin.py through VERL_USE_EXTERNAL_MODULES)")
        dv.check_config(config)
        super().__init__(config)

    # verl's base trainer branches on ``trainer_mode == "sync"`` (its replay buffer, its checkpoint, its
    # dataloader), reading the configured name: this trainer is that sync trainer under another name.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value not in (dv.TRAINER_MODE, "sync"):
            raise ValueError(f"{type(self).__name__} runs as trainer.v1.trainer_mode={dv.TRAINER_MODE}, "
                             f"not {value!r}")

    def _next_train_batch(self, num_prompts: int | None = None) -> Any:
        """verl's candidates (``data.train_batch_size`` prompts), then the kept ones. A call with
        ``num_prompts`` is verl refilling failed groups: those prompts are rolled out whole (π = 1)."""
        batch = super()._next_train_batch(num_prompts)
        if num_prompts is not None:
            return dv.select_prompt_rows(batch, self.global_steps, full=True)
        kept = dv.select_prompt_rows(batch, self.global_steps)
        self._dppo_candidates, self._dppo_kept = len(batch), len(kept)
        return kept

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> Any:
        """verl's step on the kept prompts: the replay buffer waits for their groups, not for the whole
        batch."""
        if sample_batch_size != self._dppo_candidates:
            raise ValueError(f"{type(self).__name__}: a step samples {sample_batch_size} prompts but drew "
                             f"from {self._dppo_candidates} candidates; leave parameter_sync_step at 1")
        metrics.update({"dppo/prompts_candidates": self._dppo_candidates,
                        "dppo/prompts_rolled_out": self._dppo_kept,
                        "dppo/prompt_keep_fraction": self._dppo_kept / max(1, self._dppo_candidates)})
        failed, lost = dv.dropped_groups()
        batch = super()._step_once(metrics, timing_raw, self._dppo_kept)
        failed_after, lost_after = dv.dropped_groups()
        metrics.update({"dppo/failed_groups": failed_after - failed, "dppo/lost_groups": lost_after - lost})
        return batch

    # --- the prompt history beside verl's checkpoint ---------------------------------------------------
    def _step_folder(self, resume: bool = False) -> Path:
        trainer = self.config.trainer
        if resume and trainer.resume_mode == "resume_path":
            folder = Path(trainer.resume_from_path)
        else:
            folder = Path(trainer.default_local_dir) / f"global_step_{self.global_steps}"
        return folder if folder.is_absolute() else Path.cwd() / folder

    def _save_checkpoint(self) -> None:
        """The history first: verl's save ends by marking the folder the latest checkpoint (and calling the
        user's checkpoint callback), which must find the history there."""
        estimator = dv.installed_estimator()
        if estimator is not None:
            path = self._step_folder() / HISTORY_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(estimator.state_dict()))
            os.replace(tmp, path)  # atomic: a crash leaves the old file or the new one
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        estimator = dv.installed_estimator()
        if estimator is None or self.global_steps == 0:
            return
        path = self._step_folder(resume=True) / HISTORY_FILE
        if not path.exists():
            logger.warning("DPPO: no %s in %s; the prompt history starts empty (every prompt kept until "
                           "seen)", HISTORY_FILE, path.parent)
            return
        estimator.load_state_dict(json.loads(path.read_text()))
