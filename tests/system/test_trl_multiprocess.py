"""DPPOGRPOTrainer under ``accelerate launch`` with two CPU processes (gloo) against one process.

The update of a 2-process run must equal the single-process update on the same global batch: every process
gathers the generation batch's prompts, follows the main process's pruning draws, trains on its share of the
kept rows, and the processes' gradients average to the one-process gradient. tests/helpers/trl_worker.py runs the
cases (its docstring says how the runs see the same completions); each launch pays for importing TRL in every
process (~5-10 s on a 2-core CPU).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "trl_worker.py"
# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (the integer split of kept rows) cannot.
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch build has no torch.distributed")


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [1, 2, 3, 4, 6, 8])
def test_padding_groups_split_the_kept_rows_evenly(processes, group_size):
    pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'dppo-core[bench]'")
    from dppo_core.integrations.trl import padding_groups

    for kept in range(0, 10):
        pad = padding_groups(kept, group_size, processes)
        assert (kept + pad) * group_size % processes == 0
        assert all((kept + fewer) * group_size % processes for fewer in range(pad))  # the fewest copies
        if group_size % processes == 0:
            assert pad == 0  # e.g. G = 8 on 2, 4 or 8 processes: never a copy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")


def _launch(tmp: Path, model: Path, out: Path, cases: list[str], fsdp: bool = False) -> None:
    """``accelerate launch`` with two processes, from a config file of its own (not the user's default one)."""
    config = tmp / ("fsdp.yaml" if fsdp else "ddp.yaml")
    # MULTI_GPU starts the processes through torchrun; the worker trains on CPU (use_cpu=True), so over gloo
    kind = "FSDP\nfsdp_config:\n  fsdp_version: 2" if fsdp else "MULTI_GPU"
    config.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: {kind}\nnum_machines: 1\n"
                      "num_processes: 2\nmixed_precision: 'no'\nuse_cpu: false\n")
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
          "--main_process_port", str(_free_port()), str(WORKER), "--model", str(model), "--out", str(out),
          "--cases", *cases], tmp)


@pytest.fixture(scope="module")
def one_process(small_model_dir, tmp_path_factory) -> Path:
    pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'dppo-core[bench]'")
    out = tmp_path_factory.mktemp("trl-one")
    _run([sys.executable, str(WORKER), "--model", str(small_model_dir), "--out", str(out)], out)
    return out


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def assert_same_run(one: Path, many: Path, case: str, one_case: str | None = None) -> list[dict[str, Any]]:
    """The ranks of ``many`` agree to the bit and with ``one`` (its ``one_case``, default the same case) to float
    tolerance; returns the ranks' results."""
    ref = _load(one / f"{one_case or case}-rank0.pt")
    ranks = [_load(many / f"{case}-rank{r}.pt") for r in (0, 1)]
    moved = max(float((ref["params"][k] - ref["start"][k]).abs().max()) for k in ref["params"])
    assert moved > 1e-3, "the steps did not move the parameters"
    # SGD without clipping: the update is lr times the gradient, so this compares gradients. Float32 sums in
    # another order (each process sums its rows, then the processes' sums are averaged) differ by ~1e-6 of
    # the movement (measured: 0 to 8e-7); 1e-5 of it leaves room and still fails for one row's weight wrong.
    atol = 1e-5 * moved
    for k, value in ref["params"].items():
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), f"{case} {k}: the two processes diverged"
        torch.testing.assert_close(ranks[0]["params"][k] - ref["start"][k], value - ref["start"][k], rtol=0,
                                   atol=atol, msg=lambda m, k=k: f"{case} {k}: 2 processes != 1 process: {m}")
    for r in ranks:
        assert r["history"] == ref["history"]
        assert r["estimator_step"] == ref["estimator_step"] == ref["generation_batches"]
    # (the KL and entropy logged are means over micro-batches, which hold other rows on 2 processes: not compared)
    logged = ("loss", "grad_norm", "dppo/prompts_kept", "dppo/completions_kept")
    steps = [row for row in ref["log"] if "loss" in row]
    assert len(steps) == ref["steps"]
    for a, b in zip(steps, [row for row in ranks[0]["log"] if "loss" in row], strict=True):
        for key in logged:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert sum(r["trained"]["rows"] for r in ranks) == ref["trained"]["rows"]  # every kept row, on one process
    return ranks


