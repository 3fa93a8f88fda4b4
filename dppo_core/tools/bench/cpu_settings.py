"""What the CPU comparisons share, the cpu-realistic pool and the persistence map's points.

The settings the CPU bench presets (:mod:`dppo_core.tools.bench.presets`) build on, and the rules, written
before anything was measured, that shape the cpu-realistic pool (issue #50) and the ``cpu-persist-NN`` presets
(issue #63).
"""

from __future__ import annotations

from typing import Any

#: What the CPU comparisons (``demo``, ``cpu-full``) share on top of the tiny-grpo preset: no KL term (beta 0)
#: for every method. The preset's KL term keeps level 1, which is not trained on, from being forgotten over
#: 100 steps; the benchmark trains and evaluates levels 2-5 for 60 steps. Without it a completion with
#: A = 0 has an identically zero loss, so DPPO drops those exactly (``drop_zero_advantage``) and GRPO skips
#: the reference model's forward: both get cheaper, and what DPPO saves on top is its pruning.
CPU_BENCH_SETTING: dict[str, Any] = {"beta": 0.0}
#: The paper scheme's prompt pruning in the CPU comparisons (``dppo_paper``, what ``dppo`` was before the
#: variance-aware schemes): the lower half of the candidates by history (mean |A| of their last group;
#: all-equal groups score 0) is kept with probability 0.2 and weighted 5. Chosen on seed 0
#: (benchmarks/results/archive/cpu-full-tuning/) against rate 0.5 (1.95x faster, same accuracy) and the
#: proportional scheme (3x faster per step, but importance weights up to 30 made it learn less per step);
#: GRESO skips at the same rate. ``dppo`` itself runs the tiny-dppo preset as it is (posterior prompt scheme
#: with dense prompts, length-aware completion scheme, sorted design), chosen on seed 0 among 17 variants
#: (benchmarks/results/ablation/) and by the variance per unit of cost (benchmarks/results/variance_cost.md).
CPU_BENCH_METHODS: dict[str, dict[str, Any]] = {"dppo_paper": {"prompt_prune_rate": 0.8},
                                                "greso": {"prompt_prune_rate": 0.8}}
#: The cpu-full setting (a pool of 256 prompts, 60 steps, 400 held-out problems x 2 samples every 10 steps),
#: shared by cpu-baselines and cpu-peers so their grpo and grpo_skip runs are the same runs. The learning rate
#: (tiny-grpo's 1e-4, constant) is the tuned one for grpo, grpo_skip, dppo_paper and dppo: the same three
#: rates each (5e-5, 1e-4, 2e-4), constant and with a cosine decay, on seed 0, not a reported seed, the same
#: rules (decay only if it raises every method's best score; then the highest mean held-out accuracy over a
#: run's evaluations after step 0): the constant 1e-4 won for all four (benchmarks/tune_lr.py,
#: benchmarks/results/tuning/).
CPU_BASELINES_SETTING: dict[str, Any] = {"train_pool_size": 256, "max_steps": 60, "eval_steps": 10,
                                         "eval_problems_per_level": 100, "eval_samples": 2, "save_steps": 0,
                                         **CPU_BENCH_SETTING}

