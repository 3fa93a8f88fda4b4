"""Evaluation: accuracy on the embedded task per level, with its standard error.

Accuracy is the share of completions whose final answer is the problem's, read by the training reward's own
rule (:func:`dppo_core.rewards.math_rewards`, strict: the last ``\\boxed{}``, else ``#### N``, else "the
answer is ..."), so what a run is rewarded for and what its evaluation counts are the same. With k samples per
problem it is pass@1 averaged over the k samples. The standard error treats problems as the sampling unit
(samples of one problem are correlated): ``se = std(per-problem accuracy) / sqrt(n_problems)``.

:func:`evaluate_policy` is the one evaluation of a training run, used by the trainer and by ``dppo bench``
(also for policies trained by TRL): the record that goes to ``eval.jsonl``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dppo_core.config import DPPOConfig

from dppo_core.rollout import SamplingConfig
from dppo_core.tasks import ArithmeticTask, Problem, uses_steps


@dataclass
class LevelResult:
    level: int
    n_problems: int
    samples_per_problem: int
    accuracy: float
    stderr: float
    steps_share: float  # share of completions that show worked steps


@dataclass
class TaskEvaluation:
    """Per-level results of one evaluation, plus every completion for inspection."""

    temperature: float
    levels: dict[int, LevelResult]
    completions: list[dict] = field(default_factory=list)

    @property
    def mean_accuracy(self) -> float:
        return sum(r.accuracy for r in self.levels.values()) / len(self.levels)

    def mean_over(self, levels: Sequence[int]) -> tuple[float, float]:
        """Mean accuracy over some levels, and its standard error (levels are independent samples)."""
        rs = [self.levels[lvl] for lvl in levels]
        mean = sum(r.accuracy for r in rs) / len(rs)
        se = math.sqrt(sum(r.stderr**2 for r in rs)) / len(rs)
        return mean, se

    def table(self) -> str:
        """A fixed-width text table, one row per level."""
        kind = "greedy" if self.temperature == 0 else f"T={self.temperature:g}"
        lines = [f"{'level':>5}  {'problems':>8}  {'accuracy (' + kind + ')':>20}  {'worked steps':>12}"]
        for r in self.levels.values():
            acc = f"{r.accuracy:.3f} ± {r.stderr:.3f}"
            lines.append(f"{r.level:>5}  {r.n_problems:>8}  {acc:>20}  {r.steps_share:>12.2f}")
        lines.append(f"{'mean':>5}  {'':>8}  {self.mean_accuracy:>20.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "temperature": self.temperature,
            "mean_accuracy": self.mean_accuracy,
            "levels": {str(k): vars(v) for k, v in self.levels.items()},
        }


def evaluate_task(
    engine,
    problems: Sequence[Problem] | None = None,
    *,
    n_per_level: int = 200,
    samples_per_problem: int = 1,
    temperature: float = 0.0,
    max_tokens: int = 64,
    seed: int = 0,
    keep_completions: bool = False,
    progress: bool = False,
    chunk_size: int = 64,
    render: Callable[[list[dict[str, str]]], list[dict[str, str]]] | None = None,
) -> TaskEvaluation:
    """Evaluate a rollout engine on the embedded task's test problems.

    Args:
        engine: anything with ``generate(prompts, num_generations, sampling)`` returning a
            :class:`~dppo_core.rollout.RolloutBatch` (e.g. :class:`~dppo_core.rollout.HFRollout`).
        problems: the problems to use; default: the first ``n_per_level`` test problems of every level.
        samples_per_problem: completions per problem (use > 1 with ``temperature > 0``).
        temperature: 0 for greedy decoding, 1 for the policy's own sampling distribution.
        progress: show a progress bar where stderr is a terminal (problems are sent to the engine
            ``chunk_size`` at a time).
        render: turns a problem's messages into the prompt (:func:`dppo_core.data.prompt_renderer`: a system
            prompt, solved examples); default: the problem's own one-message conversation.
    """
    from tqdm.auto import tqdm

    from dppo_core.rewards import math_rewards

    if problems is None:
        problems = ArithmeticTask().test_set(n_per_level)
    groups = []
    desc = "eval " + ("greedy" if temperature == 0 else f"T={temperature:g}")
    with tqdm(total=len(problems), desc=desc, disable=None if progress else True, unit="problem") as bar:
        for start in range(0, len(problems), chunk_size):
            chunk = problems[start : start + chunk_size]
            # a distinct, reproducible seed per chunk, so results do not depend on the chunking alone
            sampling = SamplingConfig(max_tokens=max_tokens, temperature=temperature,
                                      seed=seed * 1_000_003 + start)
            prompts = [render(p.messages()) if render else p.messages() for p in chunk]
            groups.extend(engine.generate(prompts, samples_per_problem, sampling).groups)
            bar.update(len(chunk))
    per_level: dict[int, list[list[float]]] = {}
    steps: dict[int, list[float]] = {}
    completions = []
    rewards = iter(math_rewards([c.text for g in groups for c in g.completions],
                                [str(p.answer) for p, g in zip(problems, groups, strict=True)
                                 for _ in g.completions]))
    for p, group in zip(problems, groups, strict=True):
        scores = []
        for c in group.completions:
            correct = next(rewards)
            scores.append(correct)
            steps.setdefault(p.level, []).append(float(uses_steps(c.text)))
            if keep_completions:
                completions.append({"id": p.id, "level": p.level, "answer": p.answer,
                                    "completion": c.text, "correct": bool(correct)})
        per_level.setdefault(p.level, []).append(scores)
    levels = {}
    for level in sorted(per_level):
        per_problem = [sum(s) / len(s) for s in per_level[level]]
        n = len(per_problem)
        mean = sum(per_problem) / n
        var = sum((x - mean) ** 2 for x in per_problem) / (n - 1) if n > 1 else 0.0
        levels[level] = LevelResult(
            level=level,
            n_problems=n,
            samples_per_problem=samples_per_problem,
            accuracy=mean,
            stderr=math.sqrt(var / n),
            steps_share=sum(steps[level]) / len(steps[level]),
        )
    return TaskEvaluation(temperature=temperature, levels=levels, completions=completions)


# --------------------------------------------------------------------------------------------------
# Benchmarks: pass@1 and pass@k on GSM8K, MATH-500, AIME24, AMC23, Minerva Math, OlympiadBench
# --------------------------------------------------------------------------------------------------
#
# pass@k is the chance that at least one of k samples is correct. With n >= k samples of which c are
# correct, the unbiased estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code") is
#
#     pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)
#
# averaged over problems; the product form avoids huge binomials. pass@1 reduces to c/n, the mean
# accuracy over the n samples.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples, ``c`` of them correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclass
class BenchmarkResult:
    """One benchmark's scores. ``stderr`` is that of pass@1 with problems as the sampling unit."""

    name: str
    n_problems: int
    samples_per_problem: int
    pass_at: dict[int, float]  # k -> mean pass@k over problems (k=1 is the mean accuracy)
    stderr: float
    mean_completion_tokens: float
    truncated_share: float  # share of completions that hit max_tokens

    @property
    def pass_at_1(self) -> float:
        return self.pass_at[1]


