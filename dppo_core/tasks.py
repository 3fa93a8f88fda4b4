"""The embedded arithmetic task: prompts, answers, worked solutions and a deterministic split.

A tiny model trained for a few CPU minutes cannot do competition math, but it can learn arithmetic with a
spread of difficulty, and a spread is what GRPO learns from and what DPPO's prompt pruning ranks. The task
has five levels, from one-step small-number problems to multi-step ones, and a sixth beyond the tiny model's
reach:

=====  ====================  ====================================
level  form                  example
=====  ====================  ====================================
1      a+b (1 digit each)    ``7+5``
2      a+b (2 digit + 1)     ``47+8``
3      a+b (2 digit each)    ``75+72``
4      a-b or a*b            ``83-47``, ``47*6``
5      (a+b)*c or (a-b)*c    ``(23+14)*6``
6      a*b (2 digit each)    ``47*36``
=====  ====================  ====================================

Levels 1-5 (:data:`LEVELS`) are the task the tiny model is built and warm-started on, and what
``ArithmeticTask()`` holds by default. Level 6 (:data:`EXTRA_LEVELS`) is only there when asked for
(``ArithmeticTask(levels=[..., 6])``, ``train_levels: [..., 6]``): the warm start never saw a two-digit by
two-digit product, so its prompts are the ones a real training set has that the model never solves. Adding it
changed no problem, split or order of levels 1-5, and nothing built from the default task.

Every problem has two reference solutions: a *direct* one (only ``\\boxed{answer}``) and a *worked* one
that splits the work into easier sub-operations before boxing the answer, e.g.
``75+72: 75+70=145. 145+2=147. \\boxed{147}``. Level 1 has nothing to split: its worked solution writes
its one step out (``7+5: 7+5=12. \\boxed{12}``), so every level has both styles and a policy that learns to
show its work on the hard levels has a reliable worked form on the easy one too. (A third form, the *equation*
``75+72=147. \\boxed{147}``, is what a pretrained model is shown as a solved example: ``few_shot``.)

The train/test split is a pure function of the problem text (a stable hash), so it is the same on every
machine and for every seed; test problems are never used for training.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: The levels of the default task: what the tiny model's tokenizer and warm start are built on.
LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5)
#: Levels beyond the warm start's reach, in a task only when named (``ArithmeticTask(levels=...)``).
EXTRA_LEVELS: tuple[int, ...] = (6,)
#: Every level a task or a configuration may name.
ALL_LEVELS: tuple[int, ...] = LEVELS + EXTRA_LEVELS
#: Share of each level's problem space held out for testing (by stable hash of the question).
TEST_FRACTION = 0.2
#: The instruction appended to every question; asks for the answer in ``\boxed{}``.
INSTRUCTION = "Put the final answer in \\boxed{}."
SOLUTION_STYLES = ("direct", "steps", "equation")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem. ``question`` is the bare expression, e.g. ``"75+72"``."""

    level: int
    question: str
    answer: int

    @property
    def id(self) -> str:
        return f"L{self.level}:{self.question}"

    @property
    def prompt(self) -> str:
        """The user message: the question and the instruction to box the answer."""
        return f"What is {self.question}? {INSTRUCTION}"

    @property
    def is_test(self) -> bool:
        return _stable_fraction(self.question) < TEST_FRACTION

    def messages(self) -> list[dict[str, str]]:
        """The prompt in chat format, as a one-message conversation."""
        return [{"role": "user", "content": self.prompt}]

    def solution(self, style: str = "steps") -> str:
        """A reference completion: ``"direct"`` (just the boxed answer), ``"steps"`` (worked steps) or
        ``"equation"`` (the question, its value and the boxed answer: ``75+72=147. \\boxed{147}``, the form a
        pretrained model imitates from one example; :func:`dppo_core.data.few_shot_turns`)."""
        if style not in SOLUTION_STYLES:
            raise ValueError(f"style must be one of {SOLUTION_STYLES}, got {style!r}")
        boxed = f"\\boxed{{{self.answer}}}"
        if style == "direct":
            return boxed
        if style == "equation":
            return f"{self.question}={self.answer}. {boxed}"
        steps = _worked_steps(self)
        return f"{self.question}: {' '.join(steps)} {boxed}" if steps else boxed

    def to_record(self) -> dict:
        """A dataset row in the conversational format TRL uses (``prompt`` is a message list)."""
        return {
            "id": self.id,
            "prompt": self.messages(),
            "answer": str(self.answer),
            "level": self.level,
        }


