"""The measurements behind `make test`'s two workers (docs/testing.md, "What made `make test` shorter").

    python benchmarks/suite_probes.py threads   # 60 warm-start steps: alone, and two side by side three ways
    python benchmarks/suite_probes.py mkl       # which MKL settings change a matrix product's bits on this CPU
    python benchmarks/suite_probes.py prefix    # what the warm start's first 50 steps see of a changed recipe

Run under the Makefile's pins (ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2), nothing else
running. Results: benchmarks/results/suite_probes/<probe>.json. The prefix probe under the second kernel setting too:

    ATEN_CPU_CAPABILITY=avx512 MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 python benchmarks/suite_probes.py prefix \
        --output benchmarks/results/suite_probes/prefix-second-setting.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "suite_probes"
PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# One warm-start build of `steps` steps into a temporary cache, with `threads` PyTorch threads; prints its seconds.
WARM = """
import sys, tempfile, time, torch
torch.set_num_threads(int(sys.argv[1]))
from dppo_core.warm_start import WarmStartConfig, warm_start
t = time.perf_counter()
warm_start(WarmStartConfig(steps=int(sys.argv[2])), cache_dir=tempfile.mkdtemp(), force=True, progress=False)
print(time.perf_counter() - t)
"""

# A 300 x 300 float32 matrix product's bytes, hashed.
MATMUL = """
import hashlib, torch
a = torch.randn(300, 300, generator=torch.Generator().manual_seed(0))
b = torch.randn(300, 300, generator=torch.Generator().manual_seed(1))
print(hashlib.sha256((a @ b).numpy().tobytes()).hexdigest()[:16])
"""


def _start(code: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            text=True)


def _seconds(procs: list[subprocess.Popen]) -> list[float]:
    return [round(float(p.communicate()[0].strip().splitlines()[-1]), 1) for p in procs]


def threads(steps: int) -> dict:
    """Seconds of `steps` warm-start steps: one process with 2 threads; two side by side with 2 threads each,
    OpenMP's waiting threads spinning (its default) or sleeping (OMP_WAIT_POLICY=PASSIVE); two with 1 thread each."""
    def run(n: int, threads: int, extra: dict[str, str]) -> list[float]:
        return _seconds([_start(WARM, [str(threads), str(steps)], {**PINS, **extra}) for _ in range(n)])

    return {"steps": steps,
            "alone_2_threads_s": run(1, 2, {}),
            "side_by_side_2_threads_spinning_s": run(2, 2, {"OMP_WAIT_POLICY": "ACTIVE"}),
            "side_by_side_2_threads_sleeping_s": run(2, 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
            "side_by_side_1_thread_s": run(2, 1, {})}


def mkl() -> dict:
    """The matrix product's hash under the first setting, and whether each other MKL setting changes it."""
    settings = {"first setting (MKL_CBWR=AVX2)": {},
                **{f"MKL_CBWR={v}": {"MKL_CBWR": v} for v in ("COMPATIBLE", "SSE4_2", "AVX", "AVX512", "AUTO,STRICT")},
                **{f"MKL_ENABLE_INSTRUCTIONS={v}": {"MKL_CBWR": "", "MKL_ENABLE_INSTRUCTIONS": v}
                   for v in ("SSE4_2", "AVX")}}
    hashes = {name: subprocess.run([sys.executable, "-c", MATMUL], env={**os.environ, **PINS, **extra},
                                   capture_output=True, text=True, check=True).stdout.strip()
              for name, extra in settings.items()}
    first = hashes["first setting (MKL_CBWR=AVX2)"]
    return {"matmul_hash": hashes, "changes_the_bits": {k: v != first for k, v in hashes.items()}}


def prefix(steps: int) -> dict:
    """`make test`'s stand-in for the 600-step rebuild (tests/system/test_models.py): the shipped recipe's first
    `steps` steps against the shipped loss log, as shipped and with changes to what the recipe's configuration does
    not name (so the shipped copy's name still matches): per variant, the first step whose logged loss differs and
    how many do."""
    from unittest import mock

    import torch

    from dppo_core import warm_start as ws
    from dppo_core.config import DPPOConfig
    from dppo_core.models import TinyModelConfig, build_tiny_model, load_model

    shipped = json.loads((ws.SHIPPED_WARM_START / "warm_start_log.json").read_text())["loss"][:steps]
    adamw, clip = torch.optim.AdamW, torch.nn.utils.clip_grad_norm_
    base = build_tiny_model(TinyModelConfig(), tempfile.mkdtemp())

    def floor_5_percent(c):
        return DPPOConfig(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps, max_steps=c.steps,
                          lr_schedule="cosine", min_lr_ratio=0.05)

    variants = {
        "as shipped": {},
        "the schedule's floor 5% of the peak, not 10%": {
            "dppo_core.warm_start.learning_rate_schedule": floor_5_percent},
        "AdamW betas (0.9, 0.999), not (0.9, 0.95)": {
            "torch.optim.AdamW": lambda params, **kw: adamw(params, **{**kw, "betas": (0.9, 0.999)})},
        "gradients clipped at norm 0.5, not 1": {
            "torch.nn.utils.clip_grad_norm_": lambda params, max_norm, **kw: clip(params, 0.5, **kw)},
    }
    out = {}
    for name, patches in variants.items():
        with contextlib.ExitStack() as stack:
            for target, value in patches.items():
                stack.enter_context(mock.patch(target, value))
            model, tokenizer = load_model(base)
            ours = ws.train_warm_start(model, tokenizer, ws.WarmStartConfig(), progress=False, until=steps)
        differ = [i for i, (a, b) in enumerate(zip(ours, shipped, strict=True)) if a != b]
        out[name] = {"first_differing_step": differ[0] if differ else None, "differing_steps": len(differ),
                     "loss_ratio": round(sum(ours) / sum(shipped), 6)}
    return {"steps": steps, "variants": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("probe", choices=["threads", "mkl", "prefix"])
    parser.add_argument("--steps", type=int, default=None,
                        help="warm-start steps per process (threads: 60) or of the recipe's start (prefix: 50)")
    parser.add_argument("--output", type=Path, default=None,
                        help="default: benchmarks/results/suite_probes/<probe>.json")
    args = parser.parse_args()
    start = time.time()
    if args.probe == "threads":
        result = threads(args.steps or 60)
    else:
        result = mkl() if args.probe == "mkl" else prefix(args.steps or 50)
    import torch

    result.update(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
                  command=" ".join(["python benchmarks/suite_probes.py", *sys.argv[1:]]),
                  wall_s=round(time.time() - start))
    if args.probe == "prefix":  # in this process, under the caller's kernel setting (the others set PINS themselves)
        result["kernels"] = {k: os.environ.get(k) for k in PINS}
    output = args.output or OUT / f"{args.probe}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
