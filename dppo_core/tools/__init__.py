"""The tools around the library: the ``dppo`` command line (:mod:`~dppo_core.tools.cli`), the environment
checks (:mod:`~dppo_core.tools.doctor`, :mod:`~dppo_core.tools.gpu_check`), the benchmark
(:mod:`~dppo_core.tools.bench`) and the course's exercise checks (:mod:`~dppo_core.tools.course`).

Tools import the library; the library never imports a tool (``tests/repo/test_packaging.py`` checks it).
"""
