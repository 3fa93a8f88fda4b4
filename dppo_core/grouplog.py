"""``groups.jsonl``: every rolled-out group of every step, compactly, so that what pruning could have saved
can be computed from a run's own files (:mod:`dppo_core.tools.bench.ceiling`), predictors of informative
groups compared offline (``benchmarks/predictors.py``), and the persistence of a run's all-equal groups
measured (:func:`persistence`: what pruning prompts by their history can see).

One line per step that rolled something out::

    {"step": 3, "window": 64, "ids": ["L2:3+4", ...], "pi": [0.53, ...],
     "rewards": [[1, 0, 1, 1, 0, 0, 1, 1], ...], "lengths": [[17, 22, ...], ...]}

(with a pilot, ``"stopped"`` holds the groups stopped after their pilot in the same form, k rewards each; the
rows above are the groups trained on, G each).

``step`` is the step's number as in ``metrics.jsonl`` (counted after the step), ``window`` the candidate
prompts the step's objective is over, and per rolled-out group (in the rollout's order) its prompt id
(:func:`dppo_core.data.prompt_key`), its inclusion probability π_q, its G rewards (integers where integral,
else rounded to 6 significant digits) and its G completion lengths in tokens. Written by rank 0 only; a
resumed run drops the lines of steps it runs again, like the other logs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FILENAME = "groups.jsonl"


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(f"{x:.6g}")


def group_record(step: int, window: int, ids: Sequence[str], probs: torch.Tensor, rewards: torch.Tensor,
                 lengths: torch.Tensor, stopped: tuple | None = None) -> dict[str, Any]:
    """One step's line: ``rewards`` and ``lengths`` of shape (len(ids), G), ``probs`` of shape (len(ids),).
    ``stopped`` (a pilot's): the groups stopped after their pilot, as (ids, π, rewards, lengths) of k columns,
    kept under the line's ``"stopped"`` in the same form (``ids``, ``pi``, ``rewards``, ``lengths``)."""
    if rewards.shape != lengths.shape or rewards.shape[0] != len(ids) or len(probs) != len(ids):
        raise ValueError(f"{len(ids)} ids, {len(probs)} probabilities, rewards {tuple(rewards.shape)} and "
                         f"lengths {tuple(lengths.shape)}: one row per id, rewards and lengths of the same "
                         "(P, G) shape")
    line = {"step": int(step), "window": int(window), "ids": [str(i) for i in ids],
            "pi": [_number(p) for p in probs.tolist()],
            "rewards": [[_number(r) for r in row] for row in rewards.tolist()],
            "lengths": [[int(n) for n in row] for row in lengths.tolist()]}
    if stopped is not None:
        line["stopped"] = {k: v for k, v in group_record(step, window, *stopped).items()
                           if k not in ("step", "window")}
    return line


def read_groups(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``groups.jsonl`` (or of ``DIR/groups.jsonl`` given a run directory), in step order; a
    line cut off by a crash is skipped. A missing file raises :class:`FileNotFoundError` naming it."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no group log; runs write it unless log_groups is False (runs made "
                                "before it existed have none)")
    return sorted((r for r in read_records(path) if "rewards" in r), key=lambda r: r["step"])


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a run's ``.jsonl`` log; a line cut off by a crash (or anything not an object) is
    skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def informative(rewards: Sequence[float]) -> bool:
    """A group is informative when its rewards are not all equal (otherwise every advantage is 0)."""
    return len(set(rewards)) > 1


@dataclass(frozen=True)
class Persistence:
    """How far a prompt's last group tells whether its next one will be all-equal: what prompt pruning from
    history can see in a run. Counts over a group log; the ratios are None where their denominator is 0.

    A *transition* is a group whose prompt was rolled out before in the log, paired with that prompt's
    previous group (whatever step it was in). A group is all-equal when its G rewards are all equal
    (:func:`informative` is False); all-solved / all-unsolved when they all equal the ``solved`` /
    ``unsolved`` reward given to :func:`persistence`.
    """

    groups: int  #: groups in the log (every rolled-out group)
    prompts: int  #: distinct prompt ids
    all_solved: int  #: groups whose every reward is the solved value
    all_unsolved: int  #: groups whose every reward is the unsolved value
    all_equal_other: int  #: all-equal groups at any other value
    mixed: int  #: informative groups (rewards not all equal)
    after_equal: int  #: transitions whose previous group was all-equal
    equal_after_equal: int  #: ... and whose group is all-equal too
    after_mixed: int  #: transitions whose previous group was mixed
    equal_after_mixed: int  #: ... and whose group is all-equal
    prompts_always_solved: int  #: prompts every one of whose groups was all-solved
    prompts_never_solved: int  #: prompts every one of whose groups was all-unsolved
    prompts_between: int  #: every other prompt

    @property
    def p_equal_after_equal(self) -> float | None:
        """P(all-equal | the prompt's previous group was all-equal)."""
        return self.equal_after_equal / self.after_equal if self.after_equal else None

    @property
    def p_equal_after_mixed(self) -> float | None:
        """P(all-equal | the prompt's previous group was mixed)."""
        return self.equal_after_mixed / self.after_mixed if self.after_mixed else None

    @property
    def share_equal_with_equal_previous(self) -> float | None:
        """Of the all-equal groups that have a previous group, the share whose previous group was all-equal
        too (the all-equal groups history could have flagged)."""
        equal = self.equal_after_equal + self.equal_after_mixed
        return self.equal_after_equal / equal if equal else None

    @property
    def share_all_equal(self) -> float | None:
        """The share of all groups that are all-equal."""
        return 1 - self.mixed / self.groups if self.groups else None

    def to_dict(self) -> dict[str, Any]:
        """The counts and the ratios (rounded to 4 decimals), for a JSON report."""
        out: dict[str, Any] = dict(vars(self))
        for name in ("p_equal_after_equal", "p_equal_after_mixed", "share_equal_with_equal_previous",
                     "share_all_equal"):
            value = getattr(self, name)
            out[name] = None if value is None else round(value, 4)
        return out


def persistence(records: Iterable[dict[str, Any]], *, solved: float = 1.0, unsolved: float = 0.0,
                keep: Callable[[str], bool] | None = None) -> Persistence:
    """The persistence of all-equal groups in a group log: :class:`Persistence`'s counts and ratios.

    Args:
        records: the lines of a ``groups.jsonl`` (:func:`read_groups`), in step order; within a line, groups
            in the rollout's order. Any method's log will do; a pruned run's shows only the groups it rolled
            out.
        solved: the reward of a completion that solved its prompt (the embedded task's accuracy reward: 1).
        unsolved: the reward of one that did not (0).
        keep: count only the prompts whose id it accepts (e.g. ``lambda i: i.startswith("L3:")`` for level 3).

    The three figures DPPO's prompt stage lives on are :attr:`Persistence.p_equal_after_equal`,
    :attr:`Persistence.p_equal_after_mixed` and :attr:`Persistence.share_equal_with_equal_previous`; a
    prompt's first group has no previous one and enters only the shares of groups and prompts.
    """
    last: dict[str, bool] = {}  # prompt id -> was its last group all-equal
    outcome: dict[str, set[str]] = {}  # prompt id -> kinds of its groups
    n = {"groups": 0, "all_solved": 0, "all_unsolved": 0, "all_equal_other": 0, "mixed": 0, "after_equal": 0,
         "equal_after_equal": 0, "after_mixed": 0, "equal_after_mixed": 0}
    for record in records:
        for prompt_id, rewards in zip(record["ids"], record["rewards"], strict=True):
            if keep is not None and not keep(prompt_id):
                continue
            equal = not informative(rewards)
            kind = ("mixed" if not equal else "all_solved" if rewards[0] == solved
                    else "all_unsolved" if rewards[0] == unsolved else "all_equal_other")
            n["groups"] += 1
            n[kind] += 1
            outcome.setdefault(prompt_id, set()).add(kind)
            if prompt_id in last:
                before = "after_equal" if last[prompt_id] else "after_mixed"
                n[before] += 1
                n["equal_" + before] += equal
            last[prompt_id] = equal
    return Persistence(**n, prompts=len(outcome),
                       prompts_always_solved=sum(k == {"all_solved"} for k in outcome.values()),
                       prompts_never_solved=sum(k == {"all_unsolved"} for k in outcome.values()),
                       prompts_between=sum(k not in ({"all_solved"}, {"all_unsolved"})
                                           for k in outcome.values()))
