"""Data-parallel training (torch.distributed, gloo, two CPU processes) against one process.

The update of a 2-rank job must equal the single-process update on the same global batch: the ranks
split the kept prompts, gather rewards, draw the same pruning decisions and sum their gradients.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dppo_core.distributed import DistInfo, all_gather_objects, all_reduce_gradients, shard
from dppo_core.models import load_model

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "ddp_worker.py"
# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (shards, one-process no-ops, the docs' recipe that prints) cannot.
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch build has no torch.distributed")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_cover_each_item_once_in_order(world):
    for n in range(0, 13):
        parts = [shard(n, DistInfo(rank=r, world_size=world)) for r in range(world)]
        assert [i for p in parts for i in p] == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_helpers_are_no_ops_in_one_process():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    all_reduce_gradients([p], DistInfo())
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    assert all_gather_objects({"a": 1}, DistInfo()) == [{"a": 1}]


def test_the_framework_recipe_in_the_docs_runs(capsys):
    """docs/scaling.md shows how a Ray-based framework calls the pruning and packing: that code must run."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    exec(compile(code, "docs/scaling.md", "exec"), {})
    assert "prompts rolled out" in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")
    return proc.stdout + proc.stderr


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}"]


SETTINGS = {
    "grpo": {},
    # prompt + completion pruning (fixed-size draws), packing, KL and two PPO epochs: every cross-rank path
    "dppo-packed": dict(pruning="dppo", prompt_prune_rate=0.5, completion_prune_rate=0.5, min_prompt_keep_prob=0.3,
                        dense_prompts=True, fixed_size_sampling=True, packing=True, max_tokens_per_row=64,
                        beta=0.04, num_iterations=2),
    # pilot, then continue: the continue draw over every rank's pilots, each rank's rest, the joined groups
    "dppo-pilot": dict(pruning="dppo", prompt_prune_rate=0.5, completion_prune_rate=0.5, min_prompt_keep_prob=0.3,
                       dense_prompts=True, pilot_size=2, continue_probability=0.4, continue_scheme="posterior"),
    # the fitted prompt rule (a prior fitted to the pool's history on every rank) with a pilot, and rank 1 drawing
    # from other streams than rank 0 (--other-draws-on-rank-1): the job equals one process only because every draw
    # (selection, continue, completions) is rank 0's, broadcast
    "dppo-fitted-rank0-draws": dict(pruning="dppo", prompt_prune_rate=0.5, prompt_scheme="fitted",
                                    completion_prune_rate=0.5, min_prompt_keep_prob=0.2, dense_prompts=True,
                                    pilot_size=2, continue_probability=0.4, continue_scheme="posterior"),
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(SETTINGS))
def test_two_gloo_ranks_update_like_one_process(small_model_dir, tmp_path, name):
    # level 1 has 79 training prompts, so prompts recur within a few steps and prompt pruning acts
    config = dict(model=str(small_model_dir), output_dir=str(tmp_path / "run"), prompts_per_step=6,
                  num_generations=4, max_completion_length=12, max_steps=4, train_levels=[1],
                  learning_rate=1e-3, deterministic=True, rollout_engine="hf", micro_batch_size=5,
                  **SETTINGS[name])
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    rollouts = tmp_path / "rollouts.pkl"
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, str(WORKER), "--config", str(cfg), "--rollouts", str(rollouts), "--record",
          "--out", str(one)], tmp_path)
    other = ["--other-draws-on-rank-1"] if name.endswith("rank0-draws") else []
    _run(_torchrun(2) + [str(WORKER), "--config", str(cfg), "--rollouts", str(rollouts), "--out", str(two), *other],
         tmp_path)

    start = dict(load_model(small_model_dir)[0].named_parameters())
    ref = torch.load(one / "weights-rank0.pt")
    ranks = [torch.load(two / f"weights-rank{r}.pt") for r in (0, 1)]
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    # Adam divides by sqrt(v): gradients that differ in the last bits (summed in another order) move a
    # weight by up to ~1e-5 of lr over these steps, so the tolerance is 1% of the largest movement
    atol = 0.01 * moved
    for k in ref:
        assert torch.equal(ranks[0][k], ranks[1][k]), f"{k}: the two ranks diverged"
        torch.testing.assert_close(ranks[0][k] - start[k], ref[k] - start[k], rtol=0, atol=atol,
                                   msg=lambda m, k=k: f"{k}: the 2-rank update differs from 1 process: {m}")

    m1 = json.loads((one / "metrics-rank0.json").read_text())
    m2 = json.loads((two / "metrics-rank0.json").read_text())
    exact = ("prompts_candidates", "prompts_rolled_out", "reward_mean", "tokens_generated", "tokens_trained",
             "sequences_trained", "completions_rolled_out", "tokens_saved_update", "pilot_groups_stopped",
             "pilot_tokens", "decode_steps")
    # (the micro-batch layout, update_rows / update_capacity, is each rank's own: not compared)
    for a, b in zip(m1, m2, strict=True):
        assert {k: a.get(k) for k in exact} == {k: b.get(k) for k in exact}
        for k in ("loss", "kl", "grad_norm", "weight_ess", "clip_fraction"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
    assert sum(r["grad_norm"] for r in m1) > 0
    if name == "dppo-packed":  # pruning acted: fewer prompts rolled out than candidates, fewer sequences trained
        assert sum(r["prompts_rolled_out"] for r in m1) < sum(r["prompts_candidates"] for r in m1)
    if name != "grpo":
        assert sum(r["sequences_trained"] for r in m1) < sum(r["completions_rolled_out"] for r in m1)
    if name == "dppo-pilot":  # the continue draw stopped some groups after their pilot
        assert sum(r["pilot_groups_stopped"] for r in m1) > 0
    hist = [(d / f"history-rank{r}.json").read_text() for d, r in ((one, 0), (two, 0), (two, 1))]
    assert hist[0] == hist[1] == hist[2], "prompt history differs between ranks or from one process"


@pytest.mark.numerics
def test_torchrun_cli_logs_once_checkpoints_and_resumes(small_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["-m", "dppo_core.tools.cli", "train", "--output-dir", str(out), f"model={small_model_dir}",
            "prompts_per_step=4", "num_generations=4", "max_completion_length=12", "train_levels=[2,3]",
            "eval_problems_per_level=3", "eval_samples=1", "save_steps=1", "rollout_engine=hf",
            "pruning=dppo", "completion_prune_rate=0.5", "packing=true"]
    text = _run(_torchrun(2) + args + ["--max-steps", "2"], tmp_path)
    assert "2 data-parallel ranks" in text
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], "rank 0 alone writes the log"
    assert [json.loads(x)["step"] for x in (out / "eval.jsonl").read_text().splitlines()] == [0, 2]
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and (out / "final").is_dir()
    _run(_torchrun(2) + args + ["--max-steps", "3", "--resume"], tmp_path)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
