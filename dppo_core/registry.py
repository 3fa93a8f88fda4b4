"""Every named choice a run makes, said once, with what each declares: the prompt schemes, the completion
schemes, the rollout plans and the rollout engines.

The config's checks (:mod:`dppo_core.config_checks`), the command line's choices, the TRL and verl adapters
and ``dppo advise`` read these tables; the code that runs a choice looks it up here by name. A new rule is one
file (a plan in :mod:`dppo_core.plans`, say) plus one entry below. Torch-free, so that the config stays light.

What an entry declares (:class:`Choice`):

- ``reads``: what the rule reads to decide: ``"history"`` (each prompt's last groups), ``"pass_counts"`` (the
  history's rewards as pass rates, through :mod:`dppo_core.posterior`), ``"advantages"``, ``"rewards"`` (the
  step's own, after rollout: a rule that sees them must weigh by 1/π or change the objective), ``"lengths"``.
- ``exact``: its draws are weighed by 1/π, so the step's loss and gradient at the parameters it was drawn with
  stay unbiased for the full batch's (docs/estimator.md); False: a changed objective (dynamic sampling's
  refill).
- ``samples_from_policy``: an engine that samples from the training policy itself (no rollout correction
  needed).
- ``data_parallel``, ``trl``, ``verl``: where the choice runs (TRL and verl generate each group in one call of
  their own, so no plan but the plain one runs there).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """One named choice and what it declares (module docstring)."""

    name: str
    summary: str
    reads: tuple[str, ...] = ()
    exact: bool = True
    samples_from_policy: bool = False
    data_parallel: bool = True
    trl: bool = True
    verl: bool = True
    #: where the code is, ``module:Class`` (rollout plans, imported when a run asks for one)
    target: str = ""
    #: a prompt scheme that reads pass counts: its Beta prior (``"uniform"``, or ``"fitted"`` to the pool),
    #: the power of P(informative) that π is proportional to, and whether the run's own counts recalibrate it
    #: after a streak
    prior: str = ""
    power: float = 1.0
    calibrated: bool = False


def _table(choices: Iterable[Choice]) -> dict[str, Choice]:
    return {c.name: c for c in choices}


#: ``prompt_scheme``: how a prompt's history becomes its keep probability π_q
#: (dppo_core.pruning.prompt_keep_probs).
PROMPT_SCHEMES: dict[str, Choice] = _table([
    Choice("paper", "the DPPO paper's rule made random: the lower half by last mean |A| kept with 1 - r",
           reads=("history", "advantages")),
    Choice("proportional", "π ∝ the last group's mean |A|, r of the candidates pruned in expectation",
           reads=("history", "advantages")),
    Choice("posterior", "√P(informative) under a Beta-binomial posterior (uniform prior",
           reads=("history", "pass_counts"), prior="uniform", power=0.5),
    Choice("fitted", "P(informative) under a Beta-binomial posterior with a prior fitted to the pool",
           reads=("history", "pass_counts"), prior="fitted", power=1.0),
    Choice("streak",
           "P(informative) under a Beta-binomial posterior with a prior fitted to the pool, recalibrated "
           "after a run of all-equal groups by the earlier groups' own counts", reads=("history",
                                                                                       "pass_counts"),
           prior="fitted", power=1.0, calibrated=True),
])

#: ``completion_scheme``: how a completion's advantage becomes its keep probability p_qi.
COMPLETION_SCHEMES: dict[str, Choice] = _table([
    Choice("paper", "the DPPO paper's rule made random: the lower half by |A| kept with 1 - r",
           reads=("advantages",)),
    Choice("proportional", "p ∝ |A|, r of the completions pruned in expectation", reads=("advantages",)),
    Choice("length", "p ∝ |A| / len^γ under a budget on the expected tokens kept", reads=("advantages",
                                                                                          "lengths"),
           verl=False),
])

#: ``rollout_plan``: how a step turns its selected prompts into rolled-out, rewarded groups (dppo_core.plans).
ROLLOUT_PLANS: dict[str, Choice] = _table([
    Choice("plain", "G completions for each selected prompt, in one engine call",
           target="dppo_core.plans:Plain"),
    Choice("pilot",
           "k of each group's G first; an all-equal pilot continued with probability c_q, weighted 1/c_q "
           "(pilot_size, continue_probability, continue_scheme)", reads=("rewards", "history"), trl=False,
           verl=False, target="dppo_core.plans.pilot:Pilot"),
    Choice("dynamic_sampling", "DAPO's dynamic sampling: roll out, drop the all-equal groups, refill until "
           "prompts_per_step informative groups (with pruning greso, GRESO's skip before each round)",
           reads=("rewards", "history"), exact=False, data_parallel=False, trl=False, verl=False,
           target="dppo_core.plans.dynamic_sampling:DynamicSampling"),
    Choice("dapo_oversampled",
           "dynamic sampling as DAPO's recipe draws: 3 x prompts_per_step candidates a round, "
           "at most 10 rounds", reads=("rewards", "history"), exact=False, data_parallel=False, trl=False,
           verl=False, target="dppo_core.plans.dynamic_sampling:OversampledDynamicSampling"),
    Choice("offline_filter",
           "before the first step, roll out every pool prompt once and drop those whose group "
           "came out all right or all wrong; then plain", reads=("rewards",), exact=False,
           data_parallel=False,
           trl=False, verl=False, target="dppo_core.plans.offline_filter:OfflineFilter"),
])

#: ``rollout_engine``: what generates the completions (dppo_core.rollout.make_rollout_engine).
ROLLOUT_ENGINES: dict[str, Choice] = _table([
    Choice("hf", "transformers' generate on the training model itself", samples_from_policy=True),
    Choice("vllm", "vLLM, the policy's weights synced into it after each step (an error if it cannot start)"),
    Choice("auto", "vLLM if it starts, else transformers with a warning"),
])


def names(table: dict[str, Choice], *, reads: str | None = None) -> tuple[str, ...]:
    """The names of ``table``, in order; ``reads``: only those that read it."""
    return tuple(n for n, c in table.items() if reads is None or reads in c.reads)


def samples_from_policy(engine_name: str) -> bool:
    """Whether the engine called ``engine_name`` samples from the training policy itself (an engine this table
    does not name, such as a test's recording one, is taken not to)."""
    choice = ROLLOUT_ENGINES.get(engine_name)
    return choice is not None and choice.samples_from_policy


def plan_name(rollout_plan: str, pilot_size: int) -> str:
    """The plan a config runs: ``rollout_plan``, where ``auto`` is ``pilot`` with a pilot and ``plain``
    without."""
    if rollout_plan == "auto":
        return "pilot" if pilot_size > 0 else "plain"
    return rollout_plan
