"""``dppo eval``'s inputs, checked before anything heavy loads: the model (a directory or a Hub id) and the
benchmarks (names or .jsonl files), with the Hugging Face Hub probed once, so an offline machine fails at once
with the fix instead of retrying the network. A bad input is an :class:`EvalInputError`: one line, exit code
2.
"""

from __future__ import annotations

from pathlib import Path


class EvalInputError(ValueError):
    """A ``dppo eval`` input that cannot work (model, benchmark, data): printed as one line, exit code 2."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers (a TCP connection to its host within ``timeout`` seconds).

    False at once when ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set.
    """
    import os
    import socket
    import threading
    from urllib.parse import urlparse

    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    answered: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)),
                                     timeout=timeout).close()
            answered.append(True)
        except (OSError, UnicodeError):
            answered.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # name resolution ignores the socket's timeout
    thread.start()
    thread.join(timeout + 0.5)
    return bool(answered and answered[0])


def _hub_cached(repo_id: str, kind: str) -> bool:
    """Whether a Hub model or dataset (``kind``) has a copy in the local Hugging Face caches."""
    import os

    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    names = [Path(constants.HF_HUB_CACHE) / f"{kind}s--{repo_id.replace('/', '--')}"]
    if kind == "dataset":
        cache = os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
        names.append(Path(cache) / repo_id.replace("/", "___"))
    return any(n.is_dir() for n in names)


def check_eval_model(model: str) -> None:
    """Refuse a ``--model`` that cannot be loaded, before any data is read (an :class:`EvalInputError`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EvalInputError(f"--model {model} is a directory without config.json; pass the directory "
                                 "that save_pretrained wrote (e.g. runs/tiny-grpo/final) or a Hub id")
        return
    if path.exists():
        raise EvalInputError(f"--model {model} is a file; pass a model directory (config.json and weights) "
                             "or a Hub id")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise EvalInputError(f"--model {model} does not exist; pass a model directory (e.g. "
                             "runs/tiny-grpo/final) or a Hub id (org/name)")
    if not _hub_cached(model, "model") and not hub_reachable():
        raise EvalInputError(f"--model {model} is no local directory, and the Hugging Face Hub is "
                             "unreachable (offline) with no cached copy; pass a local model directory, or go "
                             "online")


def _go_offline() -> None:
    """Offline mode for huggingface_hub and datasets, also when they are imported already (they read the
    environment variables at import, so the constants they copied them into are set too)."""
    import os
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
        datasets.config.HF_DATASETS_OFFLINE = True


def load_eval_benchmarks(names: list[str], data_dir: Path | None, limit: int | None) -> dict:
    """The records of each benchmark, or an :class:`EvalInputError` naming the input and the fix.

    A benchmark with no local copy (no ``--data-dir``, ``$DPPO_DATA_DIR`` unset) is fetched from the Hub; when
    the Hub is unreachable and has not cached it, this fails at once instead of retrying the network.
    """
    import os

    from dppo_core.benchmark_data import BENCHMARKS, load_benchmark

    local = data_dir if data_dir is not None else os.environ.get("DPPO_DATA_DIR") or None
    by_name = [n for n in names
               if Path(n).expanduser().suffix != ".jsonl" and not Path(n).expanduser().exists()]
    for name in by_name:  # every name first, so a typo is reported before any data is looked for
        if name.lower().replace("-", "_") not in BENCHMARKS:
            raise EvalInputError(f"unknown benchmark {name!r}; known names: {', '.join(BENCHMARKS)} "
                                 "(or the path of a .jsonl file)")
    for name in names:  # a file that is not there: named as the user typed it, once
        path = Path(name).expanduser()
        if path.suffix == ".jsonl" and not path.is_file():
            raise EvalInputError(f"--benchmarks {name}: no such file; pass an existing .jsonl file (one "
                                 "problem/answer object per line) or a benchmark name "
                                 f"({', '.join(BENCHMARKS)})")
    online: bool | None = None
    out = {}
    for name in names:
        if name in by_name and local is None:  # from the Hub
            spec = BENCHMARKS[name.lower().replace("-", "_")]
            online = hub_reachable() if online is None else online
            if not online:
                if not _hub_cached(spec.hub_id, "dataset"):
                    raise EvalInputError(
                        f"benchmark {name!r} has no local copy and the Hugging Face Hub is unreachable "
                        f"(offline); pass --data-dir DIR (a directory with {spec.file}), set "
                        "DPPO_DATA_DIR=DIR, or go online")
                _go_offline()  # read the cached copy without retrying the network
        try:
            out[name] = load_benchmark(name, data_dir=data_dir, limit=limit)
        except (ValueError, OSError, ImportError) as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise EvalInputError(message if repr(name) in message
                                 else f"benchmark {name!r}: {message}") from exc
    return out
