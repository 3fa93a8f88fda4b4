"""Mutants of the DPPO estimator: the mistakes an implementation is likely to make.

Each must be caught by the unbiasedness tests, which shows that those tests have the power to see a small
bias, not only a large one: ``MUTANTS`` by both tests/unit/test_exact_expectation.py (exact enumeration, in the
trainer's order) and tests/system/test_unbiased.py (Monte Carlo through the trainer, on a real model's gradient);
``EXACT_MUTANTS`` by the exact enumeration only (their bias is below what a few thousand random draws see, or
shows only when ``observe`` runs between ``select`` and ``weigh``, as in ``DPPOTrainer.train_step``).
"""

from __future__ import annotations

import torch

from dppo_core.estimator import Continuation, DPPOEstimator, Selection, Weighting
from dppo_core.pruning import PromptHistory


class ScaledRandomWeights(DPPOEstimator):
    """Weights of the randomly kept completions (p < 1) 5% too large."""

    factor = 1.05

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        w = super().weigh(advantages, selection, step, **kwargs)
        probs = self.completion_probs(advantages, kwargs.get("lengths"), None if selection is None else selection.probs)
        random = (probs < 1) & w.keep
        return Weighting(w.keep, torch.where(random, w.weights * self.factor, w.weights), w.num_sequences)


class NoPromptFloor(DPPOEstimator):
    """The floor ignored: prompts whose last group was degenerate get keep probability 0 (never rolled out)."""

    def prompt_probs(self, ids, step, budget=None):
        p = super().prompt_probs(ids, step, budget)
        scores = torch.tensor([self.history.score(i, step, self.history_max_age) or 0.0 for i in ids])
        return torch.where((scores == 0) & (p < 1), torch.zeros_like(p), p)


class StalePromptProbs(DPPOEstimator):
    """π taken one step stale: the prompts are drawn with today's π, but weighted by the previous step's."""

    stale: PromptHistory | None = None

    def select(self, candidate_ids, step, size=None):
        sel = super().select(candidate_ids, step, size)
        now, self.history = self.history, self.stale
        try:
            sel.probs = self.prompt_probs([candidate_ids[i] for i in sel.indices], step)
        finally:
            self.history = now
        return sel


class KeptCountNormaliser(DPPOEstimator):
    """C = the number of completions kept (a ratio), instead of the constant |B|·G."""

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        w = super().weigh(advantages, selection, step, **kwargs)
        return Weighting(w.keep, w.weights, max(1, int(w.keep.sum())))


class SlightlyScaledRandomWeights(ScaledRandomWeights):
    """Weights of the randomly kept completions (p < 1) 3% too large."""

    factor = 1.03


class StaleDensePromptProbs(DPPOEstimator):
    """π one step stale in dense windows only: a dense window is drawn with today's π and weighted with the
    previous step's (over the same window and budget); a step whose candidates are given is right."""

    dense_only = True  # the same as the real estimator without dense prompts
    stale: PromptHistory | None = None

    def select(self, candidate_ids, step, size=None):
        sel = super().select(candidate_ids, step, size)
        if size is None or not self.dense_prompts:
            return sel
        now, self.history = self.history, self.stale
        try:
            sel.probs = self.prompt_probs(list(candidate_ids[:sel.window]), step, budget=size)[sel.indices]
        finally:
            self.history = now
        return sel


class ProbsFromUpdatedHistory(DPPOEstimator):
    """π_q recomputed in ``weigh`` from the history, which ``observe`` has just updated with this step's own
    groups (the trainer observes before it weighs): the prompts are drawn with one π and weighted with another.
    Called without ``observe`` in between, it is the real estimator."""

    def select(self, candidate_ids, step, size=None):
        sel = super().select(candidate_ids, step, size)
        dense = size is not None and self.dense_prompts
        self.window_ids, self.budget = list(candidate_ids[:sel.window]), size if dense else None
        return sel

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        probs = self.prompt_probs(self.window_ids, step, budget=self.budget)
        selection = Selection(selection.indices, probs[selection.indices], selection.window)
        return super().weigh(advantages, selection, step, **kwargs)