@dataclass
class BenchmarkEvaluation:
    """Per-benchmark results, their average, the settings, and every completion for inspection."""

    results: dict[str, BenchmarkResult]
    settings: dict
    completions: list[dict] = field(default_factory=list)

    @property
    def ks(self) -> list[int]:
        return sorted({k for r in self.results.values() for k in r.pass_at})

    def average(self, k: int = 1) -> float:
        """Unweighted mean of pass@k over benchmarks (each set counts once, as papers report)."""
        values = [r.pass_at[k] for r in self.results.values() if k in r.pass_at]
        return sum(values) / len(values) if values else float("nan")

    def table(self) -> str:
        """A fixed-width text table: one row per benchmark, then the average."""
        ks = self.ks
        head = (f"{'benchmark':<14} {'problems':>8} {'samples':>7} "
                + " ".join(f"{f'pass@{k}':>8}" for k in ks))
        lines = [head + f" {'± se':>6} {'tokens':>7} {'cut':>5}"]
        for r in self.results.values():
            cells = " ".join(f"{r.pass_at[k]:>8.3f}" if k in r.pass_at else f"{'-':>8}" for k in ks)
            lines.append(f"{r.name:<14} {r.n_problems:>8} {r.samples_per_problem:>7} {cells} "
                         f"{r.stderr:>6.3f} {r.mean_completion_tokens:>7.1f} {r.truncated_share:>5.2f}")
        if len(self.results) > 1:
            lines.append(f"{'average':<14} {'':>8} {'':>7} "
                         + " ".join(f"{self.average(k):>8.3f}" for k in ks))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "results": {name: {**vars(r), "pass_at": {str(k): v for k, v in r.pass_at.items()}}
                        for name, r in self.results.items()},
            "average": {f"pass@{k}": self.average(k) for k in self.ks},
            "completions": self.completions,
        }


