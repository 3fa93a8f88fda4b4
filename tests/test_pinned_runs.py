"""Behaviour pinned: fixed-seed runs of the embedded tiny model reproduce per-step metrics recorded earlier.

The records in ``tests/data/pinned_runs.json`` were made by the trainer *before* the estimator was moved
out of it into :mod:`dppo_core.estimator` (commit 88d8b43), so a refactor that changes what is selected,
kept, weighted or trained shows here as a changed number. Re-record only for a change of behaviour that is
intended, and say why in the commit:

    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python tests/test_pinned_runs.py --record [NAME ...]

(with names, only those runs are recorded and the others kept). ``tiny-dppo`` (the variance-aware default) was
added with those schemes; the others are the earlier records (the first named ``tiny-dppo`` then, now
``dppo-paper``: the same configuration, stated).

The warm start and every step depend on the CPU's floating-point kernels (see the Makefile), so the test
runs only where the kernels are those the records were made with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

RECORDS = Path(__file__).parent / "data" / "pinned_runs.json"
#: Each run: a preset and the overrides that make it small (8 prompts x 8 completions, 4 steps, a pool of 16
#: prompts so they recur and prompt pruning has history to act on) and cover one path of the estimator.
#: The DPPO paper's configuration, made unbiased: what tiny-dppo was when its two runs were recorded (its
#: variance-aware schemes came later; they have their own record).
PAPER = {"prompt_scheme": "paper", "dense_prompts": False, "completion_scheme": "proportional",
         "fixed_size_design": "systematic"}
RUNS: dict[str, tuple[str, dict]] = {
    "dppo-paper": ("tiny-dppo", PAPER),
    "dppo-dense-packed-beta0": ("tiny-dppo", {**PAPER, "beta": 0.0, "dense_prompts": True, "packing": True,
                                              "max_tokens_per_row": 128, "fixed_size_sampling": False,
                                              "prompt_scheme": "proportional"}),
    "tiny-dppo": ("tiny-dppo", {}),  # the variance-aware default: posterior, dense, length-aware, sorted
    "cppo": ("tiny-grpo", {"pruning": "cppo", "completion_prune_rate": 0.5}),
    "greso": ("tiny-grpo", {"pruning": "greso", "prompt_prune_rate": 0.5, "beta": 0.0}),
}
SMALL = {"prompts_per_step": 8, "max_steps": 4, "train_pool_size": 16, "save_steps": 0,
         "eval_problems_per_level": 3, "eval_samples": 1, "device": "cpu"}
UNPINNED = ("time_", "step_time")  # wall-clock times differ from run to run


def kernels() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def run(name: str, output_dir: Path) -> list[dict]:
    from dppo_core.config import preset
    from dppo_core.trainer import DPPOTrainer

    base, overrides = RUNS[name]
    config = preset(base).with_overrides({**SMALL, **overrides, "output_dir": str(output_dir)})
    DPPOTrainer(config, progress=False).train()
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(UNPINNED)} for r in rows]


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b))
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_run_reproduces_pinned_metrics(name, tmp_path):
    recorded = json.loads(RECORDS.read_text())
    if kernels() != recorded["kernels"]:
        pytest.skip(f"records made with {recorded['kernels']} kernels, this CPU runs {kernels()}: the warm start "
                    "differs in the last bits; run under the Makefile's settings on an x86-64 CPU with AVX2")
    got = run(name, tmp_path)
    want = recorded["runs"][name]
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert sorted(g) == sorted(w), f"step {step}: metric names differ: {sorted(set(g) ^ set(w))}"
        differ = {k: (g[k], w[k]) for k in w if not _close(g[k], w[k])}
        assert not differ, f"{name} step {step}: (now, recorded) {differ}"


if __name__ == "__main__" and "--record" in sys.argv:
    # --record: every run; --record NAME ...: only those, the other records kept (same kernels only)
    import tempfile

    names = sys.argv[sys.argv.index("--record") + 1:] or list(RUNS)
    unknown = set(names) - set(RUNS)
    if unknown:
        sys.exit(f"unknown runs {sorted(unknown)}; choose from {list(RUNS)}")
    old = json.loads(RECORDS.read_text()) if RECORDS.exists() else {"kernels": kernels(), "runs": {}}
    if names != list(RUNS) and old["kernels"] != kernels():
        sys.exit(f"the records were made with {old['kernels']} kernels, this CPU runs {kernels()}: record every run")
    with tempfile.TemporaryDirectory() as tmp:
        new = {name: run(name, Path(tmp) / name) for name in names}
    runs = {name: new.get(name, old["runs"].get(name)) for name in RUNS}
    RECORDS.parent.mkdir(exist_ok=True)
    RECORDS.write_text(json.dumps({"kernels": kernels(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {RECORDS}")