class ContinueWeightOnMixedPilots(DPPOEstimator):
    """The pilot's weight 1 / c applied to every continued group, those whose pilot was mixed (always continued) too."""

    def continue_groups(self, prompt_ids, pilot_rewards, step):
        cont = super().continue_groups(prompt_ids, pilot_rewards, step)
        return Continuation(cont.keep, torch.full_like(cont.probs, self.continue_probability))


class ContinueProbsAfterTheDraw(DPPOEstimator):
    """c read after the draw: the all-equal pilots' continued groups weighted by the share of them that the draw
    continued, instead of by the probability it drew them with."""

    def continue_groups(self, prompt_ids, pilot_rewards, step):
        cont = super().continue_groups(prompt_ids, pilot_rewards, step)
        equal = cont.probs < 1
        if not (equal & cont.keep).any():
            return cont
        share = cont.keep[equal].double().mean()
        return Continuation(cont.keep, torch.where(equal, share, cont.probs))


def pilot_left_out_of_the_advantages(monkeypatch) -> None:
    """The pilot's rewards left out of the group's advantages: the rest's advantages over the rest alone, the pilot's
    completions at the rest's mean (A = 0). Installed over :func:`dppo_core.plans.pilot.join` (rewards only; lengths are
    integers and joined right)."""
    from dppo_core.plans import pilot

    right = pilot.join

    def wrong(first, rest, continued):
        if not first.is_floating_point():
            return right(first, rest, continued)
        return torch.cat([rest.mean(dim=1, keepdim=True).expand(-1, first.shape[1]), rest], dim=1)

    monkeypatch.setattr(pilot, "join", wrong)


MUTANTS = (ScaledRandomWeights, NoPromptFloor, StalePromptProbs, KeptCountNormaliser)
#: the pilot's mistakes, each caught by the exact enumeration with a pilot (tests/unit/test_exact_expectation.py)
PILOT_MUTANTS = (ContinueWeightOnMixedPilots, ContinueProbsAfterTheDraw)
PILOT_JOIN_MUTANTS = (pilot_left_out_of_the_advantages,)
EXACT_MUTANTS = (SlightlyScaledRandomWeights, StaleDensePromptProbs, ProbsFromUpdatedHistory)


# === Rollout-correction (engine weight) mutants: tests/system/test_rollout_correction.py =========================
# Not estimators: each is a wrong line in the trainer's loss path, installed with pytest's monkeypatch over the function
# that holds it (``install(monkeypatch)``). ``ENGINE_MUTANTS`` must each be caught by the exact, enumerated check that
# the sequence-level engine weight makes the trainer's pruned step with a KL term on-policy GRPO's
# (test_rollout_correction.py, ``test_engine_weight_mutants_are_caught``).


def inverted_engine_weight(monkeypatch) -> None:
    """The engine weight inverted: min(μ/π_old, C) instead of min(π_old/μ, C)."""
    from dppo_core import logprobs, trainer
    from dppo_core.grpo import truncated_importance_weights

    def wrong(config, level, seqs, idx, old_logprobs, mask):
        _, logged = logprobs.engine_weights(config, level, seqs, idx, old_logprobs, mask)
        engine = logprobs.engine_logprob_grid(seqs, idx, old_logprobs)
        w = truncated_importance_weights(engine, old_logprobs.detach().to(engine.dtype), config.rollout_correction_cap,
                                         level=level, mask=mask)
        return torch.where(mask.bool(), w, torch.ones_like(w)), logged

    monkeypatch.setattr(trainer, "engine_weights", wrong)


def _split_policy_loss(monkeypatch, weigh_surrogate: bool, weigh_kl: bool) -> None:
    """``policy_loss`` with the engine weight on the surrogate only, or on the KL term only (the loss is linear in
    the per-token terms: the KL term is the loss with ``beta`` minus the loss without)."""
    from dppo_core import grpo, trainer

    def wrong(logprobs, advantages, mask, *, beta=0.0, token_weights=None, **kwargs):
        def part(b, w):
            return grpo.policy_loss(logprobs, advantages, mask, beta=b, token_weights=w, **kwargs)

        loss, stats = part(0.0, token_weights if weigh_surrogate else None)
        if beta > 0:
            kl_weights = token_weights if weigh_kl else None
            with_kl, stats = part(beta, kl_weights)
            loss = loss + with_kl - part(0.0, kl_weights)[0]
        return loss, stats

    monkeypatch.setattr(trainer, "policy_loss", wrong)