def _scored_completions(name: str, chunk: Sequence, batch, reward_fn) -> list[dict]:
    """One record per completion of ``batch`` (the problems of ``chunk``, in order), with its reward."""
    texts = [c.text for g in batch.groups for c in g.completions]
    answers = [r.answer for r, g in zip(chunk, batch.groups, strict=True) for _ in g.completions]
    scores = iter(reward_fn(texts, answers))
    return [{"benchmark": name, "id": r.id, "answer": r.answer, "completion": comp.text,
             "reward": next(scores), "tokens": comp.length, "finish_reason": comp.finish_reason}
            for r, g in zip(chunk, batch.groups, strict=True) for comp in g.completions]


def _benchmark_result(name: str, correct_counts: list[int], lengths: list[int], cut: int, n: int,
                      ks: Sequence[int]) -> BenchmarkResult:
    """pass@k, the standard error of pass@1 over problems, and the completions' lengths, for one benchmark."""
    per_problem = [c / n for c in correct_counts]
    m = len(per_problem)
    mean = sum(per_problem) / m if m else float("nan")
    var = sum((x - mean) ** 2 for x in per_problem) / (m - 1) if m > 1 else 0.0
    return BenchmarkResult(
        name=name,
        n_problems=m,
        samples_per_problem=n,
        pass_at={k: sum(pass_at_k(n, c, k) for c in correct_counts) / m if m else float("nan") for k in ks},
        stderr=math.sqrt(var / m) if m else float("nan"),
        mean_completion_tokens=sum(lengths) / len(lengths) if lengths else 0.0,
        truncated_share=cut / len(lengths) if lengths else 0.0,
    )


