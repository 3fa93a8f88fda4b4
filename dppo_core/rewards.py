"""Rewards: TRL-style reward functions on a completion's final answer and its form.

The correctness reward is

    r(completion, answer) = 1  if  extract_answer(completion, mode) ≡ answer  else 0

with the final answer found and its equivalence decided by :mod:`dppo_core.grading` (strict extraction, the
default, for RL rewards; lenient for evaluation). A reward is computed for every completion of every RL step,
so it has to be right *and* fast.

Reward functions follow TRL's convention, ``fn(prompts, completions, **dataset_columns) -> list[float]``,
with completions as strings or as conversations (``[{"role": "assistant", "content": ...}]``), so TRL
reward functions and ours are interchangeable. :func:`math_rewards` scores many completions at once and
sends the symbolic checks to worker processes when there are many (the verifier is CPU-bound).

Departure from common practice, and why: no "last number in the text" fallback in the reward's (strict)
extraction: it rewards a policy for ending on any number and is an easy reward hack. The lenient mode, for
evaluation only, reads the last sentence's number.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from dppo_core.grading import (
    BOX_COMMANDS,
    DEFAULT_TIMEOUT,
    MAX_ANSWER_CHARS,
    STRICT,
    VerifierTimeout,
    check_mode,
    extract_answer,
    fast_equivalence,
    find_boxed,
    reference_answer,
    symbolic_equivalence,
    symbolic_equivalence_in_workers,
)

logger = logging.getLogger(__name__)

Completion = str | list[dict[str, Any]]  # a string, or a TRL-style conversation
RewardFunction = Callable[..., list[float]]


def completion_text(completion: Completion) -> str:
    """The text of a completion: the string itself, the content of a conversation's last message (TRL passes
    conversational completions as ``[{"role": "assistant", "content": "..."}]``), or the ``text`` of an object
    that has one (a :class:`dppo_core.rollout.Completion`). An empty conversation is ``""`` (it scores 0).

    Raises:
        TypeError: for anything else, naming its type, rather than scoring it 0 without a word.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        last = completion[-1]
        if isinstance(last, dict) and isinstance(last.get("content"), str):
            return last["content"]
    elif isinstance(getattr(completion, "text", None), str):
        return completion.text
    raise TypeError(f"a completion must be a string, a conversation (a list of {{'role', 'content'}} dicts) "
                    f"or have a .text string (a dppo_core.rollout.Completion); got "
                    f"{type(completion).__name__}: {str(completion)[:80]!r}")


def math_reward(completion: Completion, answer: str, *, timeout: float = DEFAULT_TIMEOUT,
                mode: str = STRICT) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to ``answer``, else 0.0.

    ``answer`` is the reference's final answer (a worked solution ending in ``#### N`` or containing a
    ``\\boxed{}`` works too). ``mode`` is how the completion's answer is found (:func:`extract_answer`):
    ``"strict"`` for RL rewards (the default), ``"lenient"`` for evaluation. A comparison that takes longer
    than ``timeout`` seconds scores 0.0. Never raises, except a ValueError for an unknown ``mode`` and a
    TypeError for a ``completion`` that is none (:func:`completion_text`).
    """
    check_mode(mode)
    text = completion_text(completion)  # a TypeError for what is no completion, not a silent 0
    try:
        pred = extract_answer(text, mode)
        if pred is None or not isinstance(answer, str):
            return 0.0
        gold = reference_answer(answer)
        fast = fast_equivalence(pred, gold)
        if fast is not None:
            return float(fast)
        return float(symbolic_equivalence(pred, gold, timeout))
    except (Exception, VerifierTimeout):
        logger.debug("math_reward failed; scoring 0", exc_info=True)
        return 0.0


def default_num_workers() -> int:
    """Worker processes for batch scoring: the CPU cores available to this process, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def math_rewards(
    completions: Sequence[Completion],
    answers: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    num_workers: int | None = None,
    min_parallel: int = 32,
    mode: str = STRICT,
) -> list[float]:
    """:func:`math_reward` of each (completion, answer) pair, in parallel where it pays.

    The string check and numeric fast path run here for every pair (microseconds). Of the rest, the
    distinct (prediction, reference) pairs are checked symbolically: in ``num_workers`` worker processes
    when there are at least ``min_parallel`` of them, else here one by one. Same result as calling
    :func:`math_reward` on each pair (with the same extraction ``mode``).
    """
    check_mode(mode)
    if len(completions) != len(answers):
        raise ValueError(
            f"got {len(completions)} completions but {len(answers)} answers; pass one answer per completion "
            "(repeat a prompt's answer for each of its completions)"
        )
    rewards = [0.0] * len(completions)
    todo: dict[tuple[str, str], list[int]] = {}
    texts = [completion_text(c) for c in completions]  # a TypeError for what is no completion, not a silent 0
    for i, (text, answer) in enumerate(zip(texts, answers, strict=True)):
        try:
            pred = extract_answer(text, mode)
            if pred is None or not isinstance(answer, str):
                continue
            gold = reference_answer(answer)
            fast = fast_equivalence(pred, gold)
        except Exception:
            logger.debug("fast check failed; scoring 0", exc_info=True)
            continue
        if fast is not None:
            rewards[i] = float(fast)
        elif len(pred) <= MAX_ANSWER_CHARS and len(gold) <= MAX_ANSWER_CHARS:
            todo.setdefault((pred, gold), []).append(i)
    pairs = list(todo)
    workers = default_num_workers() if num_workers is None else num_workers
    if len(pairs) >= min_parallel and workers > 1:
        size = max(1, min(16, math.ceil(len(pairs) / (4 * workers))))
        chunks = [pairs[j : j + size] for j in range(0, len(pairs), size)]
        verdicts = [v for chunk in symbolic_equivalence_in_workers(chunks, timeout, workers) for v in chunk]
    else:
        verdicts = [symbolic_equivalence(pred, gold, timeout) for pred, gold in pairs]
    for pair, ok in zip(pairs, verdicts, strict=True):
        for i in todo[pair]:
            rewards[i] = float(ok)
    return rewards