@pytest.mark.numerics
def test_two_processes_update_like_one(one_process, small_model_dir, tmp_path):
    two = tmp_path / "two"
    _launch(tmp_path, small_model_dir, two, ["dppo-kl", "odd-group-lora"])

    # prompt and completion pruning (step 2 prunes prompts), KL term, groups across the two processes
    ranks = assert_same_run(one_process, two, "dppo-kl")
    steps = [row for row in _load(one_process / "dppo-kl-rank0.pt")["log"] if "loss" in row]
    assert steps[1]["dppo/prompts_kept"] < 1 and all(row["dppo/completions_kept"] < 1 for row in steps)
    assert sum(r["trained"]["padding"] for r in ranks) > 0  # a process had fewer kept rows: padded, weight 0

    # one G=3 group kept: process 1 rolls out a copy of it, dropped after the rewards (LoRA parameters only)
    ranks = assert_same_run(one_process, two, "odd-group-lora")
    assert ranks[1]["trained"]["rows"] == 0 and ranks[1]["trained"]["padding"] > 0
    assert all("lora" in k for k in ranks[0]["params"])


@pytest.mark.numerics
def test_empty_generation_batches_keep_the_processes_in_step(one_process, small_model_dir, tmp_path):
    """steps_per_generation below the gradient accumulation: a window of several generation batches, some of which
    keep nothing on any process (every prompt pruned, or every completion), first, in the middle and last in their
    window. Each process still runs the model on a weight-0 row, so the gradients are reduced when the window ends:
    without it each process steps on its own gradient and they drift apart (the first assertion of
    assert_same_run). The last case also has micro-batches that mix kept and padding rows, and a KL term."""
    two = tmp_path / "two"
    cases = ["empty-prompts", "empty-completions", "empty-completions-dppo"]
    _launch(tmp_path, small_model_dir, two, [*cases, "mutant-no-filler-when-empty"])
    for case in cases:
        ranks = assert_same_run(one_process, two, case)
        assert sum(r["trained"]["padding"] for r in ranks) > 0, case
    # the negative control: without the weight-0 rows of the empty batches, the processes drift apart
    with pytest.raises(AssertionError, match="the two processes diverged"):
        assert_same_run(one_process, two, "mutant-no-filler-when-empty", "empty-completions")
    steps = [row for row in _load(one_process / "empty-prompts-rank0.pt")["log"] if "loss" in row]
    assert [row["dppo/prompts_kept"] for row in steps] == pytest.approx([2 / 3] * 3)  # one batch of 3 empty a step
    steps = [row for row in _load(one_process / "empty-completions-dppo-rank0.pt")["log"] if "loss" in row]
    assert all(row["dppo/completions_kept"] < 1 for row in steps)


@pytest.mark.numerics
@pytest.mark.slow
def test_fsdp2_processes_update_like_one(one_process, small_model_dir, tmp_path):
    """FSDP2 (parameters sharded over the two CPU processes). Without a reference model: under FSDP on CPU,
    TRL's own GRPOTrainer starts with a reference model whose log-probs differ from the policy's (KL > 0 at
    step 1, with or without pruning), so beta > 0 is not compared here."""
    pytest.importorskip("torch.distributed.fsdp", reason="this torch build has no FSDP")
    if not hasattr(torch.distributed.fsdp, "fully_shard"):
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    fsdp = tmp_path / "fsdp"
    _launch(tmp_path, small_model_dir, fsdp, ["dppo"], fsdp=True)
    assert_same_run(one_process, fsdp, "dppo")
