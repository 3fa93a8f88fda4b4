"""``Run``: a training run's life, below the trainer's step.

A run owns what every step shares and no step decides: where it runs (the device, the processes of a
data-parallel job), its output directory (refusing to overwrite a run, moving one aside, resuming from the
last checkpoint), its logs (``metrics.jsonl``, ``eval.jsonl``, ``groups.jsonl``, TensorBoard, the callbacks),
when it evaluates and checkpoints, and how Ctrl-C stops it. :class:`~dppo_core.trainer.DPPOTrainer` is a
``Run`` that knows what one step is (:meth:`Run.train_step`); the files themselves are written by
:mod:`dppo_core.run.disk`.

The loop (:meth:`Run.train`), as a schedule:

    prepare the output dir (resume: load the last checkpoint, cut the logs back to it)
        ── start() ── evaluate at 0
    until max_steps: train_step ── log ── every eval_steps: evaluate ── every save_steps: checkpoint
        ── Ctrl-C? checkpoint
    evaluate ── final/

A subclass sets ``model``, ``tokenizer``, ``optimizer`` and ``model_path``, implements :meth:`train_step` and
:meth:`evaluate`, and says what else a checkpoint holds (:meth:`run_state`, :meth:`load_run_state`: the
trainer's prompt history); :meth:`start` runs before the first step. The run knows no algorithm: a step's
phases are named by whoever times them (:class:`PhaseTimer`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dppo_core.distributed import all_reduce_max, barrier, init_distributed
from dppo_core.grouplog import FILENAME as GROUP_LOG
from dppo_core.run import disk
from dppo_core.run.disk import RunExistsError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["Callback", "PhaseTimer", "Run", "RunExistsError", "StopRequest", "disk"]

Callback = Callable[[dict[str, Any]], None]


class RunConfig(Protocol):
    """What a run reads of its config (:class:`~dppo_core.config.DPPOConfig` is one; the run knows no
    algorithm)."""

    output_dir: str
    max_steps: int
    eval_steps: int
    save_steps: int
    seed: int
    device: str
    deterministic: bool
    cpu_threads: int | None
    tensorboard: bool
    update_mode: str  # "full": a checkpoint holds the whole model; else the adapter
    log_groups: bool  # write groups.jsonl (a line per step, :attr:`Run.last_groups`)

    def to_dict(self) -> dict[str, Any]: ...

    def to_json(self) -> str: ...


class StopRequest:
    """While active (``with stop:``), the first SIGINT/SIGTERM sets ``requested``; a second one aborts.

    The training loop checks ``requested`` after each step, writes a checkpoint and stops, so Ctrl-C
    always leaves a resumable state; a second Ctrl-C raises ``KeyboardInterrupt`` at once (the last
    checkpoint written stays valid).

    ``StopRequest.stopping`` (one flag for the process) is True from a first signal until a second one, the
    next ``with``, or the end of the block without an exception: a ``KeyboardInterrupt`` seen while it is True
    is the loop's own stop, which has already said what it did and what to run next (``dppo`` then prints
    nothing more).
    """

    stopping = False

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            StopRequest.stopping = False  # an abort: no checkpoint, no message of the loop's
            raise KeyboardInterrupt
        self.requested = True
        StopRequest.stopping = True
        print("\nstopping after this step (press Ctrl-C again to abort without a checkpoint)", flush=True)

    def __enter__(self) -> StopRequest:
        self.requested = False
        StopRequest.stopping = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if exc_type is None:  # the loop ended without stopping: a later Ctrl-C is not its stop
            StopRequest.stopping = False


class PhaseTimer:
    """Wall-clock seconds per phase of a step: ``lap(name)`` adds the time since the previous lap to ``name``,
    one of the ``names`` the timer was made with (the trainer's: prune, rollout, reward, update, sync)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.start = self.last = time.perf_counter()
        self.names = tuple(names)
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        if name not in self.names:
            raise ValueError(f"phase {name!r}: this timer times {', '.join(self.names)}")
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now

    def record(self, less: dict[str, float] | None = None) -> dict[str, float]:
        """``time_<name>`` for every phase (0 for one not lapped), less the seconds ``less`` moves out of a
        phase (the update's packing, logged on its own), and ``step_time``, the seconds from the start to the
        last lap."""
        less = less or {}
        return {**{f"time_{n}": self.phases.get(n, 0.0) - less.get(n, 0.0) for n in self.names},
                "step_time": self.last - self.start}


class Run:
    """A run of ``config``: its device and processes, output directory, logs, checkpoints, evaluation schedule
    and Ctrl-C. Subclasses say what a step is (:meth:`train_step`) and what an evaluation is
    (:meth:`evaluate`).

    Args:
        config: the run's settings (``output_dir``, ``max_steps``, ``eval_steps``, ``save_steps``, ``seed``,
            ``device``, ``deterministic``, ``tensorboard``, ``log_groups``).
        callbacks: called with each step's metrics dict (and with ``{"event": "eval", ...}`` after each
            evaluation), e.g. to draw live curves in a notebook.
        progress: show a progress bar (on a terminal, on the main process).
    """

    # Set by the subclass: what a checkpoint holds beside run_state(), and the paths the run reads (which
    # ``overwrite`` must not move away).
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    model_path: str
    #: The file of a checkpoint that holds :meth:`run_state`.
    run_state_file: str = "run_state.json"
    #: What Ctrl-C's message says to do next (the bench sets its own).
    stop_hint: str = "continue with --resume"
    #: Whether Ctrl-C writes a checkpoint (the bench runs a stopped run again from its start: none for it).
    checkpoint_on_stop: bool = True

    def __init__(self, config: RunConfig, *, callbacks: Sequence[Callback] = (), progress: bool = True):
        self.config = config
        self.callbacks = list(callbacks)
        self.output_dir = Path(config.output_dir)
        if config.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if config.cpu_threads is not None:  # torch._C's: a vLLM CPU engine started in this process replaces
            torch._C.set_num_threads(config.cpu_threads)  # torch.set_num_threads with a no-op that only warns
        # data parallel when launched by torchrun / accelerate launch (WORLD_SIZE > 1): see
        # dppo_core.distributed
        self.dist = init_distributed(config.device)
        self.progress = progress and self.dist.is_main
        self.device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if config.device == "auto" else config.device))
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        torch.manual_seed(config.seed)
        self.step = 0
        self.last_groups: dict[str,
                               Any] | None = None  # the last step's groups.jsonl line (dppo_core.grouplog)
        self.tensorboard: SummaryWriter | None = None
        self.stop_request = StopRequest()  # Ctrl-C: finish the step, write a checkpoint, stop

    # --- what a subclass says -----------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One step: advance ``self.step`` and return its metrics line."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, Any]:
        """Evaluate the current policy (called on the main process only)."""
        raise NotImplementedError

    def run_state(self) -> dict[str, Any]:
        """What a checkpoint holds beside the weights, the optimizer, the step and the RNG: the subclass's own
        JSON-serialisable state (the trainer's: its estimator's prompt history), written to
        :attr:`run_state_file`."""
        raise NotImplementedError

    def check_run_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError if ``state``, as read from a checkpoint, cannot be restored (called before
        anything of the checkpoint is applied, so that a damaged one changes nothing)."""

    def load_run_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`run_state` returned (called after the weights and the optimizer)."""
        raise NotImplementedError

    def start(self) -> None:
        """Called once the output directory is ready (and a checkpoint loaded), before the first
        evaluation."""

    # --- logs ---------------------------------------------------------------------------------------
    def log(self, record: dict[str, Any], filename: str = "metrics.jsonl") -> None:
        """Append ``record`` to ``filename`` in the output dir, to TensorBoard (its numbers) and to the
        callbacks (data parallel: the main process logs for the job)."""
        if not self.dist.is_main:
            return
        disk.append_jsonl(self.output_dir / filename, record)
        if self.tensorboard is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tensorboard.add_scalar(("eval/" if filename != "metrics.jsonl" else "train/") + k, v,
                                                record.get("step", self.step))
        for cb in self.callbacks:
            cb(record)

    def evaluate_and_log(self) -> dict[str, Any]:
        """Evaluate on the main process and log it (other processes wait at a barrier and get ``{}``)."""
        result: dict[str, Any] = {}
        if self.dist.is_main:
            result = self.evaluate()
            self.log({"event": "eval", **result}, "eval.jsonl")
        barrier(self.dist)
        return result

    # --- checkpoints --------------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """The complete checkpoints in the output dir, oldest first."""
        return disk.list_checkpoints(self.output_dir)

    def save_checkpoint(self, keep: int = 2) -> Path:
        """Write model/adapter, optimizer, :meth:`run_state` and step to ``checkpoint-<step>`` atomically."""
        state = {"config": self.config.to_dict(), "model_path": self.model_path}
        return disk.save_checkpoint(self.output_dir, self.step, self.model, self.tokenizer, self.optimizer,
                                    state, self.run_state(), self.run_state_file, keep=keep)

    def load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint; everything is read and checked first, so a damaged one changes nothing."""
        found = disk.read_checkpoint(path, self.run_state_file, self.check_run_state)
        disk.load_weights(self.model, found.weights, self.config.update_mode, path)
        self.optimizer.load_state_dict(found.optimizer_state)
        if found.run_state is not None:
            self.load_run_state(found.run_state)
        torch.set_rng_state(torch.tensor(found.torch_rng, dtype=torch.uint8))
        self.step = found.step
        # a run killed while writing or deleting a checkpoint left these: not checkpoints
        if self.dist.is_main:
            disk.remove_stale_temp_dirs(self.output_dir)

    def save_checkpoint_all_ranks(self) -> Path:
        """The main process writes the checkpoint (the weights are the same on every rank); the others
        wait."""
        path = (self.save_checkpoint() if self.dist.is_main
                else self.output_dir / f"{disk.CHECKPOINT_PREFIX}{self.step}")
        barrier(self.dist)
        return path

    # --- the run's life -----------------------------------------------------------------------------
    def prepare_output(self, resume: bool, overwrite: bool = False) -> None:
        """Resume from the last checkpoint, or start where no run is (or was moved aside); write
        config.json."""
        main = self.dist.is_main  # data parallel: rank 0 writes every file; all ranks load a checkpoint
        found = disk.run_files(self.output_dir)  # every rank decides alike, before rank 0 changes anything
        disk.check_output_dir(self.output_dir)
        move = disk.must_move_aside(self.output_dir, found, resume=resume, overwrite=overwrite,
                                    reads=[self.model_path])
        if resume and found and not self.checkpoints():  # nothing to continue from
            if "final" in found:
                raise RunExistsError(f"output_dir={str(self.output_dir)!r} holds a finished run without "
                                     "checkpoints: nothing to --resume; pass --overwrite or another "
                                     "--output-dir")
            # an attempt stopped before its first checkpoint: kept beside, and run again from step 0
            move = True
        barrier(self.dist)
        if main and move:
            moved = disk.move_aside(self.output_dir)
            print(f"the earlier run in {self.output_dir} was moved to {moved}", flush=True)
        barrier(self.dist)
        if resume and self.checkpoints():
            self.load_checkpoint(self.checkpoints()[-1])
            if main:
                disk.truncate_logs(self.output_dir, self.step, final=self.step >= self.config.max_steps)
        barrier(self.dist)
        if main:
            (self.output_dir / "config.json").write_text(self.config.to_json())
        if self.config.tensorboard and main:
            from torch.utils.tensorboard import SummaryWriter

            # on resume, drop the events of steps that will be run again
            self.tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"),
                                             purge_step=self.step + 1 if self.step else None)

    def train(self, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
        """Run until ``max_steps``.

        ``output_dir`` must hold no run, unless ``resume`` (continue from its last checkpoint) or
        ``overwrite`` (the earlier run is moved to ``<output_dir>.previous-<n>`` first, nothing deleted);
        otherwise :class:`~dppo_core.run.RunExistsError`, with nothing changed.

        Ctrl-C (or SIGTERM) finishes the current step, writes a checkpoint of it and raises
        ``KeyboardInterrupt``; ``train(resume=True)`` continues from there. A second Ctrl-C stops at once,
        without a checkpoint (the last one written stays valid).
        """
        from tqdm.auto import tqdm

        c = self.config
        self.prepare_output(resume, overwrite)
        self.start()
        if self.step == 0:
            self.evaluate_and_log()
        bar = tqdm(total=c.max_steps, initial=self.step, desc="train",
                   disable=None if self.progress else True)  # None: on a terminal only
        last: dict[str, Any] = {}
        with self.stop_request:
            while self.step < c.max_steps:
                self.last_groups = None
                last = self.train_step()
                self.log(last)
                if c.log_groups and self.last_groups is not None and self.dist.is_main:
                    disk.append_jsonl(self.output_dir / GROUP_LOG, self.last_groups)
                bar.update(1)
                reward = last.get("reward_mean")
                bar.set_postfix(reward="skipped" if reward is None else f"{reward:.3f}",
                                step_s=f"{last.get('step_time', 0.0):.2f}")
                # evaluate before checkpointing: a crash in between loses neither (resume redoes both)
                if c.eval_steps and self.step % c.eval_steps == 0 and self.step < c.max_steps:
                    self.evaluate_and_log()
                if c.save_steps and self.step % c.save_steps == 0:
                    self.save_checkpoint_all_ranks()
                # data parallel: a stop asked of any rank (torchrun forwards signals to each) stops them all
                if all_reduce_max(float(self.stop_request.requested), self.dist) > 0:
                    bar.close()
                    path = self.save_checkpoint_all_ranks() if self.checkpoint_on_stop else None
                    if self.dist.is_main:
                        print("\nstopped at step "
                              f"{self.step}{f': checkpoint written to {path}' if path else ''}; "
                              f"{self.stop_hint}")
                    raise KeyboardInterrupt
        bar.close()
        self.save_checkpoint_all_ranks()
        final = self.evaluate_and_log()
        if self.dist.is_main:
            disk.save_final(self.output_dir, self.model, self.tokenizer)
        if self.tensorboard is not None:
            self.tensorboard.close()
        barrier(self.dist)
        return {"step": self.step, "last": last, "eval": final}