def _answers_column(columns: dict[str, Any], n: int) -> list[str]:
    for key in ("answer", "solution"):
        if columns.get(key) is not None:
            values = list(columns[key])
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
            return [str(v) for v in values]
    raise ValueError(
        f"accuracy_reward needs the reference answers as a dataset column named 'answer' (or 'solution', "
        f"as TRL names it); got columns {sorted(columns)}"
    )


def accuracy_reward(prompts: Sequence[Any] | None, completions: Sequence[Completion],
                    **columns: Any) -> list[float]:
    """TRL-style correctness reward: :func:`math_reward` of each completion against its row's answer.

    The answers come from the dataset column ``answer`` (or ``solution``, TRL's name).
    """
    return math_rewards(completions, _answers_column(columns, len(completions)))


def format_ok(text: str, max_tail_chars: int = 40) -> bool:
    """Whether a completion is well formed: exactly one non-empty ``\\boxed{}``, near the end.

    "Near the end" means at most ``max_tail_chars`` characters follow the box (a closing ``$``,
    ``\\]`` or sentence), so a completion that keeps talking after its answer, or was cut off inside
    the box, does not pass.
    """
    boxes = find_boxed(text)
    opened = sum(text.count(cmd) for cmd in BOX_COMMANDS)
    if len(boxes) != 1 or opened != 1:
        return False
    content, _, end = boxes[0]
    return bool(content.strip()) and len(text[end:].strip()) <= max_tail_chars


def format_reward(prompts: Sequence[Any] | None, completions: Sequence[Completion],
                  **columns: Any) -> list[float]:
    """TRL-style format reward: 1.0 where :func:`format_ok` holds, else 0.0."""
    return [float(format_ok(completion_text(c))) for c in completions]


def combine_rewards(
    reward_funcs: Sequence[RewardFunction], weights: Sequence[float] | None = None
) -> RewardFunction:
    """One reward function that returns ``Σ_j w_j · f_j(prompts, completions, **columns)``.

    Works with any TRL-style reward functions (ours or a TRL user's). ``weights`` defaults to all 1.
    """
    funcs = list(reward_funcs)
    ws = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
    if not funcs or len(ws) != len(funcs):
        raise ValueError(
            f"combine_rewards needs one or more reward functions and one weight per function; got "
            f"{len(funcs)} functions and {len(ws)} weights"
        )

    def combined(prompts: Sequence[Any] | None, completions: Sequence[Completion],
                 **columns: Any) -> list[float]:
        total = [0.0] * len(completions)
        for fn, w in zip(funcs, ws, strict=True):
            scores = fn(prompts=prompts, completions=completions, **columns)
            if len(scores) != len(completions):
                raise ValueError(
                    f"reward function {getattr(fn, '__name__', fn)!r} returned {len(scores)} scores for "
                    f"{len(completions)} completions"
                )
            total = [t + w * (0.0 if s is None else s) for t, s in zip(total, scores, strict=True)]
        return total

    combined.__name__ = "+".join(f"{w:g}*{getattr(f, '__name__', 'reward')}"
                                 for f, w in zip(funcs, ws, strict=True))
    return combined
