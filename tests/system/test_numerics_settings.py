"""The Makefile's second kernel setting (PERTURBED) really perturbs: on this very CPU it sums in other orders than
the first setting, so a suite that passes under both is not leaning on one machine's bits.

`make test` runs the tests marked ``numerics`` and every chapter under both settings; this file shows the second
one changes the last bits of the computations those tests make (matrix products, so a model's forward and backward;
on a CPU with AVX-512 also PyTorch's own softmax), while agreeing to float32 rounding.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from dppo_core.numerics import KERNEL_SETTINGS
from dppo_core.tools.course import CPU_KERNEL_PINS

PROBE = r"""
import json, torch
torch.manual_seed(0)
a, b = torch.randn(256, 768), torch.randn(768, 512)
model = torch.nn.Sequential(torch.nn.Linear(768, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
out = model(a).log_softmax(-1)
out.sum().backward()
results = {"matmul": a @ b, "softmax": torch.softmax(a, -1), "forward": out,
           "gradient": model[0].weight.grad}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  **{k: v.detach().double().flatten().tolist() for k, v in results.items()}}))
"""


def _perturbed() -> dict[str, str]:
    """The Makefile's second kernel setting, as ``make`` resolves it on this machine (the first is
    ``CPU_KERNEL_PINS``, which tests/course/test_course.py checks against the Makefile)."""
    out = subprocess.run(["make", "--no-print-directory", "-n", "test-perturbed"], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("env ") and "pytest" in x)
    return {k: v for k, v in (kv.split("=", 1) for kv in line.split() if "=" in kv) if k in KERNEL_SETTINGS}


def _run(settings: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **settings}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_avx2() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and re.search(r"\bavx2\b", cpuinfo.read_text()) is not None


@pytest.mark.skipif(not _has_avx2(), reason="the two settings differ on x86-64 CPUs with AVX2 (the Makefile sets "
                                            "the first one only there)")
@pytest.mark.skipif(shutil.which("make") is None, reason="reads the settings through `make -n` (no make here)")
def test_the_perturbed_setting_changes_the_bits_but_not_the_numbers():
    pinned, perturbed = CPU_KERNEL_PINS, _perturbed()
    assert set(perturbed) == set(pinned)
    assert all(perturbed[k] != pinned[k] for k in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA"))
    a, b = _run(pinned), _run(perturbed)
    assert a["capability"] == "AVX2" and b["capability"] == perturbed["ATEN_CPU_CAPABILITY"].upper()
    changed = [k for k in a if k != "capability" and a[k] != b[k]]
    # every matrix product changes in the last bits (MKL and oneDNN), so a model's forward and backward do; with
    # AVX-512, PyTorch's own softmax too
    expected = {"matmul", "forward", "gradient"} | ({"softmax"} if b["capability"] == "AVX512" else set())
    assert expected <= set(changed), f"only {changed} changed under {perturbed}"
    for key in changed:
        worst = max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a[key], b[key], strict=True))
        assert worst < 1e-4, f"{key}: the two settings differ by {worst:.3g}, more than float32 rounding"
