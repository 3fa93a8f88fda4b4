"""The bench's methods, its presets and the configuration of every run.

Every method starts from its preset's base training preset with the preset's overrides; only what
:data:`METHOD_OVERRIDES` (and the preset's ``method_overrides``) lists differs. DPPO's pruning is not
copied here: it is what the ``tiny-dppo`` training preset states on top of ``tiny-grpo``
(:func:`dppo_core.config.preset_overrides`), so the bench and ``dppo train --preset tiny-dppo`` prune alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dppo_core.config import DPPOConfig, preset_overrides
from dppo_core.config import preset as training_preset
from dppo_core.tools.bench.cpu_settings import (
    CPU_BASELINES_SETTING,
    CPU_BENCH_METHODS,
    CPU_BENCH_SETTING,
    CPU_REALISTIC_METHOD_OVERRIDES,
    CPU_REALISTIC_METHODS,
    CPU_REALISTIC_SETTING,
    CPU_REALISTIC_WEIGHTS,
    PERSISTENCE_METHODS,
    PERSISTENCE_SHARES,
    SMOLLM2_REALISTIC_LEVELS,
    SMOLLM2_REALISTIC_WEIGHTS,
    persistence_steps,
)

#: Every method the bench knows, in the order of the plots' colours.
METHODS: tuple[str, ...] = ("grpo", "dppo", "cppo", "greso", "trl_grpo", "trl_dppo", "grpo_skip", "grpo_half",
                            "pods", "dppo_paper", "dppo_budget", "grpo_skip_filtered", "dapo_sampling",
                            "greso_sampling", "dppo_pilot", "dppo_budget_pilot", "grpo_skip_matched",
                            "dapo_oversampled")
#: The methods a :class:`BenchPreset` runs unless it names its own.
DEFAULT_METHODS: tuple[str, ...] = ("grpo", "dppo", "cppo", "greso", "trl_grpo")
PHASES: tuple[str, ...] = ("rollout", "reward", "prune", "pack", "update", "sync")
#: The target accuracy is this fraction of GRPO's final sampled accuracy.
TARGET_FRACTION = 0.95
#: ``model: tiny-untrained`` in a bench preset: the embedded tiny model before its warm start (built in
#: seconds).
UNTRAINED_TINY = "tiny-untrained"
#: The tiny-dppo training preset's pruning: what it states on top of tiny-grpo, its run directory aside.
DPPO_PRUNING: dict[str, Any] = {k: v for k, v in preset_overrides("tiny-dppo").items() if k != "output_dir"}
#: The pilot of the ``*_pilot`` methods (``pilot_size``, ``continue_scheme``, ``continue_probability``).
PILOT: dict[str, Any] = {"pilot_size": 2, "continue_scheme": "posterior", "continue_probability": 0.1}
#: What each method changes on the preset's base configuration; every other field is the same for all.
METHOD_OVERRIDES: dict[str, dict[str, Any]] = {
    "grpo": {"pruning": "none"},
    # the tiny-dppo preset's pruning (unbiased, fixed-size sampling), plus dense packing of what is kept
    "dppo": {**DPPO_PRUNING, "packing": True, "max_tokens_per_row": 128},
    # dppo spending what the prompt stage saves as a rollout budget instead of a full batch: only the kept
    # prompts of each step's candidates are rolled out (no dense refill), so fewer rollouts and a smaller
    # batch per step
    "dppo_budget": {**DPPO_PRUNING, "dense_prompts": False, "packing": True, "max_tokens_per_row": 128},
    # the biased baselines at DPPO's nominal rates: CPPO keeps the top half of each group by |A|; GRESO
    # skips a prompt whose last group was all right or all wrong with probability 0.5
    "cppo": {"pruning": "cppo", "completion_prune_rate": 0.5},
    "greso": {"pruning": "greso", "prompt_prune_rate": 0.5},
    "trl_grpo": {"pruning": "none"},  # the grpo configuration, run by TRL's GRPOTrainer
    # dppo's configuration (see DERIVED_METHODS), run by TRL's GRPOTrainer with DPPO's estimator; it pads
    # its batches as TRL does (no packing), and TRL draws a fixed generation batch (no dense prompts)
    "trl_dppo": {"packing": False, "dense_prompts": False},
    # the strong GRPO baseline: drops exactly the completions whose loss is identically zero (A = 0 with
    # beta = 0; the estimator with both prune rates 0 gives them probability 0 and every other weight 1) and
    # packs what it trains, like dppo; its gradient equals grpo's (tests/unit/test_exact_expectation.py)
    "grpo_skip": {"pruning": "dppo", "prompt_prune_rate": 0.0, "completion_prune_rate": 0.0,
                  "drop_zero_advantage": True, "packing": True, "max_tokens_per_row": 128},
    # grpo with half the prompts per step (HALF_BATCH_METHODS): is the full batch more than early training
    # needs?
    "grpo_half": {"pruning": "none"},
    # PODS (Xu et al. 2025): roll out G, train on the half whose rewards vary most, no weights
    "pods": {"pruning": "pods", "completion_prune_rate": 0.5},
    # DPPO as the paper has it, made unbiased (what dppo was before the variance-aware schemes): prompts by
    # their last group's mean |A| (the lower half kept with 1 - r), completions proportional to |A|,
    # systematic fixed-size sampling in a random order, no dense prompts; packed like dppo
    "dppo_paper": {"pruning": "dppo", "prompt_prune_rate": 0.5, "prompt_scheme": "paper",
                   "min_prompt_keep_prob": 0.2, "completion_prune_rate": 0.5,
                   "completion_scheme": "proportional", "min_completion_keep_prob": 0.2,
                   "drop_zero_advantage": True, "fixed_size_sampling": True, "packing": True,
                   "max_tokens_per_row": 128},
    # the baselines practitioners run instead, each a rollout plan (dppo_core.plans): grpo_skip on a pool
    # filtered offline by one group per prompt of the initial model; grpo_skip with DAPO's dynamic sampling (a
    # changed objective: informative groups only); and that with GRESO's skip before each round, by GRESO's
    # own adaptive rule (skip probability 1 - max(p^z, 0.01) after z all-equal groups in a row, p adapted
    # toward 25% zero-variance groups: the authors' setting; the committed cpu-realistic comparison ran a
    # constant skip of 0.8 instead)
    "grpo_skip_filtered": {"rollout_plan": "offline_filter"},
    "dapo_sampling": {"rollout_plan": "dynamic_sampling"},
    "greso_sampling": {"pruning": "greso", "prompt_prune_rate": 0.0, "greso_target_zero_variance": 0.25,
                       "packing": True, "max_tokens_per_row": 128, "rollout_plan": "dynamic_sampling"},
    # dppo and dppo_budget with a pilot (DERIVED_METHODS): 2 of each group's 8 first, an all-equal pilot
    # continued with c_q = max(0.1, P(the rest makes the group informative)), chosen before the comparison ran
    # by the replay in benchmarks/pilot_replay.py: the setting with the least variance factor among those that
    # cut 25% of the tokens
    "dppo_pilot": PILOT, "dppo_budget_pilot": PILOT,
    # the batch-matched strong baseline (BATCH_MATCHED): grpo_skip rolling out as many prompts per step as
    # dppo_budget does (matched_prompts_per_step), so that a rollout budget's gain is not credited with a
    # smaller batch's
    "grpo_skip_matched": {},
    # DAPO's dynamic sampling as its recipe runs it (a 3x generation batch per round, up to 10 rounds) on
    # grpo_skip
    "dapo_oversampled": {"rollout_plan": "dapo_oversampled"},
}
#: Methods that run with half the preset's ``prompts_per_step`` (rounded down, at least 1).
HALF_BATCH_METHODS: frozenset[str] = frozenset({"grpo_half"})
#: The methods that roll out fewer prompts per step than the preset's ``prompts_per_step``, and the baseline
#: each is measured against at the same rollouts per step: grpo_skip (the strong GRPO) given exactly as many
#: prompts per step (:func:`matched_prompts_per_step`). A smaller batch alone is often faster to a target on
#: these workloads (a gain every method can have), so a rollout budget's speedup is only its own against this
#: baseline; the bench checks from the logs that both rolled out the same number of prompts
#: (:func:`check_batch_matched`).
BATCH_MATCHED: dict[str, str] = {"dppo_budget": "grpo_skip_matched", "dppo_budget_pilot": "grpo_skip_matched",
                                 "grpo_half": "grpo_skip_matched"}
#: The method whose rolled-out prompts per step the batch-matched baseline is given.
MATCHED_TO = "dppo_budget"
MATCHED_BASELINES: frozenset[str] = frozenset(BATCH_MATCHED.values())
#: The baselines every speedup is also reported against, when they ran: grpo as the frameworks run it, and
#: grpo_skip, which skips the work whose loss is exactly zero (the stronger baseline).
REFERENCE_METHODS: tuple[str, ...] = ("grpo", "grpo_skip")
#: Methods whose configuration is another method's (with that method's preset and command-line settings)
#: with their own :data:`METHOD_OVERRIDES` on top.
DERIVED_METHODS: dict[str, str] = {"trl_dppo": "dppo", "grpo_skip_filtered": "grpo_skip",
                                   "dapo_sampling": "grpo_skip", "dppo_pilot": "dppo",
                                   "dppo_budget_pilot": "dppo_budget", "grpo_skip_matched": "grpo_skip",
                                   "dapo_oversampled": "grpo_skip"}


class BenchError(ValueError):
    """A bench request cannot be run as given; the message says why and how to fix it."""


@dataclass(frozen=True)
class BenchPreset:
    """A named comparison: the training preset every method starts from, what all methods share, which run.

    Args:
        name: the name ``--preset`` takes.
        description: one line for ``--help`` and ``bench.json``.
        base: a training preset (``dppo_core/presets/NAME.yaml``) that every method starts from.
        overrides: DPPOConfig fields set for every method (``model: tiny-untrained`` builds the untrained tiny
            model).
        methods: the methods run by default (``--methods`` picks a subset; ``grpo`` is always needed).
        seeds: the seeds run by default (``--seeds``).
        method_overrides: per method, fields set on top of :data:`METHOD_OVERRIDES`.
        requires_gpu: refuse to start without a CUDA GPU.
        eval_benchmarks: for a task other than the embedded one, evaluate pass@1 on these benchmarks.
        eval_limit: the first this many problems of each of ``eval_benchmarks``.
        runtime: what a run of the whole preset takes, for the help text.
        kind: ``"accuracy"`` (train, evaluate, time to target) or ``"systems"`` (step times only, on a model
            with random weights and a stand-in reward: :mod:`dppo_core.tools.bench.systems`).
    """

    name: str
    description: str
    base: str
    overrides: Mapping[str, Any]
    methods: tuple[str, ...] = DEFAULT_METHODS
    seeds: tuple[int, ...] = (0,)
    method_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    requires_gpu: bool = False
    eval_benchmarks: tuple[str, ...] = ()
    eval_limit: int = 100
    runtime: str = ""
    kind: str = "accuracy"

    def shared_config(self) -> DPPOConfig:
        """What every method starts from: the base training preset with the bench's shared ``overrides``."""
        return training_preset(self.base).with_overrides(dict(self.overrides))