#: The cpu-realistic pool: the embedded task's levels mixed so that, for the shipped warm-started model, the
#: shares of prompts it solves every time, never, and sometimes resemble what RL runs on real data start from.
#: Target and rule written before anything was measured (issue #50):
#:
#: - **Target**, per group of G = 8 completions at the training temperature (T = 1) from the warm start (step
#:   0): 30% all correct, 20% all wrong, 50% mixed; half the groups all-equal at the start, and more as
#:   training solves prompts. The curated cpu-baselines pool (levels 2-5) has few prompts at exactly p = 1 or
#:   0: many of its all-equal groups are p ~ 0.9 prompts that came out 8/8 by chance, which history cannot
#:   tell apart.
#: - **Grounds**: GRESO (Zheng et al., arXiv 2506.02177, abstract and its reward-dynamics analysis): prompts
#:   that are zero-variance in one epoch are likely to stay so in later ones ("strong temporal consistency";
#:   the issue reads more than 90% off its figure), and late in training over 80% of the sampled prompts are
#:   zero-variance (as the Emergent Mind summary of GRESO puts it). POLARIS (An et al., 2025, the HKU NLP blog
#:   "POLARIS: A POst-training recipe for scaling RL on Advanced ReasonIng modelS"): DeepScaleR-40K rated by 8
#:   rollouts per problem of R1-Distill-Qwen-1.5B and -7B gives mirror-image difficulty distributions, the
#:   stronger model's massed at 8/8, so an uncurated set is mostly solved-every-time or never-solved for a
#:   given model; POLARIS then recommends a "mirrored J" mix, a slight bias toward hard problems, after
#:   dropping the 8/8 ones. DAPO (Yu et al., arXiv 2503.14476, dynamic sampling): groups of accuracy 1 (and 0)
#:   grow over training, so DAPO over-samples and drops them. A practitioner's pre-flight check of a curated
#:   set on its base model found about 40% of the prompts with zero signal (deepchokshi.in, "60% of your
#:   dataset is doing the work"). The target sits between the curated 40% and the late-training 80%, on the
#:   solved side as the J shape is.
#: - **Rule**: levels 2-5 keep equal weights among themselves (the cpu-baselines mix of learnable prompts);
#:   level 1 (the warm start solves it almost always) supplies the all-correct groups and level 6 (two-digit
#:   products, never seen by the warm start, :data:`dppo_core.tasks.EXTRA_LEVELS`) the all-wrong ones. The
#:   three free weights (level 1, levels 2-5 together, level 6; summing to 1) are set so that the expected
#:   shares of 8/8 and 0/8 groups, from each level's measured distribution of successes out of 8 (300 training
#:   prompts per level, G = 8, T = 1, 64 tokens, the trainer's rollout and reward code), equal the target,
#:   rounded to 0.05. The pool of 256 is then drawn by these weights as for every preset
#:   (:meth:`dppo_core.data.PromptSource.pool`).
#:
#: Measured (benchmarks/results/realistic-pool/README.md): the per-level distributions, the weights, and the
#: pool's persistence in a grpo_skip run (:func:`dppo_core.grouplog.persistence`): P(all-equal | previous
#: all-equal) 0.81 against 0.68 on the curated pool, 77% of the all-equal groups flagged by their previous one
#: against 63%; level 6 exactly persistent, level 1 not (the warm start at T = 1 gets 5% of even level 1
#: wrong), so below GRESO's 90%.
CPU_REALISTIC_LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
#: Levels 1-6 by the rule above, from benchmarks/results/realistic-pool/level_success.json (exact solution
#: 0.304, 0.577 for levels 2-5 together, 0.118; expected shares 30.1% all correct, 18.5% all wrong, 51.4%
#: mixed).
CPU_REALISTIC_WEIGHTS: tuple[float, ...] = (0.3, 0.15, 0.15, 0.15, 0.15, 0.1)
#: Evaluated every 5 steps (13 points; 10 in the first comparison, whose 7 points set the time to target by
#: interpolating across 10-step gaps, issue #63); each evaluation of 400 problems x 2 samples takes about 7 s
#: here.
CPU_REALISTIC_SETTING: dict[str, Any] = {**CPU_BASELINES_SETTING, "train_levels": list(CPU_REALISTIC_LEVELS),
                                         "level_weights": list(CPU_REALISTIC_WEIGHTS),
                                         "eval_levels": [2, 3, 4, 5], "eval_steps": 5}
#: The cpu-realistic comparison (issue #50, item 3): DPPO in both ways of spending what its prompt stage saves
#: (dense prompts, a rollout budget) against grpo_skip and the baselines practitioners use instead.
CPU_REALISTIC_METHODS: tuple[str, ...] = ("grpo_skip", "grpo_skip_matched", "grpo_skip_filtered",
                                          "dapo_sampling", "greso_sampling", "dppo", "dppo_budget")
#: DPPO's prompt keep rule on this pool: ``fitted`` (π ∝ P(the next group is informative) under a prior fitted
#: to the pool), chosen by the offline sweep in benchmarks/results/realistic-pool/README.md before the
#: comparison ran: replayed on the grpo_skip seed-1 log it rolls out 47.4% all-equal groups where
#: ``posterior`` (the tiny-dppo preset's) rolls out 55.3%, at a variance factor within 3% of its (1.88 against
#: 1.84).
CPU_REALISTIC_METHOD_OVERRIDES: dict[str, dict[str, Any]] = {
    **CPU_BENCH_METHODS, "dppo": {"prompt_scheme": "fitted"}, "dppo_budget": {"prompt_scheme": "fitted"}}