def evaluate_benchmarks(
    engine,
    benchmarks: Mapping[str, Sequence],
    *,
    samples_per_problem: int = 1,
    ks: Sequence[int] = (1,),
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 1024,
    seed: int = 0,
    chunk_size: int = 32,
    reward_fn=None,
    progress: bool = True,
    extraction: str = "lenient",
) -> BenchmarkEvaluation:
    """pass@1 and pass@k of a rollout engine on benchmarks.

    Args:
        engine: anything with ``generate(prompts, num_generations, sampling)`` returning a
            :class:`~dppo_core.rollout.RolloutBatch` (:class:`~dppo_core.rollout.HFRollout`, or a vLLM
            engine).
        benchmarks: name -> records (:class:`~dppo_core.benchmark_data.BenchmarkRecord`, from
            :func:`~dppo_core.benchmark_data.load_benchmark`). Each problem is sent as one chat user message.
        samples_per_problem: n samples per problem; pass@1 is the mean over them. Every k in ``ks`` must be
            <= n (use ``temperature > 0`` for k > 1, greedy samples are all alike).
        chunk_size: problems per ``generate`` call (the progress bar advances per chunk).
        reward_fn: ``fn(completions, answers) -> list[float]``; default :func:`dppo_core.rewards.math_rewards`
            with ``extraction``.
        extraction: how the default reward finds a completion's answer
            (:func:`dppo_core.grading.extract_answer`): ``"lenient"`` (default: the boxed answer, else the
            final answer stated in the last sentence or display, as math-verify finds it) or ``"strict"`` (the
            RL reward's: boxed, ``####`` or "the answer is"). Recorded in ``settings["extraction"]``
            (``"custom"`` with a ``reward_fn``).
    """
    import functools

    from tqdm.auto import tqdm

    from dppo_core.grading import check_mode
    from dppo_core.rewards import math_rewards

    ks = sorted({1, *ks})
    if ks[-1] > samples_per_problem:
        raise ValueError(f"pass@{ks[-1]} needs at least {ks[-1]} samples per problem, got "
                         f"samples_per_problem={samples_per_problem}; raise it or drop that k")
    if temperature == 0 and samples_per_problem > 1:
        raise ValueError("greedy decoding (temperature=0) gives the same completion every time; use "
                         "samples_per_problem=1 or a temperature > 0")
    check_mode(extraction)
    settings = {"samples_per_problem": samples_per_problem, "ks": ks, "temperature": temperature,
                "top_p": top_p, "max_tokens": max_tokens, "seed": seed,
                "engine": getattr(engine, "name", type(engine).__name__),
                "extraction": extraction if reward_fn is None else "custom"}
    reward_fn = reward_fn or functools.partial(math_rewards, mode=extraction)
    total = sum(len(records) for records in benchmarks.values())
    # None: on a terminal
    bar = tqdm(total=total, desc="eval", unit="problem", disable=None if progress else True)
    results: dict[str, BenchmarkResult] = {}
    completions: list[dict] = []
    for name, records in benchmarks.items():
        bar.set_postfix_str(name)
        records = list(records)
        correct_counts, lengths, cut = [], [], 0
        for start in range(0, len(records), chunk_size):
            chunk = records[start : start + chunk_size]
            # a distinct seed per chunk, so sampled runs do not repeat one random stream per chunk
            sampling = SamplingConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      seed=seed + start)
            batch = engine.generate([r.messages() for r in chunk], samples_per_problem, sampling)
            rows = _scored_completions(name, chunk, batch, reward_fn)
            completions += rows
            ends = itertools.accumulate(len(g.completions) for g in batch.groups)
            correct_counts += [sum(int(r["reward"] == 1.0) for r in rows[end - len(g.completions): end])
                               for g, end in zip(batch.groups, ends, strict=True)]
            lengths += [r["tokens"] for r in rows]
            cut += sum(r["finish_reason"] == "length" for r in rows)
            bar.update(len(chunk))
        results[name] = _benchmark_result(name, correct_counts, lengths, cut, samples_per_problem, ks)
    bar.close()
    return BenchmarkEvaluation(results=results, settings=settings, completions=completions)


# --------------------------------------------------------------------------------------------------
# The evaluation of a training run: one record per evaluation, in eval.jsonl
# --------------------------------------------------------------------------------------------------


