"""Shared fixtures. Models are built into $DPPO_CACHE_DIR (set by the Makefile) so the tests, the
notebooks and the demo build each one once; without it, into a per-session temporary directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

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


def pytest_collection_modifyitems(config, items):
    """Every chapter's cells compare stored outputs (nbval): they count as `numerics`, so `make test` runs them
    under its second kernel setting too."""
    for item in items:
        if str(item.path).endswith(".ipynb"):
            item.add_marker(pytest.mark.numerics)
