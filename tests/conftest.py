"""Shared fixtures. Models are built into $DPPO_CACHE_DIR (set by the Makefile) so the tests, the
notebooks and the demo build each one once; without it, into a per-session temporary directory."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

# `make test` runs the suite in two pytest-xdist workers (the Makefile's TEST_WORKERS), each with PyTorch's own
# thread count (two on a 2-core machine: the count the pinned records were made with). Two processes of two threads
# on two cores stall in OpenMP's thread barriers, where a waiting thread spins on the core the other process needs
# (60 warm-start steps: 39 s alone, 175 s each side by side with spinning threads); told to sleep instead
# (OMP_WAIT_POLICY=PASSIVE, which changes no result), they take 60 s each (benchmarks/suite_probes.py threads). Set
# before torch loads; the chapters' kernels and every process a test starts inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

# The tiers (tests/unit, tests/system, tests/course, tests/repo; docs/testing.md says what goes where) share the
# modules of tests/helpers: the mutants (`from mutants import ...`), the exact enumeration of the estimator's draws,
# what the training tests share (run_helpers) and the workers that system tests start as scripts. The tiers have no
# __init__.py, so a test file's name must be unique across them.
HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))


def shared_benchmarks_dir() -> Path | None:
    """The benchmark jsonl files: $DPPO_DATA_DIR, else <repo>/../shared/data/benchmarks, else None."""
    env = os.environ.get("DPPO_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(REPO_ROOT.parent / "shared" / "data" / "benchmarks")
    for c in candidates:
        if c.is_dir() and any(c.glob("*.jsonl")):
            return c
    return None


@pytest.fixture(scope="session")
def benchmarks_dir() -> Path:
    d = shared_benchmarks_dir()
    if d is None:
        pytest.skip("benchmark data not found: set DPPO_DATA_DIR or place the shared data at ../shared/data/benchmarks")
    return d


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    env = os.environ.get("DPPO_CACHE_DIR")
    return Path(env) if env else tmp_path_factory.mktemp("dppo-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir) -> Path:
    """The untrained embedded tiny model (built in ~5 s, cached)."""
    from dppo_core.models import build_tiny_model

    return build_tiny_model(cache_dir=cache_dir)


@pytest.fixture(scope="session")
def small_model_dir(cache_dir) -> Path:
    """A smaller model than the default (built in ~1 s, cached), so a training step takes well under a second."""
    from dppo_core.models import TinyModelConfig, build_tiny_model

    small = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return build_tiny_model(small, cache_dir)


def warm_small_model(cache_dir: Path) -> Path:
    """The small model above, warm-started on level 1 only: about 0.2 accuracy, built once (~15 s) and cached.

    Its completions end where its answers end, from a few tokens to the limit: what a rollout engine meets
    in training (the untrained models rarely stop early)."""
    from dppo_core.models import TinyModelConfig
    from dppo_core.warm_start import WarmStartConfig, warm_start

    small = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    config = WarmStartConfig(steps=200, batch_size=16, warmup_steps=5, level_weights=(1.0, 0.0, 0.0, 0.0, 0.0))
    return warm_start(config, small, cache_dir, progress=False)


@pytest.fixture(scope="session")
def warm_small_model_dir(cache_dir) -> Path:
    return warm_small_model(cache_dir)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# Each test file's seconds in a recent `make test` (setup, call and teardown summed, in two workers), one table per
# selection (`-m` expression: "not rebuild" for the first setting's run, "numerics" for the second's), written by
# `make test TEST_ARGS="--record-durations tests/durations.json"`. Under pytest-xdist a file's tests run in one worker
# (--dist loadfile) and files are handed out in collection order, so the workers collect the longest file first: no
# long file is left for the end while the other worker waits. A file not in the table goes first (it may be long); a
# stale table costs time, never a test.
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def _selection(config) -> str:
    return config.getoption("markexpr", "") or "all"


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH",
                     help="write each test file's seconds (setup, call and teardown summed) into PATH, a JSON table "
                          "per -m selection (this run's replaces its files' entries); tests/durations.json, written "
                          "so, orders the files under pytest-xdist")


def pytest_configure(config):
    if config.getoption("--record-durations", None) and not hasattr(config, "workerinput"):  # not in a worker
        config.pluginmanager.register(_DurationRecorder(Path(config.getoption("--record-durations")),
                                                        _selection(config)))


class _DurationRecorder:
    def __init__(self, path: Path, selection: str):
        self.path, self.selection, self.seconds = path, selection, Counter()

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self):
        tables = json.loads(self.path.read_text()) if self.path.exists() else {}
        table = tables.setdefault(self.selection, {})
        table.update((name, round(s, 1)) for name, s in self.seconds.items())
        tables[self.selection] = dict(sorted(table.items(), key=lambda kv: -kv[1]))
        self.path.write_text(json.dumps(tables, indent=1) + "\n")


def pytest_collection_modifyitems(config, items):
    """Every chapter's cells compare stored outputs (nbval): they count as `numerics`, so `make test-perturbed` (the
    second half of `make test`) runs them under the second kernel setting. In an xdist worker: the longest files
    first (DURATIONS)."""
    for item in items:
        if str(item.path).endswith(".ipynb"):
            item.add_marker(pytest.mark.numerics)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        seconds = (json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}).get(_selection(config), {})
        items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))  # stable: in-file order
