"""The prompts a training run samples from: the embedded task's or a benchmark's, as rows with an id.

A step's candidate prompts are a function of ``(seed, step)`` only (:meth:`PromptSource.sample`), so a
resumed run draws what an uninterrupted one would, and every rank of a data-parallel job draws the same.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.tasks import ArithmeticTask, Problem


class PromptSource:
    """Rows with ``prompt`` (chat messages), ``answer`` and ``id``; a step's prompts are a function of (seed,
    step)."""

    def __init__(self, rows: Sequence[dict[str, Any]], weights: Sequence[float] | None = None):
        if not rows:
            raise ConfigError("the training dataset is empty: give a task or a jsonl file with at least one "
                              "row")
        self.rows = list(rows)
        self.weights = list(weights) if weights is not None else None

    def sample(self, seed: int, step: int, n: int) -> list[dict[str, Any]]:
        rng = random.Random(f"prompts:{seed}:{step}")
        return rng.choices(self.rows, weights=self.weights, k=n)

    def pool(self, size: int) -> PromptSource:
        """The first ``size`` rows of one fixed weighted shuffle, as a source sampled uniformly.

        The shuffle is a weighted random permutation (Efraimidis-Spirakis keys log(u) / w, largest first)
        under a fixed seed: the pool is the same for every run seed and method, holds the levels in about
        the proportions of the weights, and a smaller pool is a prefix of a larger one. Rows of weight 0
        are never drawn.
        """
        weights = self.weights or [1.0] * len(self.rows)
        eligible = sum(w > 0 for w in weights)
        if not 1 <= size <= eligible:
            raise ConfigError(f"train_pool_size={size}: the training set has {eligible} prompts"
                              f"{' with non-zero weight' if eligible < len(self.rows) else ''}; give 1 to "
                              f"{eligible}, or null for the whole set")
        rng = random.Random("train-pool")
        keys = [math.log(1.0 - rng.random()) / w if w > 0 else -math.inf for w in weights]
        order = sorted(range(len(self.rows)), key=keys.__getitem__, reverse=True)
        return PromptSource([self.rows[i] for i in order[:size]])


def prompt_key(row: dict[str, Any]) -> str:
    """The id a prompt's history is stored under: the row's ``id``, else its messages as JSON."""
    return str(row["id"]) if row.get("id") is not None else json.dumps(row["prompt"], sort_keys=True)


def few_shot_turns(n: int, levels: Sequence[int]) -> list[dict[str, str]]:
    """``n`` solved examples of the embedded task as user/assistant turns: ``n`` problems of the training
    split of ``levels`` drawn under a fixed seed (never a held-out one; the same for every run, and ``n`` of
    them are the first ``n`` of ``n + 1``), each its prompt and its answer as one equation (``75+72=147.
    \\boxed{147}``: the worked steps the tiny model learned mislead a pretrained model, which copies them;
    benchmarks/smollm2_prompts.py)."""
    task = ArithmeticTask(levels)
    problems = sorted((p for lvl in task.levels for p in task.train(lvl)), key=lambda p: p.id)
    turns: list[dict[str, str]] = []
    for p in random.Random("few-shot").sample(problems, n):
        turns += [{"role": "user", "content": p.prompt},
                  {"role": "assistant", "content": p.solution("equation")}]
    return turns


def prompt_renderer(config: DPPOConfig) -> Callable[[Sequence[dict[str, str]]], list[dict[str, str]]]:
    """What turns a row's messages into the prompt the model sees, in training and in evaluation alike: the
    configuration's ``system_prompt`` first (unless the row starts with a system message of its own), then its
    ``few_shot`` solved examples (:func:`few_shot_turns`), then the row's own messages."""
    system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    shots = few_shot_turns(config.few_shot, config.train_levels) if config.few_shot else []

    def render(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        own = list(messages[:1]) if messages and messages[0].get("role") == "system" else []
        return (own or system) + shots + list(messages[len(own):])

    return render


def read_chat_rows(path: Path) -> list[dict[str, Any]] | None:
    """The rows of a jsonl file in TRL's conversational format (``prompt``: a list of ``{"role", "content"}``
    messages ending with the user's, ``answer``: the reference answer), or None when its first row is not one.

    Raises:
        ConfigError: a row that starts like a chat row but is not one, naming the file, the line and the fix.
    """
    def parse(line: str) -> Any:
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            return None

    lines = [(i, parse(line)) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not lines or not isinstance(lines[0][1], dict) or not isinstance(lines[0][1].get("prompt"), list):
        return None  # not chat rows: load_benchmark reads (or refuses) the file
    rows = []
    for i, row in lines:
        row = row if isinstance(row, dict) else {}
        msgs, answer = row.get("prompt"), row.get("answer")
        ok = (isinstance(msgs, list) and msgs
              and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                      and m.get("role") in ("system", "user", "assistant")
                      for m in msgs) and msgs[-1]["role"] == "user")
        if not ok or not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
            raise ConfigError(f"{path}:{i}: a chat row needs 'prompt', a list of {{'role', 'content'}} "
                              "messages (roles system, user, assistant) that ends with the user's, and "
                              f"'answer', the reference answer as a string; got keys {sorted(row)}")
        rows.append({"id": str(row.get("id", f"{path.stem}-{i - 1}")), "prompt": msgs, "answer": str(answer)})
    return rows


def check_levels(config: DPPOConfig) -> None:
    """Refuse a ``train_levels`` or ``eval_levels`` the embedded task does not have (it has levels 1-6; level
    6 is beyond the tiny model's reach, :data:`dppo_core.tasks.EXTRA_LEVELS`)."""
    from dppo_core.tasks import ALL_LEVELS

    for name in ("train_levels", "eval_levels"):
        levels = getattr(config, name) or ()
        if not set(levels) <= set(ALL_LEVELS):
            raise ConfigError(f"{name}={list(levels)!r}: the embedded task has levels {list(ALL_LEVELS)}; "
                              "choose among them, e.g. [2, 3, 4, 5]")


def build_prompt_source(config: DPPOConfig) -> PromptSource:
    """The training prompts of ``config.task``; with ``train_pool_size``, the fixed pool of that many."""
    if config.task == "arithmetic":
        check_levels(config)
        task = ArithmeticTask(config.train_levels)
        rows: list[dict[str, Any]] = []
        weights: list[float] = []
        level_w = config.level_weights or [1.0] * len(task.levels)
        for level, w in zip(task.levels, level_w, strict=True):
            problems: list[Problem] = task.train(level)
            rows.extend(p.to_record() for p in problems)
            weights.extend([w / len(problems)] * len(problems))
        source = PromptSource(rows, weights)
    else:
        from dppo_core.benchmark_data import BENCHMARKS, load_benchmark

        path = Path(config.task).expanduser()
        # the training data, named as the setting that gave it
        if path.suffix == ".jsonl" and not path.is_file():
            raise ConfigError(f"task={config.task!r} does not exist; give the path of a .jsonl file of "
                              f"problem/answer rows, a benchmark name ({', '.join(BENCHMARKS)}), or "
                              "task='arithmetic'")
        chat = read_chat_rows(path) if path.suffix == ".jsonl" else None
        records = load_benchmark(config.task) if chat is None else []
        if chat is None and not records:
            raise ConfigError(f"task={config.task!r} has no rows; give a jsonl file with at least one "
                              "problem/answer row, or task='arithmetic'")
        rows = chat or [{"id": r.id, "prompt": [{"role": "user", "content": r.problem}], "answer": r.answer}
                        for r in records]
        source = PromptSource(rows)
    if config.system_prompt or config.few_shot:
        render = prompt_renderer(config)
        source = PromptSource([{**r, "prompt": render(r["prompt"])} for r in source.rows], source.weights)
    return source.pool(config.train_pool_size) if config.train_pool_size is not None else source


def check_prompt_lengths(rows: Sequence[dict[str, Any]], tokenizer: Any, context_length: int,
                         max_completion_length: int, cache: dict[str, int]) -> None:
    """Refuse a prompt that leaves no room in the model's context for ``max_completion_length`` new tokens.

    ``cache`` maps prompt ids to token counts, so each prompt is tokenised for this check once per run.
    """
    from dppo_core.models import encode_prompt

    limit = context_length - max_completion_length
    for r in rows:
        key = prompt_key(r)
        if key not in cache:
            cache[key] = len(encode_prompt(tokenizer, r["prompt"]))
        n = cache[key]
        if n > limit:
            raise ConfigError(f"prompt {r.get('id')!r} has {n} tokens, more than the model's context "
                              f"({context_length}) minus max_completion_length ({max_completion_length}); "
                              "shorten or drop it, or lower max_completion_length")