#: How long `make demo` (`dppo demo`) takes once the warm-started model is there: 79-81 s in all over three
#: runs on an idle 2-core machine (AVX2 kernels), 80 s with the current rollout loop (docs/quickstart.md). The
#: one source of that time: the demo prints it as it starts (the preset's ``runtime``), ``dppo bench --list``
#: lists it, and tests/repo/test_readme.py keeps the README's quick start saying the same.
DEMO_TIME = "about 1.5 minutes"


def persistence_preset(share: float) -> BenchPreset:
    """``cpu-persist-NN``: cpu-realistic with level 6 (never solved) at ``share`` of the pool's weight,
    trained for :func:`persistence_steps` steps."""
    rest = [w * (1 - share) / (1 - CPU_REALISTIC_WEIGHTS[-1]) for w in CPU_REALISTIC_WEIGHTS[:-1]]
    steps = persistence_steps(share)
    return BenchPreset(
        f"cpu-persist-{round(100 * share)}",
        f"the persistence map (issue #63): cpu-realistic with {share:.0%} of the pool's weight on level 6 "
        f"(never solved: exactly persistent), the other levels in cpu-realistic's proportions, {steps} steps",
        base="tiny-grpo", methods=PERSISTENCE_METHODS,
        overrides={**CPU_REALISTIC_SETTING, "level_weights": [round(w, 4) for w in (*rest, share)],
                   "max_steps": steps, "eval_steps": max(1, steps // 12)},
        method_overrides=CPU_REALISTIC_METHOD_OVERRIDES, seeds=(1, 2, 3, 4, 5),
        runtime=f"about {round(26 + 42 * steps / 180)} minutes on 2 CPU cores with --methods grpo_skip "
                "grpo_skip_matched dppo_budget, 5 seeds (measured 51 at 50%, 68 at 70%, 97 at 85%; 30%: by "
                "steps)")


#: The learning rate of every smollm2-realistic method: what benchmarks/tune_lr.py's rule chose for each
#: of them (grid 1e-4 to 8e-4, seed 0, 30 steps; benchmarks/results/smollm2-realistic/tuning/tuning.md).
#: The smollm2-grpo preset's 2e-4 was set by hand on a level-3 pool.
SMOLLM2_REALISTIC_LEARNING_RATE = 4e-4
#: The smollm2-realistic bench's shared setting on top of the smollm2-grpo preset: the pool of
#: :data:`~dppo_core.tools.bench.cpu_settings.SMOLLM2_REALISTIC_WEIGHTS`, 60 steps, no KL term (the preset's),
#: two threads (the bench runs one run at a time: alone, two threads make a step 1.7x faster,
#: benchmarks/results/smollm2/threads.json), evaluated every 5 steps (13 points) on the held-out problems of
#: levels 1-5 (40 of each; level 1 has 21: 181 problems), greedy and one sample at T = 1 (a point's standard
#: error 0.026 greedy and 0.028 sampled at step 0). The prompt's 93 tokens share 72 (template, example),
#: computed once per chunk (:mod:`dppo_core.engines.prompt_rows`); evaluation time is not training time.
#: DPPO's prompt scheme is cpu-realistic's ``fitted``, chosen on the tiny model's pool and not chosen again
#: here. The learning rate, :data:`SMOLLM2_REALISTIC_LEARNING_RATE`, is every method's choice on seed 0.
SMOLLM2_REALISTIC_SETTING: dict[str, Any] = {
    "train_levels": list(SMOLLM2_REALISTIC_LEVELS), "level_weights": list(SMOLLM2_REALISTIC_WEIGHTS),
    "train_pool_size": 256, "max_steps": 60, "eval_steps": 5, "eval_levels": [1, 2, 3, 4, 5],
    "eval_problems_per_level": 40, "eval_samples": 1, "save_steps": 0, "beta": 0.0, "cpu_threads": 2,
    "learning_rate": SMOLLM2_REALISTIC_LEARNING_RATE}
SMOLLM2_REALISTIC_RUNTIME = ("about 4 hours on 2 CPU cores (12 runs of about 20 minutes); --seeds 1 for a "
                             "first look")

BENCH_PRESETS: dict[str, BenchPreset] = {p.name: p for p in (
    BenchPreset(
        "cpu-smoke", "every method for 3 tiny steps on the untrained tiny model: checks the pipeline, not "
                     "the methods",
        base="tiny-grpo", methods=METHODS,
        overrides={"model": UNTRAINED_TINY, "train_levels": [2, 3], "train_pool_size": 8,
                   "prompts_per_step": 4, "num_generations": 4, "max_completion_length": 16,
                   "micro_batch_size": 16, "max_steps": 3, "eval_steps": 1, "eval_problems_per_level": 4,
                   "eval_samples": 1, "save_steps": 0},
        seeds=(0, 1), runtime="about a minute on 2 CPU cores"),
    BenchPreset(
        "demo", "GRPO against DPPO on the warm-started tiny model, 30 steps of 16 prompts (what `dppo demo` "
                "runs)",
        base="tiny-grpo", methods=("grpo", "dppo"),
        overrides={"train_pool_size": 128, "prompts_per_step": 16, "max_steps": 30, "eval_steps": 10,
                   "eval_problems_per_level": 50, "eval_samples": 2, "save_steps": 0,
                   **CPU_BENCH_SETTING},
        method_overrides=CPU_BENCH_METHODS, runtime=f"{DEMO_TIME} on 2 CPU cores, after the warm start"),
    BenchPreset(
        "cpu-full", "all five methods on the tiny-grpo setting without its KL term, a pool of 256 prompts, "
                    "60 steps, two seeds",
        base="tiny-grpo", methods=DEFAULT_METHODS,
        overrides={"train_pool_size": 256, "max_steps": 60, "eval_steps": 10,
                   "eval_problems_per_level": 100, "eval_samples": 2, "save_steps": 0, **CPU_BENCH_SETTING},
        method_overrides=CPU_BENCH_METHODS, seeds=(0, 1),
        runtime="36-60 minutes on 2 CPU cores; half that with --seeds 0"),
    BenchPreset(
        "cpu-baselines", "DPPO and the paper's scheme (dppo_paper) against the GRPO that frameworks run "
                         "(grpo) and the strong one (grpo_skip: the zero-loss completions skipped) on the "
                         "cpu-full setting, five seeds with paired confidence intervals",
        base="tiny-grpo", methods=("grpo", "grpo_skip", "dppo_paper", "dppo"),
        overrides=CPU_BASELINES_SETTING, method_overrides=CPU_BENCH_METHODS, seeds=(1, 2, 3, 4, 5),
        runtime="about 45 minutes on 2 CPU cores (20 runs of 1.5-3 minutes); --seeds 1 for a first "
                "look"),
    BenchPreset(
        "cpu-peers", "the other ways to spend less per step, against grpo and grpo_skip on the cpu-baselines "
                     "setting: grpo_half (half the prompts), PODS (train on the half whose rewards vary "
                     "most), CPPO and GRESO (biased pruning), two seeds",
        base="tiny-grpo",
        methods=("grpo", "grpo_skip", "grpo_half", "grpo_skip_matched", "pods", "cppo", "greso"),
        overrides=CPU_BASELINES_SETTING, method_overrides=CPU_BENCH_METHODS, seeds=(1, 2),
        runtime="about 35 minutes on 2 CPU cores (14 runs of 2-3 minutes)"),
    BenchPreset(
        "cpu-long", "the regime the DPPO paper trains in, chosen before it was run: the cpu-baselines "
                    "setting for 120 steps (15 epochs over the pool of 256, so most groups saturate), grpo, "
                    "grpo_skip and dppo, evaluated every 20 steps, targets at 90% and 95% of each baseline's "
                    "final accuracy",
        base="tiny-grpo", methods=("grpo", "grpo_skip", "dppo"),
        overrides={**CPU_BASELINES_SETTING, "max_steps": 120, "eval_steps": 20},
        method_overrides=CPU_BENCH_METHODS, seeds=(1, 2, 3),
        runtime="about 25 minutes on 2 CPU cores (9 runs of 2-5 minutes); --seeds 1 2 3 4 5 for five "
                "seeds"),
    BenchPreset(
        "cpu-realistic", "a pool shaped like real RL data for the warm start (issue #50): levels 1-6 mixed "
                         "so that about 30% of the groups start all correct, 20% all wrong (level 6, beyond "
                         "the model's reach) and 50% mixed; otherwise the cpu-baselines setting, evaluated "
                         "on levels 2-5",
        base="tiny-grpo", methods=CPU_REALISTIC_METHODS,
        overrides=CPU_REALISTIC_SETTING, method_overrides=CPU_REALISTIC_METHOD_OVERRIDES,
        seeds=(1, 2, 3, 4, 5),
        runtime="about 2.5 hours on 2 CPU cores (35 runs of 1.5-6.5 minutes; dynamic sampling the longest); "
                "--seeds 1 for a first look"),
    BenchPreset(
        "gpu-qwen3",
        "Qwen3-1.7B-Base on MATH with vLLM and LoRA, the DPPO paper's setting on one GPU; pass@1 on MATH-500",
        base="qwen3-math-grpo", methods=DEFAULT_METHODS,
        overrides={"model": "Qwen/Qwen3-1.7B-Base", "train_pool_size": 2048, "prompts_per_step": 32,
                   "max_completion_length": 1024, "max_steps": 100, "eval_steps": 20, "eval_samples": 2,
                   "save_steps": 0},
        method_overrides={"dppo": {"max_tokens_per_row": 4096, "packing_rows_per_micro_batch": 2}},
        requires_gpu=True, eval_benchmarks=("math500",), eval_limit=200,
        runtime="several hours on one H100-class GPU; needs the Hugging Face Hub for the model and MATH"),
    BenchPreset(
        "gpu-systems", "step time per phase of grpo, grpo_skip and dppo, each padded, packed and with a "
                       "shared prompt prefix, on Qwen3-1.7B's "
                       "layers with random weights, vLLM colocated and LoRA: timing only (a stand-in "
                       "reward), no download",
        base="qwen3-math-grpo", methods=("grpo", "grpo_skip", "dppo"),
        overrides={"model": "random:qwen3-1.7b", "task": "arithmetic", "train_pool_size": 64,
                   "prompts_per_step": 32, "max_completion_length": 512, "max_steps": 7, "eval_steps": 0,
                   "save_steps": 0, "micro_batch_size": 8, "learning_rate": 1e-5},
        method_overrides={m: {"max_tokens_per_row": 4096, "packing_rows_per_micro_batch": 2}
                          for m in ("grpo", "grpo_skip", "dppo")},
        requires_gpu=True, kind="systems",
        runtime="about 20-35 minutes on one H100-class GPU (9 runs of 7 steps, the first 2 of each "
                "untimed)"),
    *(persistence_preset(share) for share in PERSISTENCE_SHARES),
    BenchPreset(
        "smollm2-realistic", "a real pretrained model (issue #66): SmolLM2-135M-Instruct with LoRA (the "
                             "smollm2-grpo preset) on a pool shaped like real data for it (levels 1-5 by the "
                             "smollm2-realistic rule: it solves no level every time at T = 1, so about half "
                             "the groups start all wrong), grpo_skip at the full and at the matched batch, "
                             "dppo (dense prompts) and dppo_budget, evaluated on levels 1-5",
        base="smollm2-grpo", methods=("grpo_skip", "grpo_skip_matched", "dppo", "dppo_budget"),
        overrides=SMOLLM2_REALISTIC_SETTING, method_overrides=CPU_REALISTIC_METHOD_OVERRIDES,
        seeds=(1, 2, 3), runtime=SMOLLM2_REALISTIC_RUNTIME),
)}


def bench_preset(name: str) -> BenchPreset:
    """The bench preset called ``name``; an unknown name lists the valid ones."""
    if name not in BENCH_PRESETS:
        raise BenchError(f"unknown bench preset {name!r}; choose one of {', '.join(BENCH_PRESETS)}")
    return BENCH_PRESETS[name]


def describe_presets() -> str:
    """One paragraph per bench preset: name, what it runs, how long it takes."""
    lines = []
    for p in BENCH_PRESETS.values():
        lines.append(f"{p.name}: {p.description}; methods {', '.join(p.methods)}; seeds {list(p.seeds)}; "
                     f"{p.runtime}")
    return "\n".join(lines)


def check_methods(methods: Iterable[str]) -> tuple[str, ...]:
    """``methods`` in order, without repeats; every name must be known and a reference
    (:func:`reference_method`) present."""
    out = tuple(dict.fromkeys(methods))
    unknown = [m for m in out if m not in METHODS]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(METHODS)}")
    if not set(REFERENCE_METHODS) & set(out):
        raise BenchError("the target accuracy and the first speedups are relative to grpo (or to grpo_skip, "
                         "which has grpo's gradient): include grpo or grpo_skip in the methods")
    return out


def check_batch_matched_methods(methods: Iterable[str]) -> None:
    """Refuse a run of a method that rolls out fewer prompts per step (:data:`BATCH_MATCHED`) without its
    batch-matched baseline: its speedup over a baseline at the full batch is partly the smaller batch's."""
    names = set(methods)
    missing = sorted({base for m, base in BATCH_MATCHED.items() if m in names and base not in names})
    if missing:
        which = ", ".join(m for m in BATCH_MATCHED if m in names)
        raise BenchError(f"{which} roll(s) out fewer prompts per step than the preset; add the batch-matched "
                         f"baseline {', '.join(missing)} to --methods (every such speedup is reported "
                         f"against it)")


def reference_method(methods: Iterable[str]) -> str:
    """The method the target accuracy and ``speedup_vs_<it>`` are relative to: ``grpo`` when it ran, else
    ``grpo_skip`` (its gradient equals grpo's at every step, tests/unit/test_exact_expectation.py, so it
    learns alike and only costs less: a bench can leave grpo's slower runs out)."""
    names = set(methods)
    return next(m for m in REFERENCE_METHODS if m in names)


# --------------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------------


def split_overrides(items: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``key=value`` items for every method, and ``METHOD.key=value`` items per method."""
    shared: list[str] = []
    per_method: dict[str, list[str]] = {}
    for item in items:
        key = item.split("=", 1)[0]
        if "." in key:
            method, rest = item.split(".", 1)
            if method not in METHODS:
                raise BenchError(f"override {item!r}: {method!r} is not a method; use METHOD.key=value with "
                                 f"METHOD one of {', '.join(METHODS)}, or key=value for every method")
            per_method.setdefault(method, []).append(rest)
        else:
            shared.append(item)
    return shared, per_method


def method_lineage(method: str) -> tuple[str, ...]:
    """The methods whose settings make ``method``'s configuration, in the order they apply (``trl_dppo``:
    ``("dppo", "trl_dppo")``; any other method: itself)."""
    return (*method_lineage(DERIVED_METHODS[method]), method) if method in DERIVED_METHODS else (method,)


def method_settings(preset: BenchPreset | None, method: str) -> dict[str, Any]:
    """Every field ``method`` sets on the preset's shared configuration: :data:`METHOD_OVERRIDES` and the
    preset's ``method_overrides`` (none without a preset), of the method and of those it is derived from
    (:func:`method_lineage`), and the halved ``prompts_per_step`` of :data:`HALF_BATCH_METHODS` (before any
    command-line override). What ``bench.json`` records under ``method_overrides``."""
    out: dict[str, Any] = {}
    for m in method_lineage(method):
        out.update({**METHOD_OVERRIDES[m], **(preset.method_overrides.get(m, {}) if preset else {})})
        if m in MATCHED_BASELINES and preset is not None:
            out["prompts_per_step"] = matched_prompts_per_step(method_config(preset, MATCHED_TO, 0, "."))
    if method in HALF_BATCH_METHODS and preset is not None:
        out["prompts_per_step"] = max(1, preset.shared_config().prompts_per_step // 2)
    return out


def matched_prompts_per_step(config: DPPOConfig) -> int:
    """How many prompts per step a run of ``config`` rolls out: ``prompts_per_step``, or with prompt pruning
    and no dense prompts (a rollout budget) its expected kept count, round(k (1 - prompt_prune_rate)), at
    least 1; with ``fixed_size_sampling`` exactly that count every step."""
    pruned = config.pruning != "none" and config.prompt_prune_rate > 0 and not config.dense_prompts
    return max(1, round(config.prompts_per_step * (1 - config.prompt_prune_rate))) if pruned \
        else config.prompts_per_step


def check_batch_matched(prompts_rolled_out: Mapping[str, float]) -> list[str]:
    """Which runs of :data:`BATCH_MATCHED` methods did not roll out as many prompts per step as their baseline
    did; ``prompts_rolled_out`` maps a method to its mean rolled-out prompts per step (from its logs). Empty
    when every pair present matches within half a prompt."""
    wrong = []
    for method, baseline in BATCH_MATCHED.items():
        if method in prompts_rolled_out and baseline in prompts_rolled_out \
                and abs(prompts_rolled_out[method] - prompts_rolled_out[baseline]) > 0.5:
            wrong.append(f"{method} rolled out {prompts_rolled_out[method]:.1f} prompts per step and its "
                         f"batch-matched {baseline} {prompts_rolled_out[baseline]:.1f}")
    return wrong


def method_config(preset: BenchPreset, method: str, seed: int, output_dir: str | Path,
                  overrides: Sequence[str] = ()) -> DPPOConfig:
    """The training configuration of one run: base preset, bench overrides, user overrides, the method's own.

    ``overrides`` are ``key=value`` strings for every method (applied before the method's settings, so
    they cannot change what a method is) or ``METHOD.key=value`` for one method (applied after its
    settings; a derived method, ``trl_dppo``, also takes those of the method it derives from, ``dppo``).
    """
    shared, per_method = split_overrides(overrides)
    config = preset.shared_config().with_overrides(shared)
    for m in method_lineage(method):
        config = config.with_overrides({**METHOD_OVERRIDES[m], **preset.method_overrides.get(m, {})})
        # as many prompts per step as MATCHED_TO rolls out (before its own overrides)
        if m in MATCHED_BASELINES:
            matched = method_config(preset, MATCHED_TO, seed, output_dir, overrides)
            config = config.with_overrides({"prompts_per_step": matched_prompts_per_step(matched)})
        config = config.with_overrides(per_method.get(m, []))
    if method in HALF_BATCH_METHODS:
        config = config.with_overrides({"prompts_per_step": max(1, config.prompts_per_step // 2)})
    return config.with_overrides({"seed": seed, "output_dir": str(run_dir(output_dir, method, seed))})


def run_dir(output_dir: str | Path, method: str, seed: int) -> Path:
    """Where one run of ``method`` with ``seed`` keeps its logs: ``DIR/runs/METHOD/seed-S``."""
    return Path(output_dir) / "runs" / method / f"seed-{seed}"


def resolve_model_keyword(model: str) -> str:
    """``tiny-untrained``: build (or reuse) the untrained tiny model and return its directory;
    ``random:SHAPE``: a Qwen3 model of that shape with random weights
    (:func:`dppo_core.shapes.build_shaped_model`); else ``model``."""
    if model.startswith("random:"):
        from dppo_core.shapes import resolve_random_model

        return resolve_random_model(model)
    if model != UNTRAINED_TINY:
        return model
    from dppo_core.models import build_tiny_model

    return str(build_tiny_model())