def kl_term_without_engine_weight(monkeypatch) -> None:
    """The engine weight on the surrogate only, the KL term unweighted (as TRL and verl apply theirs)."""
    _split_policy_loss(monkeypatch, weigh_surrogate=True, weigh_kl=False)


def engine_weight_on_kl_term_only(monkeypatch) -> None:
    """The engine weight on the KL term only, the surrogate unweighted."""
    _split_policy_loss(monkeypatch, weigh_surrogate=False, weigh_kl=True)


def keep_weight_in_advantages(monkeypatch) -> None:
    """The keep weight folded into the advantages (as an integration that can only scale A does) instead of
    multiplying the completion's whole loss: the KL term keeps its engine weight but loses the keep weight."""
    import dataclasses

    from dppo_core import trainer

    real = trainer.micro_batch_loss

    def wrong(config, seqs, idx, logprobs, mask, old_logprobs=None, ref_logprobs=None, engine_weights=None):
        folded = dataclasses.replace(seqs, advantages=seqs.advantages.double() * seqs.weights,
                                     weights=torch.ones_like(seqs.weights))
        return real(config, folded, idx, logprobs, mask, old_logprobs, ref_logprobs, engine_weights)

    monkeypatch.setattr(trainer, "micro_batch_loss", wrong)


def engine_logprobs_of_every_rolled_out_row(monkeypatch) -> None:
    """The engine log-probs listed over every rolled-out completion, pruned ones included, while the sequences
    are the kept ones: after a pruned completion, a kept one is weighed with another's log-probs."""
    from dppo_core.trainer import DPPOTrainer

    real = DPPOTrainer.sequences

    def wrong(batch, advantages, weighting, group_offset=0):
        seqs = real(batch, advantages, weighting, group_offset)
        every = [c.logprobs for g in batch.groups for c in g.completions if c.token_ids]
        seqs.engine_logprobs = every[: len(seqs)]
        return seqs

    monkeypatch.setattr(DPPOTrainer, "sequences", staticmethod(wrong))


def engine_weight_first_micro_batch_only(monkeypatch) -> None:
    """Only the micro-batch holding the step's first sequence weighted; the others get weight 1."""
    from dppo_core import logprobs, trainer

    def wrong(config, level, seqs, idx, old_logprobs, mask):
        w, logged = logprobs.engine_weights(config, level, seqs, idx, old_logprobs, mask)
        return (w if 0 in list(idx) else torch.ones_like(w)), logged

    monkeypatch.setattr(trainer, "engine_weights", wrong)


def engine_logprobs_by_row(monkeypatch) -> None:
    """The engine log-probs of micro-batch k read by its row number, not its sequences' indices (right for the
    first micro-batch only)."""
    from dppo_core import logprobs, trainer

    def wrong(config, level, seqs, idx, old_logprobs, mask):
        return logprobs.engine_weights(config, level, seqs, range(len(idx)), old_logprobs, mask)

    monkeypatch.setattr(trainer, "engine_weights", wrong)


def self_normalised_engine_weight(monkeypatch) -> None:
    """The engine weights divided by their mean over the micro-batch's tokens (self-normalised importance
    sampling, a common variance cut): biased, and with one sequence per micro-batch no correction at all."""
    from dppo_core import logprobs, trainer

    def wrong(config, level, seqs, idx, old_logprobs, mask):
        w, logged = logprobs.engine_weights(config, level, seqs, idx, old_logprobs, mask)
        m = mask.bool()
        return torch.where(m, w / w[m].mean(), w), logged

    monkeypatch.setattr(trainer, "engine_weights", wrong)


ENGINE_MUTANTS = (inverted_engine_weight, kl_term_without_engine_weight, engine_weight_on_kl_term_only,
                  keep_weight_in_advantages, engine_logprobs_of_every_rolled_out_row,
                  engine_weight_first_micro_batch_only, engine_logprobs_by_row, self_normalised_engine_weight)