#: The persistence map (issue #63, item 3): cpu-realistic with a larger share of never-solved prompts (level
#: 6, which the warm start gets wrong in all of 2,400 completions: exactly persistent), so that P(all-equal |
#: previous all-equal) rises from cpu-realistic's 0.81 toward 1. Rule, written before any run: level 6 at each
#: share below, levels 1-5 keeping cpu-realistic's weights among themselves (scaled to the rest); everything
#: else cpu-realistic's. The solved side stays as persistent as level 1 at T = 1 (0.84): no level of the task
#: is solved every time.
PERSISTENCE_SHARES: tuple[float, ...] = (0.3, 0.5, 0.7, 0.85)
#: What the map compares at each point: the strong baseline at the full and at the matched batch, DPPO in both
#: modes, and the baselines practitioners use instead.
PERSISTENCE_METHODS: tuple[str, ...] = ("grpo_skip", "grpo_skip_matched", "dppo", "dppo_budget",
                                        "grpo_skip_filtered", "dapo_sampling", "greso_sampling")
#: Each point trains for as many steps as roll out about as many learnable prompts (levels 1-5) as
#: cpu-realistic's 60 steps: 60 x 0.9 / (1 - share), rounded to 10, evaluated every twelfth of that (13 to 15
#: points). At 60 steps for every share (the rule first written), a grpo_skip run at share 0.85 climbed from
#: 0.505 to 0.531 sampled accuracy, under two evaluation standard errors (no time to target measurable); that
#: one run was all that was seen.
PERSISTENCE_BASE_STEPS = 60


def persistence_steps(share: float) -> int:
    """``max_steps`` at a point of the map: :data:`PERSISTENCE_BASE_STEPS` scaled by 0.9 / (1 - ``share``)."""
    if not 0 <= share < 1:
        raise ValueError(f"share={share!r}: the level-6 share of the pool must be in [0, 1)")
    return max(PERSISTENCE_BASE_STEPS, 10 * round(PERSISTENCE_BASE_STEPS * (1 - CPU_REALISTIC_WEIGHTS[-1])
                                                  / (1 - share) / 10))

#: The smollm2-realistic pool (issue #66): the cpu-realistic pool's target and rule for SmolLM2-135M-Instruct
#: (the smollm2-grpo preset: one solved example in the prompt, G = 8, T = 1, 32 tokens), its levels' success
#: distributions measured by ``benchmarks/level_success.py --preset smollm2-grpo`` (128 training prompts per
#: level; all 79 of level 1). Written before the comparison ran, and the fallback before levels 2-6 were
#: measured in full (a first look at 32 prompts of levels 1, 3 and 6, then all of level 1, had found 1 prompt
#: of 79 solved 8 times out of 8; one commit holds the rule and the measurement, so that order rests on the
#: results README):
#:
#: - **Target**: cpu-realistic's (30% all correct, 20% all wrong, 50% mixed at step 0), by its rule where the
#:   model can reach it.
#: - **Fallback**, where it cannot (the exact solution is not a mixture): SmolLM2 at T = 1 solves no level
#:   every time, so the all-correct share is out of reach at step 0. The pool keeps the target's all-equal
#:   half with the groups the model gives, all wrong: a weaker model's difficulty distribution is massed at
#:   0/8, the mirror of a stronger one's (POLARIS, above). Levels 1-5 keep cpu-realistic's proportions among
#:   themselves (0.3 : 0.15 x 4) and level 6 takes the weight, on the 0.05 grid, whose expected all-equal
#:   share is nearest 50%. All-correct groups then come from training, as the model learns the easy levels.
#:
#: Measured (benchmarks/results/smollm2-realistic/level_success.json, README): the share of all-wrong groups
#: is 8.9% at level 1, 77% at level 2, 55% at level 3, 73% at level 4, 96% at level 5 and 92% at level 6;
#: all-correct groups 1 of 79 prompts at level 1 and 1 of 128 at level 4. The fallback applies, and levels
#: 1-5 alone already start 54% all-equal: level 6 gets no weight (it stays in ``train_levels`` so that the
#: prompt's solved example, drawn from the pool's levels, is the one measured).
SMOLLM2_REALISTIC_LEVELS: tuple[int, ...] = CPU_REALISTIC_LEVELS
SMOLLM2_REALISTIC_WEIGHTS: tuple[float, ...] = (0.3333, 0.1667, 0.1667, 0.1667, 0.1667, 0.0)