def _stable_fraction(text: str) -> float:
    """A number in [0, 1) that depends only on ``text`` (not on Python's per-process hash seed)."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _add_steps(a: int, b: int) -> list[str]:
    """Steps for a+b with b split into tens and units (``75+72: 75+70=145. 145+2=147.``)."""
    if b < 10:
        # 47+8: add the units first, then the tens of a.
        tens, units = divmod(a, 10)
        if tens == 0:
            return []
        return [f"{units}+{b}={units + b}.", f"{tens * 10}+{units + b}={a + b}."]
    tens_b, units_b = divmod(b, 10)
    first = a + tens_b * 10
    steps = [f"{a}+{tens_b * 10}={first}."]
    if units_b:
        steps.append(f"{first}+{units_b}={first + units_b}.")
    return steps


def _sub_steps(a: int, b: int) -> list[str]:
    """Steps for a-b with b split into tens and units (``83-47: 83-40=43. 43-7=36.``)."""
    tens_b, units_b = divmod(b, 10)
    first = a - tens_b * 10
    steps = [f"{a}-{tens_b * 10}={first}."]
    if units_b:
        steps.append(f"{first}-{units_b}={first - units_b}.")
    return steps


def _mul_steps(a: int, c: int) -> list[str]:
    """Steps for a*c (a two-digit) by the distributive law (``47*6: 40*6=240. 7*6=42. 240+42=282.``)."""
    tens, units = divmod(a, 10)
    if units == 0:
        return [f"{a}*{c}={a * c}."]
    return [f"{tens * 10}*{c}={tens * 10 * c}.", f"{units}*{c}={units * c}.",
            f"{tens * 10 * c}+{units * c}={a * c}."]


def _worked_steps(p: Problem) -> list[str]:
    q = p.question
    if p.level == 1:
        return [f"{q}={p.answer}."]
    if p.level in (2, 3):
        a, b = map(int, q.split("+"))
        return _add_steps(a, b)
    if p.level == 6:
        # 47*36: 40*36=1440. 7*36=252. 1440+252=1692. (level 4's distributive steps, the multiplier two-digit)
        a, c = map(int, q.split("*"))
        return _mul_steps(a, c)
    if p.level == 4:
        if "*" in q:
            a, c = map(int, q.split("*"))
            return _mul_steps(a, c)
        a, b = map(int, q.split("-"))
        return _sub_steps(a, b)
    # level 5: (a+b)*c or (a-b)*c
    inner, c_text = q[1:].split(")*")
    c = int(c_text)
    op = "+" if "+" in inner else "-"
    a, b = map(int, inner.split(op))
    s = a + b if op == "+" else a - b
    steps = [f"{a}{op}{b}={s}."]
    if s >= 10:
        steps.append(f"{s}*{c}:")
        steps.extend(_mul_steps(s, c))
    else:
        steps.append(f"{s}*{c}={s * c}.")
    return steps


def _level_space(level: int) -> Iterator[Problem]:
    """Every problem of a level, in a fixed order."""
    if level == 1:
        for a in range(10):
            for b in range(10):
                yield Problem(1, f"{a}+{b}", a + b)
    elif level == 2:
        for a in range(10, 100):
            for b in range(1, 10):
                yield Problem(2, f"{a}+{b}", a + b)
    elif level == 3:
        for a in range(10, 100):
            for b in range(10, 100):
                yield Problem(3, f"{a}+{b}", a + b)
    elif level == 4:
        for a in range(10, 100):
            for b in range(10, a):
                yield Problem(4, f"{a}-{b}", a - b)
            for c in range(2, 10):
                yield Problem(4, f"{a}*{c}", a * c)
    elif level == 5:
        for a in range(10, 50):
            for b in range(2, 50):
                for c in range(2, 10):
                    yield Problem(5, f"({a}+{b})*{c}", (a + b) * c)
                    if b < a:
                        yield Problem(5, f"({a}-{b})*{c}", (a - b) * c)
    elif level == 6:
        for a in range(10, 100):
            for b in range(10, 100):
                yield Problem(6, f"{a}*{b}", a * b)
    else:
        raise ValueError(f"level must be one of {ALL_LEVELS}, got {level!r}")


class ArithmeticTask:
    """The embedded task: per level, the train and test problems.

    Args:
        levels: the levels to include (default :data:`LEVELS`, the five the tiny model is built on; any of
            :data:`ALL_LEVELS` may be named).

    The split is fixed (a stable hash of the question decides), so ``ArithmeticTask().test(3)`` is the
    same list on every machine. Sampling methods take an explicit ``random.Random`` so callers control
    reproducibility.
    """

    def __init__(self, levels: Sequence[int] = LEVELS):
        bad = [lvl for lvl in levels if lvl not in ALL_LEVELS]
        if bad or not levels:
            raise ValueError(f"levels must be a non-empty subset of {ALL_LEVELS}, got {list(levels)!r}")
        self.levels = tuple(sorted(set(levels)))
        self._train: dict[int, list[Problem]] = {}
        self._test: dict[int, list[Problem]] = {}
        for level in self.levels:
            space = list(_level_space(level))
            self._train[level] = [p for p in space if not p.is_test]
            self._test[level] = [p for p in space if p.is_test]

    def train(self, level: int) -> list[Problem]:
        """All training problems of ``level``."""
        return self._train[self._check(level)]

    def test(self, level: int, n: int | None = None) -> list[Problem]:
        """The first ``n`` test problems of ``level`` in a fixed shuffled order (all if ``n`` is None)."""
        problems = self._test[self._check(level)]
        order = sorted(problems, key=lambda p: _stable_fraction("order:" + p.question))
        return order if n is None else order[:n]

    def test_set(self, n_per_level: int | None = None) -> list[Problem]:
        """Test problems of every level, ``n_per_level`` each (fewer where a level has fewer)."""
        return [p for level in self.levels for p in self.test(level, n_per_level)]

    def sample_train(
        self, rng: random.Random, n: int, level_weights: Sequence[float] | None = None
    ) -> list[Problem]:
        """``n`` training problems: a level drawn by ``level_weights``, then a problem uniformly."""
        weights = list(level_weights) if level_weights is not None else [1.0] * len(self.levels)
        if len(weights) != len(self.levels) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(
                f"level_weights must be {len(self.levels)} non-negative numbers with a positive sum "
                f"(one per level {self.levels}), got {weights!r}"
            )
        levels = rng.choices(self.levels, weights=weights, k=n)
        return [rng.choice(self._train[level]) for level in levels]

    def _check(self, level: int) -> int:
        if level not in self._train:
            raise ValueError(f"level {level!r} is not in this task's levels {self.levels}")
        return level

    def __repr__(self) -> str:
        sizes = ", ".join(f"L{lvl}: {len(self._train[lvl])}/{len(self._test[lvl])}" for lvl in self.levels)
        return f"ArithmeticTask(train/test {sizes})"


def parse_boxed_int(text: str) -> int | None:
    """The integer inside the last ``\\boxed{...}`` of ``text``, or None.

    A strict, fast check for the embedded task, where answers are integers. General answer extraction
    and equivalence (fractions, LaTeX, units) live in :mod:`dppo_core.grading`.
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = text.find("}", start)
    if end < 0:
        return None
    inner = text[start + len("\\boxed{") : end].strip()
    try:
        return int(inner)
    except ValueError:
        return None


def uses_steps(completion: str) -> bool:
    """Whether a completion shows worked steps before its answer (anything but a bare boxed answer)."""
    head = completion.split("\\boxed{", 1)[0]
    return "=" in head