# === Issue #52: the ceiling of pruning, the group log, keep probabilities fed rewards outside [0, 1] ==============
# tests/unit/test_ceiling.py and tests/unit/test_pruning.py. Each mutant (but ``lower_committed_ceiling``, a data
# mutant) is the real function with one line made wrong: ``LineMutant`` copies the function's source, swaps that line
# (which must occur exactly once, so a mutant whose line the code no longer has fails loudly instead of testing
# nothing), and ``install(monkeypatch)`` puts the copy in place of the real one, as a module attribute (or a class's
# method). Callers must reach the function through its module (``ceiling.oracle_ceiling``), as the package itself does.
# ``CEILING_MUTANTS``, ``GROUPLOG_MUTANTS`` and ``REWARD_RANGE_MUTANTS`` name, for each mutant, the new check that
# must catch it.


class LineMutant:
    """``owner.function`` (in module ``module``; ``owner`` a class name or None) with ``old`` replaced by ``new``."""

    def __init__(self, name: str, module: str, function: str, old: str, new: str, doc: str, owner: str | None = None):
        self.__name__, self.__doc__, self.module, self.function = name, doc, module, function
        self.old, self.new, self.owner = old, new, owner

    def __repr__(self) -> str:
        return self.__name__

    def _target(self):
        import importlib

        mod = importlib.import_module(self.module)
        return mod, (mod if self.owner is None else getattr(mod, self.owner))

    def build(self):
        import inspect
        import textwrap

        mod, target = self._target()
        source = textwrap.dedent(inspect.getsource(getattr(target, self.function)))
        if source.count(self.old) != 1:
            raise AssertionError(f"mutant {self.__name__}: {self.old!r} occurs {source.count(self.old)} times in "
                                 f"{self.module}.{self.function}, not once: update the mutant to the code")
        namespace = dict(vars(mod))  # the module's globals, copied: the real module is left as it is
        source = source.replace(self.old, self.new)
        if self.owner is not None:  # a method: compiled inside a function whose __class__ is the owner, so that
            # a zero-argument super() in it finds its class (the cell the compiler gives methods in a class body)
            source = "def _mutant_of(__class__):\n" + textwrap.indent(source, "    ") + f"    return {self.function}\n"
        exec(compile(source, f"<mutant {self.__name__}>", "exec"), namespace)
        return namespace["_mutant_of"](target) if self.owner is not None else namespace[self.function]

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(self._target()[1], self.function, self.build())


_CEILING = "dppo_core.tools.bench.ceiling"
_PRUNING = "dppo_core.pruning"
_POSTERIOR = "dppo_core.posterior"

#: mutant -> the check of tests/unit/test_ceiling.py that must catch it
CEILING_MUTANTS = {
    LineMutant("all_equal_groups_informative", _CEILING, "informative_tokens", "if informative(r)", "if len(r)",
               "Every group's tokens counted as informative, all-equal groups too."): "synthetic",
    LineMutant("method_step_costs", _CEILING, "oracle_ceiling", 'm["time_update"] for m in base]))',
               'm["time_update"] for m in steps]))',
               "The oracle's per-step bookkeeping (reward, pack, gaps) taken from the method's steps."): "synthetic",
    LineMutant("empty_steps_pay_fixed_costs", _CEILING, "oracle_ceiling", " if n else 0.0) + other", ") + other",
               "A step without an informative group still pays the rollout's and update's fixed costs."): "synthetic",
    LineMutant("mean_baseline_step", _CEILING, "oracle_ceiling", 'base_steps = [m["step_time"] for m in base]',
               'base_steps = [sum(m["step_time"] for m in base) / len(base)] * len(base)',
               "Every baseline step taken to cost the baseline's mean step time (not its own) when finding the "
               "steps done by the time to a target."): "synthetic",
    LineMutant("step_in_progress_counted_whole", _CEILING, "_ratio_until",
               "oracle += o * (t - spent) / b if b > 0 else 0.0", "oracle += o",
               "The baseline step in progress at the time to a target counted whole for the oracle."): "synthetic",
    LineMutant("oracle_one_step_late", _CEILING, "_ratio_until", "zip(base_steps, oracle_steps, strict=True)",
               "zip(base_steps, [*oracle_steps[1:], 0.0], strict=True)",
               "Off by one: baseline step s paired with the oracle's step s + 1 up to the time to a target."):
        "synthetic",
    LineMutant("n_counts_every_seed", _CEILING, "ceilings", '"n": len(values)', '"n": len(per_seed)',
               "A target's seed count includes the seeds whose baseline never reached it."): "synthetic",
    LineMutant("r2_threshold_lowered", _CEILING, "rollout_fit", 'if fit["r2"] >= MIN_R2:', 'if fit["r2"] >= 0.15:',
               "The decode-aware rollout model taken down to R² 0.15: on the committed runs it lowers a seed's "
               "ceiling (cpu-batch8's seed 1, R² 0.19, loses its proportional fallback); the synthetic runs' fits "
               "have R² 1."): "committed",
}