def evaluate_policy(config: DPPOConfig, engine: Any, step: int, benchmarks: Sequence[str] = (),
                    benchmark_limit: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Greedy and sampled held-out accuracy of the policy behind ``engine``: the record a run logs at
    ``step``.

    The embedded task (``config.task == "arithmetic"``): the first ``eval_problems_per_level`` test problems
    of every level in ``eval_levels`` (default ``train_levels``), greedy (one sample) and at T=1
    (``eval_samples`` samples per problem). ``{kind}_accuracy`` / ``{kind}_stderr`` /
    ``{kind}_steps_share`` are over the trained levels among them, ``{kind}_L{level}`` and
    ``{kind}_L{level}_stderr`` per evaluated level, for kind ``greedy`` and ``sampled``.

    Any other task: pass@1 on ``benchmarks`` (their first ``benchmark_limit`` problems each), greedy and at
    T=1; ``{kind}_accuracy`` is the mean over benchmarks, ``{kind}_<benchmark>`` per benchmark. Without
    benchmarks the record is only ``{"step": step}``.

    Args:
        config: the run's configuration (task, levels, problems, samples, generation length, seed).
        engine: a rollout engine serving the policy (``generate(prompts, num_generations, sampling)``):
            the run's own, or :class:`~dppo_core.rollout.HFRollout` around a model.
        step: the optimizer step the policy is at (the record's ``step``).
        progress: progress bars where stderr is a terminal (quiet in logs, CI and tests).
    """
    if config.task == "arithmetic":
        return _task_record(config, engine, step, progress)
    if benchmarks:
        return _benchmark_record(config, engine, step, benchmarks, benchmark_limit, progress)
    return {"step": step}


def _task_record(config: DPPOConfig, engine: Any, step: int, progress: bool = False) -> dict[str, Any]:
    from dppo_core.data import prompt_renderer

    c = config
    levels = c.eval_levels or c.train_levels
    task = ArithmeticTask(levels)  # built once per evaluation, not once per level
    problems = [p for lvl in levels for p in task.test(lvl, c.eval_problems_per_level)]
    render = prompt_renderer(c)  # the prompts as training renders them: a system prompt, worked examples
    greedy = evaluate_task(engine, problems, temperature=0.0, max_tokens=c.max_completion_length, seed=c.seed,
                           progress=progress, render=render)
    sampled = evaluate_task(engine, problems, temperature=1.0, samples_per_problem=c.eval_samples,
                            max_tokens=c.max_completion_length, seed=c.seed, progress=progress, render=render)
    record: dict[str, Any] = {"step": step}
    trained = [lvl for lvl in c.train_levels if lvl in levels] or list(levels)
    for name, ev in (("greedy", greedy), ("sampled", sampled)):
        # the headline accuracy is over the trained levels; every evaluated level is logged
        mean, se = ev.mean_over(trained)
        record[f"{name}_accuracy"] = mean
        record[f"{name}_stderr"] = se
        record[f"{name}_steps_share"] = sum(ev.levels[lvl].steps_share for lvl in trained) / len(trained)
        for lvl in levels:
            record[f"{name}_L{lvl}"] = ev.levels[lvl].accuracy
            record[f"{name}_L{lvl}_stderr"] = ev.levels[lvl].stderr
    return record


def _benchmark_record(config: DPPOConfig, engine: Any, step: int, benchmarks: Sequence[str],
                      limit: int | None, progress: bool = False) -> dict[str, Any]:
    from dppo_core.benchmark_data import load_benchmark

    data = {name: load_benchmark(name, limit=limit) for name in benchmarks}
    record: dict[str, Any] = {"step": step}
    for kind, temperature, samples in (("greedy", 0.0, 1), ("sampled", 1.0, config.eval_samples)):
        ev = evaluate_benchmarks(engine, data, samples_per_problem=samples, temperature=temperature,
                                 max_tokens=config.max_completion_length, seed=config.seed, progress=progress)
        record[f"{kind}_accuracy"] = ev.average(1)
        record[f"{kind}_stderr"] = (math.sqrt(sum(r.stderr ** 2 for r in ev.results.values()))
                                    / len(ev.results))
        for name, r in ev.results.items():
            record[f"{kind}_{name}"] = r.pass_at_1
            record[f"{kind}_{name}_stderr"] = r.stderr
    return record
