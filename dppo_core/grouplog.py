"""``groups.jsonl``: every rolled-out group of every step, compactly, so that what pruning could have saved can be
computed from a run's own files (:mod:`dppo_core.tools.bench.ceiling`) and predictors of informative groups can be
compared offline (``benchmarks/predictors.py``).

One line per step that rolled something out::

    {"step": 3, "window": 64, "ids": ["L2:3+4", ...], "pi": [0.53, ...],
     "rewards": [[1, 0, 1, 1, 0, 0, 1, 1], ...], "lengths": [[17, 22, ...], ...]}

``step`` is the step's number as in ``metrics.jsonl`` (counted after the step), ``window`` the candidate prompts
the step's objective is over, and per rolled-out group (in the rollout's order) its prompt id
(:func:`dppo_core.data.prompt_key`), its inclusion probability π_q, its G rewards (integers where integral, else
rounded to 6 significant digits) and its G completion lengths in tokens. Written by rank 0 only; a resumed run
drops the lines of steps it runs again, like the other logs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

FILENAME = "groups.jsonl"


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(f"{x:.6g}")


def group_record(step: int, window: int, ids: Sequence[str], probs: torch.Tensor, rewards: torch.Tensor,
                 lengths: torch.Tensor) -> dict[str, Any]:
    """One step's line: ``rewards`` and ``lengths`` of shape (len(ids), G), ``probs`` of shape (len(ids),)."""
    if rewards.shape != lengths.shape or rewards.shape[0] != len(ids) or len(probs) != len(ids):
        raise ValueError(f"{len(ids)} ids, {len(probs)} probabilities, rewards {tuple(rewards.shape)} and lengths "
                         f"{tuple(lengths.shape)}: one row per id, rewards and lengths of the same (P, G) shape")
    return {"step": int(step), "window": int(window), "ids": [str(i) for i in ids],
            "pi": [_number(p) for p in probs.tolist()],
            "rewards": [[_number(r) for r in row] for row in rewards.tolist()],
            "lengths": [[int(n) for n in row] for row in lengths.tolist()]}


def read_groups(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``groups.jsonl`` (or of ``DIR/groups.jsonl`` given a run directory), in step order; a line
    cut off by a crash is skipped. A missing file raises :class:`FileNotFoundError` naming it."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no group log; runs write it unless log_groups is False (runs made "
                                "before it existed have none)")
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "rewards" in record:
            out.append(record)
    return sorted(out, key=lambda r: r["step"])


def informative(rewards: Sequence[float]) -> bool:
    """A group is informative when its rewards are not all equal (otherwise every advantage is 0)."""
    return len(set(rewards)) > 1
