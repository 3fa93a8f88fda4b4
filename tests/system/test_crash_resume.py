"""Crash safety: a run killed with SIGKILL at random moments, and resumed each time, ends equal to a run
that was never interrupted; no kill leaves a half-written checkpoint.

Training goes through the real CLI (``python -m dppo_core.tools.cli train ... --resume``) in subprocesses, in
deterministic CPU mode, on a small model warm-started on one-digit sums (so rewards have signal and the
weights change) and a jsonl task of 8 such problems (so prompts come back and DPPO's prompt pruning reads
the prompt history that checkpoints carry), with completion pruning and packing on. The kill moments come
from a seeded RNG and are placed by polling the output directory (a checkpoint appearing, the temp dir of
a checkpoint being written or deleted), never by sleeping blind; nothing asserts on timing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import warm_small_model
from safetensors.torch import load_file

from dppo_core.pruning import PromptHistory

MAX_STEPS = 10
KILLS = 3
SEED = 9  # the kill plan's RNG
WAIT_S = 600  # for a run to reach a kill point or to finish, on a slow loaded machine
TIME_KEYS = ("step_time",)  # plus every key starting with "time"


def _task_file(path: Path) -> Path:
    from dppo_core.tasks import ArithmeticTask

    rows = [{"id": p.id, "problem": p.prompt, "answer": str(p.answer)} for p in ArithmeticTask((1,)).train(1)[:8]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _command(out: Path, model: Path, task: Path) -> list[str]:
    overrides = {
        "model": model, "task": task, "prompts_per_step": 4, "num_generations": 4, "max_completion_length": 12,
        "learning_rate": 1e-3, "pruning": "dppo", "prompt_prune_rate": 0.5, "completion_prune_rate": 0.5,
        "packing": "true", "max_tokens_per_row": 128, "packing_rows_per_micro_batch": 2, "save_steps": 1,
        "eval_steps": 0, "rollout_engine": "hf", "device": "cpu", "deterministic": "true", "tensorboard": "false",
    }
    return [sys.executable, "-m", "dppo_core.tools.cli", "train", "--preset", "tiny-dppo", "--output-dir", str(out),
            "--max-steps", str(MAX_STEPS), *(f"{k}={v}" for k, v in overrides.items())]


def _env() -> dict[str, str]:
    # one thread per run: the reference run goes on beside the interrupted one without oversubscribing
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env())


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(d.name.split("-")[1]) for d in out.glob("checkpoint-*"))


def _newest(out: Path) -> int:
    return max(_checkpoint_steps(out), default=0)


def _temp_dirs(out: Path) -> set[str]:
    return {d.name for d in out.glob(".tmp-checkpoint-*")}


def _last_step_time(out: Path) -> float:
    """The latest step's duration from metrics.jsonl (a cut-off last line is skipped)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0.2
    for line in reversed(lines):
        try:
            return float(json.loads(line)["step_time"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0.2


def _assert_complete_checkpoints(out: Path, context: str) -> None:
    """Every checkpoint-N is whole and loadable: trainer_state.json, optimizer.pt, weights, prompt history."""
    for step in _checkpoint_steps(out):
        d = out / f"checkpoint-{step}"
        state = json.loads((d / "trainer_state.json").read_text())
        assert state["step"] == step, context
        assert {"state", "param_groups"} <= set(torch.load(d / "optimizer.pt", weights_only=True)), context
        weights = [load_file(f) for f in (d / "model").glob("*.safetensors")]
        assert weights and all(weights), f"{d}: no weights; {context}"
        assert (d / "model" / "config.json").is_file(), f"{d}: no model config; {context}"
        PromptHistory.from_state_dict(json.loads((d / "prompt_history.json").read_text()))


def _assert_logs_parse(out: Path, context: str) -> None:
    """Log lines are whole JSON records; only the last one may be cut off by the kill."""
    for name in ("metrics.jsonl", "eval.jsonl", "groups.jsonl"):
        f = out / name
        lines = f.read_text().splitlines() if f.exists() else []
        for i, line in enumerate(lines[:-1]):
            try:
                json.loads(line)
            except ValueError as exc:
                raise AssertionError(f"{name}:{i + 1} is not whole ({exc}): {line!r}; {context}") from exc


def _run_and_kill(cmd: list[str], out: Path, log: Path, mode: str, target: int, rng: random.Random) -> dict:
    """Start a run, wait for its kill point, SIGKILL it; returns what the output dir looked like then.

    ``step``: once checkpoint-``target`` exists, wait a random share of a step, then kill (mid-rollout,
    mid-update, mid-log or mid-save: wherever that lands). ``checkpoint``: once checkpoint-``target - 1``
    exists (if the run is to write it), poll tightly for the next checkpoint activity (a new
    ``.tmp-checkpoint-*`` dir: a checkpoint being written, or an old one being deleted; or
    checkpoint-``target`` itself) and kill at once.
    """
    newest_before = _newest(out)
    proc = _start(cmd, log)
    deadline = time.monotonic() + WAIT_S
    seen_tmp: set[str] = set()

    def alive_or_fail() -> None:
        rc = proc.poll()
        assert rc is None, f"the run ended (exit {rc}) before its kill point ({mode} at {target}):\n{_tail(log)}"
        assert time.monotonic() < deadline, f"no kill point ({mode} at {target}) after {WAIT_S} s:\n{_tail(log)}"

    try:
        if mode == "step":
            while _newest(out) < target:
                alive_or_fail()
                time.sleep(0.01)
            end = time.monotonic() + rng.random() * _last_step_time(out)
            while time.monotonic() < end and _newest(out) <= target:
                alive_or_fail()
                time.sleep(0.002)
        else:
            if target - 1 > newest_before:
                while _newest(out) < target - 1:
                    alive_or_fail()
                    time.sleep(0.005)
            start_tmp = _temp_dirs(out)
            while True:
                seen_tmp = _temp_dirs(out) - start_tmp
                if seen_tmp or _newest(out) >= target:
                    break
                alive_or_fail()
                time.sleep(0.0005)
        alive_or_fail()
        proc.kill()  # SIGKILL: no handler, no cleanup
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    return {"mode": mode, "target": target, "checkpoints": _checkpoint_steps(out),
            "temp_dir_seen_at_kill": bool(seen_tmp), "temp_dirs_left": sorted(_temp_dirs(out)),
            "metrics_lines": len((out / "metrics.jsonl").read_text().splitlines())
            if (out / "metrics.jsonl").exists() else 0}


def _without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time") and k not in TIME_KEYS} for r in rows]


def test_sigkilled_and_resumed_run_equals_uninterrupted(cache_dir, tmp_path):
    model = warm_small_model(cache_dir)
    task = _task_file(tmp_path / "task.jsonl")
    ref_out, out = tmp_path / "uninterrupted", tmp_path / "killed"
    cmd = _command(out, model, task)
    # the uninterrupted run goes on beside the interrupted ones (a second core; it is only compared at the end)
    ref = _start(_command(ref_out, model, task), tmp_path / "uninterrupted.log")
    try:
        # the plan: at least one kill at a checkpoint write and one at a random point of a step, in a random
        # order; kill i aims at a random step of the i-th third of the run (after what the run has saved)
        rng = random.Random(SEED)
        modes = ["checkpoint", "step"] + [rng.choice(["step", "checkpoint"]) for _ in range(KILLS - 2)]
        rng.shuffle(modes)
        bounds = [1 + round(i * (MAX_STEPS - 2) / KILLS) for i in range(KILLS + 1)]  # 1, 4, 6, 9 for 10 steps
        kills = []
        for i, mode in enumerate(modes):
            newest = _newest(out)
            target = max(rng.randrange(bounds[i], bounds[i + 1]), newest + 1)
            assert target <= MAX_STEPS - 2, kills  # the run must not finish before its kill point
            log = tmp_path / f"attempt-{i}.log"
            kills.append(_run_and_kill(cmd + (["--resume"] if i else []), out, log, mode, target, rng))
            context = f"after kill {i + 1}: {kills}\n{_tail(log)}"
            _assert_complete_checkpoints(out, context)
            _assert_logs_parse(out, context)
        print("kills:", *kills, sep="\n  ")
        # what a kill can leave and the random ones may have missed: a log line cut off mid-write (in both
        # logs) and the temp dir of a checkpoint being written; --resume must drop both
        for name in ("metrics.jsonl", "eval.jsonl", "groups.jsonl"):
            with open(out / name, "a") as f:
                f.write('{"step": 3, "reward_mean": 0.')
        partial = out / ".tmp-checkpoint-killed" / "model"
        partial.mkdir(parents=True)
        (partial / "model.safetensors").write_bytes(b"\0" * 100)

        log = tmp_path / "final.log"
        with open(log, "wb") as f:
            rc = subprocess.run(cmd + ["--resume"], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_env(), timeout=WAIT_S).returncode
        assert rc == 0, f"the last resume failed after kills {kills}:\n{_tail(log)}"
        assert ref.wait(timeout=WAIT_S) == 0, _tail(tmp_path / "uninterrupted.log")
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait()

    # the logs: every step once, in order, equal to the uninterrupted run's but for timings
    rows, ref_rows = _lines(out / "metrics.jsonl"), _lines(ref_out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), kills
    assert _without_times(rows) == _without_times(ref_rows), kills
    assert _without_times(_lines(out / "eval.jsonl")) == _without_times(_lines(ref_out / "eval.jsonl"))
    assert _lines(out / "groups.jsonl") == _lines(ref_out / "groups.jsonl"), kills  # every step's groups once
    # the run exercised what it is meant to: pruned prompts (so the prompt history mattered), packed updates
    assert any(r["prompts_rolled_out"] < r["prompts_candidates"] for r in rows)
    assert any(r["sequences_trained"] > 0 and r["update_rows"] > 0 for r in rows)

    # the weights: final model and the last checkpoint (weights, optimizer, prompt history) are equal
    final = load_file(out / "final" / "model.safetensors")
    ref_final = load_file(ref_out / "final" / "model.safetensors")
    assert final.keys() == ref_final.keys()
    for name, tensor in ref_final.items():
        assert torch.equal(final[name], tensor), name
    initial = load_file(model / "model.safetensors")
    assert any(not torch.equal(initial[n], t) for n, t in final.items() if n in initial), "training changed nothing"
    assert _checkpoint_steps(out) == _checkpoint_steps(ref_out) == [MAX_STEPS - 1, MAX_STEPS]
    last, ref_last = out / f"checkpoint-{MAX_STEPS}", ref_out / f"checkpoint-{MAX_STEPS}"
    assert json.loads((last / "prompt_history.json").read_text()) == json.loads(
        (ref_last / "prompt_history.json").read_text())
    opt, ref_opt = (torch.load(d / "optimizer.pt", weights_only=True)["state"] for d in (last, ref_last))
    assert opt.keys() == ref_opt.keys()
    for k in ref_opt:
        for name, value in ref_opt[k].items():
            assert torch.equal(opt[k][name], value), (k, name)
    _assert_complete_checkpoints(out, "after the last resume")
    assert not list(out.glob(".tmp-*")), "temp dirs left after the resumed run finished"