def lower_committed_ceiling(bench: dict) -> dict:
    """A data mutant: a copy of a committed bench.json with the first seed's whole-run ceiling 5% lower."""
    import copy

    out = copy.deepcopy(bench)
    c = out["ceiling"]["grpo_skip"]["dppo"]
    c["per_seed"][0] *= 0.95
    c["seeds"][0]["speedup"] *= 0.95
    return out


#: mutant -> the check of tests/unit/test_ceiling.py that must catch it
GROUPLOG_MUTANTS = {
    LineMutant("rewards_rounded_to_integers", "dppo_core.grouplog", "_number",
               'float(f"{x:.6g}")', "round(x)",
               "A non-integral reward (3.7, 0.6) logged rounded to an integer."): "round_trip",
    LineMutant("all_equal_is_informative", "dppo_core.grouplog", "informative", "len(set(rewards)) > 1",
               "len(set(rewards)) >= 1", "Every group informative, all-equal groups too."): "round_trip",
}

#: mutant -> the check of tests/unit/test_pruning.py that must catch it
REWARD_RANGE_MUTANTS = {
    LineMutant("positive_advantages_only", _PRUNING, "completion_keep_probs",
               "out[q] = keep_probs_from_scores(adv[q].abs(), rate",
               "out[q] = keep_probs_from_scores(adv[q].clamp(min=0), rate",
               "Completion scores clamped at 0 instead of |A|: below-mean rewards (negative A) sit on the floor."):
        "completions",
    LineMutant("probabilities_not_capped_at_one", _PRUNING, "fit_budget", "np.clip(c * s, min_prob, 1))",
               "np.clip(c * s, min_prob, None))",
               "Keep probabilities ∝ score floored but not capped at 1: an outlying reward (3.7 among 0s) gets "
               "p > 1."): "completions",
    LineMutant("posterior_unchecked", _POSTERIOR, "posterior_scores", "check_pass_rates(pid, rec)", "pass",
               "The posterior reads rewards outside [0, 1] silently (their evidence clipped into [0, 1])."):
        "posterior_refuses",
    LineMutant("pass_fail_only", _POSTERIOR, "check_pass_rates", "v <= m * (1 - m) + tol",
               "abs(v - m * (1 - m)) <= tol",
               "Only pass/fail rewards accepted: fractional rewards in [0, 1] refused."): "posterior_accepts",
    LineMutant("earlier_group_outside_forgotten", "dppo_core.history", "update",
               "outside = prev.outside_unit_at if prev is not None and not stale else None", "outside = None",
               "Only the last group's rewards are checked: an earlier group outside [0, 1] is forgotten once a group "
               "inside follows.", owner="PromptHistory"): "posterior_refuses_earlier",
    LineMutant("history_scored_by_mean_reward", "dppo_core.history", "score", "return rec.mean_abs_advantage",
               "return min(1.0, max(0.0, rec.mean_reward))",
               "A prompt scored by its last mean reward clipped into [0, 1] instead of its mean |A|.",
               owner="PromptHistory"): "prompts",
}


