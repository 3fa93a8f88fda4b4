"""What decides the last bits of a float computation on this machine: the CPU's floating-point kernels.

A chaotic computation (hundreds of optimizer steps: the warm start of :mod:`dppo_core.warm_start`, a pinned
run of the trainer) reproduces bit for bit only on the same kernels. :func:`kernel_fingerprint` names them
(the CPU's vendor, PyTorch's version, its vector kernels and thread count, and the environment variables of
:data:`KERNEL_SETTINGS`, which the Makefile pins); a recording stores it, and :func:`fingerprint_mismatch`
says whether, and how, this machine differs from the one that recorded.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

#: The environment variables that choose the CPU's floating-point kernels (the Makefile sets them).
KERNEL_SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def _cpu_vendor() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.machine() or "unknown"


def kernel_fingerprint() -> dict[str, str]:
    """What decides the bits of a float computation on this CPU: the CPU's vendor (``AuthenticAMD``,
    ``GenuineIntel``; the machine type where there is no /proc/cpuinfo), PyTorch's version, the vector kernels
    PyTorch runs (``torch.backends.cpu.get_cpu_capability()``), its thread count (a long sum is split by
    threads) and the settings in :data:`KERNEL_SETTINGS`.

    A chaotic computation (hundreds of optimizer steps) reproduces bit for bit only between equal
    fingerprints; that is what a recording of one is stored with, and :func:`fingerprint_mismatch`
    compares."""
    return {"cpu_vendor": _cpu_vendor(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": str(torch.get_num_threads()),
            **{k: os.environ.get(k, "") for k in KERNEL_SETTINGS}}


def fingerprint_mismatch(recorded: dict[str, str], current: dict[str, str] | None = None) -> str | None:
    """``None`` where every key of ``recorded`` has its recorded value in ``current`` (default: this machine's
    :func:`kernel_fingerprint`); otherwise the differences, as ``key: recorded -> here``."""
    current = kernel_fingerprint() if current is None else current
    diffs = [f"{k}: {v!r} -> {current.get(k, '')!r}" for k, v in recorded.items() if current.get(k, "") != v]
    return "; ".join(diffs) or None
