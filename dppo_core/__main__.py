"""``python -m dppo_core ...`` is the ``dppo`` command (``torchrun -m dppo_core train ...`` for several
processes)."""

from dppo_core.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