# --- DPPOGRPOTrainer (dppo_core.integrations.trl) under several processes: tests/system/test_trl_multiprocess.py ---
def trl_mutants() -> dict[str, type]:
    """Wrong versions of :class:`~dppo_core.integrations.trl.DPPOGRPOTrainer`, by name (imports TRL)."""
    from dppo_core.integrations.trl import DPPOGRPOTrainer

    class NoFillerWhenEmpty(DPPOGRPOTrainer):
        """No weight-0 row when a generation batch keeps nothing on any process (the bug of ed478c6): that
        micro-batch never runs the model, so at the end of a window DDP never reduces the gradients."""

        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            if self.model.training and not sum(self._process_rows):
                return {k: v[:0] if isinstance(v, list) or getattr(v, "ndim", 0) > 0 else v for k, v in inputs.items()}
            return inputs

    return {"no-filler-when-empty": NoFillerWhenEmpty}


# === Issue #64: draws that must be independent, the values of the continue probabilities ===========================
_ESTIMATOR = "dppo_core.estimator"

#: mutant -> the check of tests/unit/test_draw_streams.py that must catch it
STREAM_MUTANTS = {
    LineMutant("continue_draw_on_the_prompt_stream", _ESTIMATOR, "continue_groups",
               'pruning.step_generator(self.seed, step, "pilot")', 'pruning.step_generator(self.seed, step, "prompts")',
               "The pilot's continue draw made from the prompt keep draw's random stream (the same uniforms).",
               owner="DPPOEstimator"): "joint",
    LineMutant("completion_draw_on_the_prompt_stream", _ESTIMATOR, "weigh",
               'pruning.step_generator(self.seed, step, "completions")',
               'pruning.step_generator(self.seed, step, "prompts")',
               "The completion keep draw made from the prompt keep draw's random stream.", owner="DPPOEstimator"):
        "joint",
    LineMutant("completion_draw_on_the_pilot_stream", _ESTIMATOR, "weigh",
               'pruning.step_generator(self.seed, step, "completions")',
               'pruning.step_generator(self.seed, step, "pilot")',
               "The completion keep draw made from the continue draw's random stream.", owner="DPPOEstimator"):
        "joint",
    LineMutant("prompt_draw_of_every_step_alike", _ESTIMATOR, "select",
               'pruning.step_generator(self.seed, step, "prompts")',
               'pruning.step_generator(self.seed, 0, "prompts")',
               "The prompt keep draw's stream not advanced with the step: every step draws the same uniforms.",
               owner="PromptPruning"): "steps",
}

#: mutant -> the check of tests/unit/test_pilot_evidence.py that must catch it
PILOT_EVIDENCE_MUTANTS = {
    LineMutant("stopped_pilot_recorded_as_a_whole_group", "dppo_core.history", "update",
               "size=r.numel())", "size=None)",
               "A stopped pilot's k equal rewards enter the prior's fit as a group of 0 or G passes (the record keeps "
               "no size, so the fit reads it as G trials).", owner="PromptHistory"): "fit",
}

#: mutant -> the check of tests/unit/test_continue_probs.py that must catch it
CONTINUE_MUTANTS = {
    LineMutant("pilot_side_swapped", _POSTERIOR, "continue_probs",
               "(a0 + s + k, b0 + f) if value == 1.0 else (b0 + f + k, a0 + s)",
               "(b0 + f + k, a0 + s) if value == 1.0 else (a0 + s + k, b0 + f)",
               "The pilot's side swapped: an all-pass pilot read as the failures' side (the estimator stays unbiased; "
               "c_q is simply the wrong one, and pilot_replay would report wrong numbers)."): "values",
    LineMutant("pilot_evidence_dropped", _POSTERIOR, "continue_probs",
               "(a0 + s + k, b0 + f) if value == 1.0 else (b0 + f + k, a0 + s)",
               "(a0 + s, b0 + f) if value == 1.0 else (b0 + f, a0 + s)",
               "The pilot's k rewards left out of the posterior."): "values",
    LineMutant("uniform_prior", _POSTERIOR, "continue_probs", "a0, b0 = history.fitted_prior(group_size)",
               "a0, b0 = 1.0, 1.0", "The pool's fitted prior ignored (uniform)."): "values",
    LineMutant("history_undiscounted", "dppo_core.history", "evidence",
               "decay = 0.5 ** ((step - rec.step) / self.half_life)", "decay = 1.0",
               "The prompt's evidence not discounted with its age.", owner="PromptHistory"): "values",
}
