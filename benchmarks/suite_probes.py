"""The measurements behind `make test`'s two workers (docs/testing.md, "What made `make test` shorter").

    python benchmarks/suite_probes.py threads   # 60 warm-start steps: alone, and two side by side three ways
    python benchmarks/suite_probes.py mkl       # which MKL settings change a matrix product's bits on this CPU

Run under the Makefile's pins (ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2), nothing else
running. Results: benchmarks/results/suite_probes/<probe>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("probe", choices=["threads", "mkl"])
    parser.add_argument("--steps", type=int, default=60, help="warm-start steps per process (threads)")
    args = parser.parse_args()
    start = time.time()
    result = threads(args.steps) if args.probe == "threads" else mkl()
    import torch

    result.update(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
                  command=f"python benchmarks/suite_probes.py {args.probe}", wall_s=round(time.time() - start))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.probe}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
