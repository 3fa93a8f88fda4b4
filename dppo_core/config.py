"""``DPPOConfig``: every knob of a training run, documented once, validated with messages that say how to fix.

Load from YAML with :meth:`DPPOConfig.from_yaml`, override from the command line with
``key=value`` pairs (:meth:`DPPOConfig.with_overrides`), or start from a named preset
(:func:`preset`). Field names follow TRL's ``GRPOConfig`` where a user already knows them
(``num_generations``, ``beta``, ``epsilon``, ``loss_type``, ``max_completion_length``).

Beside it, torch-free like it: :mod:`dppo_core.config_checks` (the enumerations, the checks of every field,
:class:`ConfigError`) and :mod:`dppo_core.config_files` (reading YAML files, ``base:`` presets, the presets'
directory). The names the public surface lists are importable from here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dppo_core import registry
from dppo_core.config_checks import (
    ATTN_IMPLEMENTATIONS,
    COMPLETION_SCHEMES,
    CONTINUE_SCHEMES,
    FIXED_SIZE_DESIGNS,
    LOSS_TYPES,
    LR_SCHEDULES,
    PROMPT_SCHEMES,
    PRUNING_MODES,
    ROLLOUT_CORRECTIONS,
    ROLLOUT_ENGINES,
    SCALE_REWARDS,
    SCHEMES,
    UPDATE_MODES,
    ConfigError,
    check_fields,
    coerce_value,
)
from dppo_core.config_files import BASE_KEY, preset_names, preset_path, read_yaml_mapping, resolve_yaml

# The enumerations and ConfigError are defined in dppo_core.config_checks and preset_names in
# dppo_core.config_files; they are importable from here, where the public surface lists them.
__all__ = [
    "ATTN_IMPLEMENTATIONS", "COMPLETION_SCHEMES", "CONTINUE_SCHEMES", "FIXED_SIZE_DESIGNS", "LOSS_TYPES",
    "LR_SCHEDULES", "PROMPT_SCHEMES", "PRUNING_MODES", "ROLLOUT_CORRECTIONS", "ROLLOUT_ENGINES",
    "SCALE_REWARDS", "SCHEMES", "UPDATE_MODES",
    "ConfigError", "DPPOConfig", "field_docs", "field_groups", "learning_rate_at", "preset", "preset_names",
    "preset_overrides",
]


@dataclass
class DPPOConfig:
    # --- model and data -------------------------------------------------------------------------
    model: str = "tiny"
    """``"tiny"``: the embedded warm-started tiny model (shipped with the package, cached on first use);
    ``"smollm2-135m"``: SmolLM2-135M-Instruct, fetched from the package index on first use
    (:mod:`dppo_core.pretrained`); otherwise a local directory or a Hugging Face Hub id of a causal LM."""
    task: str = "arithmetic"
    """``"arithmetic"``: the embedded task; otherwise a benchmark name or a jsonl path of rows with
    ``problem`` and ``answer`` fields (:func:`dppo_core.benchmark_data.load_benchmark`) or chat rows
    (``prompt``: a list of messages, as TRL's conversational format; ``answer``)."""
    train_levels: tuple[int, ...] = (2, 3, 4, 5)
    """Levels of the embedded task to train on (ignored for other tasks)."""
    level_weights: tuple[float, ...] | None = None
    """Sampling weight of each level in ``train_levels``; None: uniform."""
    train_pool_size: int | None = None
    """Train on a fixed pool of this many prompts: the first N training prompts in one fixed shuffled
    order (drawn with the level weights; the same pool for every seed and method), sampled uniformly.
    Prompts then recur about every N / ``prompts_per_step`` steps, as in multi-epoch training on a fixed
    set, which is what prompt pruning needs history for. None: the whole training set."""
    system_prompt: str | None = None
    """A system message put first in every prompt, in training and in evaluation (a row with its own keeps
    it)."""
    few_shot: int = 0
    """Solved examples (``75+72=147. \\boxed{147}``) put before each question of the embedded task as
    user/assistant turns, the same N for every prompt (:func:`dppo_core.data.few_shot_turns`). A jsonl task
    writes its own."""

    # --- rollout ----------------------------------------------------------------------------------
    num_generations: int = 8
    """G: completions sampled per prompt; the group that advantages are computed over (>= 2)."""
    prompts_per_step: int = 32
    """Prompts sent to the rollout engine per optimizer step (the generation batch is this times G)."""
    max_completion_length: int = 64
    """Maximum new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature for rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling threshold for rollouts, in (0, 1]."""
    rollout_engine: str = "hf"
    """``"hf"`` (the training model with transformers: :class:`~dppo_core.rollout.HFRollout`, whose compact
    loop drops finished sequences), ``"vllm"`` (error if vLLM cannot start) or ``"auto"`` (vLLM if it starts,
    else transformers with a warning). On CPU with the tiny model ``hf`` is as fast as vLLM
    (``benchmarks/results/rollout_throughput.md``)."""
    rollout_correction: str = "auto"
    """Correct the loss for the engine sampling from its own copy mu of the policy (other kernels, precision,
    batch shapes) instead of the policy pi being trained: ``"token"`` multiplies each token's loss by
    min(pi_old / mu, ``rollout_correction_cap``) (truncated importance sampling, as TRL does by default),
    ``"sequence"`` each completion's by min(prod_t pi_old / mu, cap) (exact below the cap, more variance),
    ``"off"`` trusts the engine. ``"auto"``: ``token`` with vLLM, ``off`` with the transformers engine, which
    samples from the training model itself (mu = pi). With ``top_p < 1`` mu is renormalised over the nucleus
    and pi_old is not, so the weights sit below 1: the correction then also accounts for the nucleus. Logged
    per step as ``engine_weight_mean``, ``engine_weight_truncated`` and ``engine_logprob_diff_max``."""
    rollout_correction_cap: float = 2.0
    """C >= 1, the truncation of ``rollout_correction``'s weights (2: Yao et al., 2025)."""

    # --- objective --------------------------------------------------------------------------------
    learning_rate: float = 1e-4
    """AdamW peak learning rate (> 0)."""
    beta: float = 0.0
    """Weight of the k3 KL penalty to the reference policy (>= 0; 0 disables it and its forward pass)."""
    epsilon: float = 0.2
    """Lower clipping range of the probability ratio: clip(rho, 1 - epsilon, ...)."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher); None: same as ``epsilon``."""
    loss_type: str = "grpo"
    """``"grpo"`` (sequence mean), ``"dr_grpo"`` (constant normaliser; Dr. GRPO also drops the std scaling,
    which needs ``scale_rewards: none`` as well) or ``"dapo"`` (token mean over every
    rolled-out completion: unbiased under completion pruning; refused with DPPO's prompt pruning, where the
    token count of the prompts never rolled out is unknown and the loss would be about 1 / mean(pi) too
    large)."""
    scale_rewards: str = "group"
    """Advantage scaling: ``"group"`` std, ``"batch"`` std (refused with DPPO's prompt pruning: the std of the
    kept prompts' rewards depends on the draw), or ``"none"``."""
    num_iterations: int = 1
    """PPO epochs over each batch of rollouts (old log-probs are computed only when > 1)."""
    micro_batch_size: int = 64
    """Completions per forward/backward pass; gradients are accumulated over micro-batches."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (<= 0 disables clipping)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps (then ``lr_schedule``)."""
    lr_schedule: str = "constant"
    """After the warm-up: ``"constant"``, or ``"cosine"`` / ``"linear"`` decay from ``learning_rate`` to
    ``min_lr_ratio * learning_rate`` at step ``max_steps`` (so raising ``max_steps`` on resume stretches the
    decay). A function of the step alone, so a resumed run follows the same schedule. The presets keep
    ``constant`` (equal tuning kept it for every method, docs/benchmarks.md); set a decay for a long run whose
    accuracy flattens while the loss still moves, as TRL's ``lr_scheduler_type`` does."""
    min_lr_ratio: float = 0.0
    """Where a decaying ``lr_schedule`` ends, as a fraction of ``learning_rate`` (0: decay to zero); set it
    with a decay that should not stop learning at the end (e.g. 0.1, TRL's ``cosine_with_min_lr``)."""

    # --- pruning (DPPO, chapter 05-06) -------------------------------------------------------------
    pruning: str = "none"
    """``"none"`` (plain GRPO), ``"dppo"`` (Dynamic Pruning Policy Optimization, not Divergence PPO: pruned
    prompts and completions, importance weights 1 / (pi_q p_qi), so the loss and its gradient at the step's
    parameters are unbiased for the full batch's; not the optimizer's update), or the BIASED baselines
    ``"cppo"`` (top-k completions by |A|, no weights), ``"greso"`` (skip prompts whose last group was
    all equal, no weights) and ``"pods"`` (keep the G - round(r_o*G) completions whose rewards vary most,
    no weights, advantages over the kept ones)."""
    prompt_prune_rate: float = 0.0
    """r_q in [0, 1): how hard to prune prompts before rollout (``prompt_scheme`` says what it means). With
    ``dense_prompts`` and the ``proportional`` or ``posterior`` scheme it sets how far the window looks ahead:
    about ``prompts_per_step`` / (1 - r_q) candidates, of which ``prompts_per_step`` are kept in
    expectation."""
    completion_prune_rate: float = 0.0
    """r_o in [0, 1): how hard to prune completions after reward (per group of G)."""
    greso_target_zero_variance: float | None = None
    """``pruning: greso`` with GRESO's own adaptive rule (keep max(p^z, 0.01) after z all-equal groups in a
    row, p adapted each step toward this share of zero-variance groups; the authors use 0.25) instead of one
    skip rate."""
    prompt_scheme: str = "paper"
    """Prompt keep probabilities: ``"paper"`` (the lower half by history score kept with 1 - r_q),
    ``"proportional"`` (proportional to the last mean |A|, expected fraction pruned r_q) or ``"posterior"``
    (proportional to sqrt(P(the next group is informative)) under a Beta-binomial posterior over the prompt's
    success rate from its whole history, discounted by ``posterior_half_life``; unseen prompts by the prior)
    or ``"fitted"`` (proportional to that P itself, under a Beta prior fitted to the pool's pass counts:
    sharper) or ``"streak"`` (``fitted``'s P, recalibrated for prompts after a run of all-equal groups by how
    often this run's prompts with as long a run were informative next: GRESO's streaks, kept exact by 1/π)."""
    completion_scheme: str = "proportional"
    """Completion keep probabilities: ``"proportional"`` (to |A|, expected fraction pruned r_o;
    variance-minimising when a completion's gradient size is proportional to |A|), ``"length"`` (to
    |A| / len^``length_exponent``, expected fraction of the group's tokens pruned r_o: variance per token
    trained) or ``"paper"`` (the lower half by |A| kept with 1 - r_o)."""
    posterior_half_life: float | None = 20.0
    """``prompt_scheme: posterior``: a group's evidence on its prompt counts half after this many steps (the
    policy moves); None: never discounted."""
    completion_target_ess: float | None = None
    """Adapt the completion prune rate per step: the largest rate up to ``completion_prune_rate`` (in steps of
    0.05) whose predicted Kish effective sample size of the step's weights is at least this (None: the fixed
    rate). The rate depends only on the step's advantages and the prompts' keep probabilities, so the loss and
    its gradient conditional on the step's prompt draw stay unbiased; it prunes more when many completions
    carry signal and less when signal is scarce. No preset sets it: in the ablation on one seed
    (``benchmarks/results/ablation``) a target of 48 reached the target accuracy 1.74x sooner than
    ``grpo_skip``, against 1.36x for the same scheme at a fixed rate of 0.7 and 1.79x for the preset's
    ``length`` scheme; set it when the share of informative groups changes a lot during a run."""
    length_exponent: float = 0.5
    """``completion_scheme: length``: gamma in p ∝ |A| / len^gamma (0.5: gradient size independent of length;
    1: shrinking like 1 / sqrt(len))."""
    min_prompt_keep_prob: float = 0.1
    """Floor of a prompt's keep probability (bounds the importance weights; in (0, 1])."""
    min_completion_keep_prob: float = 0.1
    """Floor of a completion's keep probability (in (0, 1]); completions with A = 0 and beta = 0 have
    an identically zero loss and may get 0 (``drop_zero_advantage``)."""
    drop_zero_advantage: bool = True
    """With ``pruning: dppo`` and beta = 0, never train on completions with A = 0 (exact, no bias)."""
    fixed_size_sampling: bool = False
    """Keep exactly the expected number of items each step (a fixed-size design, ``fixed_size_design``)
    instead of independent coin flips; same inclusion probabilities, steadier batch sizes."""
    fixed_size_design: str = "systematic"
    """With ``fixed_size_sampling``: ``"systematic"`` (systematic PPS in a random order), ``"sorted"`` (the
    same in the order of a score: the prompts' keep probability, the completions' signed advantage, so the
    kept set is spread over it like a stratified sample) or ``"pivotal"`` (ordered pivotal sampling in that
    order). Every design keeps item j with probability exactly its p_j."""
    dense_prompts: bool = False
    """Look ahead in the dataset for candidates until the expected number of kept prompts reaches
    ``prompts_per_step``, so the generation batch stays full. Each step is unbiased for the full-batch loss
    over its window B (normaliser |B|*G; |B| is chosen from the history before the draw), but a prompt counts
    1/(|B|*G) in its step, less where it shares the window with many low-probability prompts: over many steps
    this is not fixed-size GRPO's objective with ``prompts_per_step`` prompts."""
    prompt_window_factor: int = 4
    """With ``dense_prompts``, look at most this many times ``prompts_per_step`` candidates ahead. Raise it
    only if the prompt keep probabilities are so low that the window fills up before ``prompts_per_step`` are
    expected to be kept (then fewer are rolled out than asked)."""
    rollout_plan: str = "auto"
    """How a step turns its kept prompts into rolled-out, rewarded groups (:mod:`dppo_core.plans`; each
    declared, with what it reads and where it runs, in :data:`dppo_core.registry.ROLLOUT_PLANS`): ``"plain"``
    (G completions each, one engine call), ``"pilot"`` (``pilot_size`` first, then the rest of the continued
    groups), ``"dynamic_sampling"`` and ``"dapo_oversampled"`` (DAPO's refill until ``prompts_per_step``
    groups are informative: a changed objective, one process), ``"offline_filter"`` (the pool's all-equal
    prompts dropped once before the first step; cannot resume) or ``"auto"`` (``pilot`` when
    ``pilot_size`` > 0, else ``plain``)."""
    pilot_size: int = 0
    """Pilot, then continue (``pruning: dppo``): roll out this many of each kept prompt's G completions first
    (0: off; at most G - 1). A group whose pilot rewards are not all equal gets the rest; one whose pilot is
    all equal gets the rest with probability c_q (``continue_probability``, ``continue_scheme``) and then
    weight 1 / c_q, or is stopped (its pilot is not trained on). Unbiased for the full-group loss and gradient
    at the step's parameters."""
    continue_probability: float = 0.25
    """c in (0, 1]: with ``pilot_size``, the probability that a group whose pilot came out all equal is
    continued (``continue_scheme: posterior``: the least such probability)."""
    continue_scheme: str = "constant"
    """With ``pilot_size``: ``"constant"`` (c_q = ``continue_probability``) or ``"posterior"`` (c_q = the
    larger of it and P(the rest makes the group informative), from a Beta prior fitted to the pool, the
    prompt's history and its pilot: prompts whose history is mixed are continued, those all equal before and
    now mostly stopped)."""
    history_max_age: int | None = None
    """Forget a prompt's history after this many steps (it is then treated as unseen: kept); None: never. The
    ``posterior`` scheme discounts old evidence already (``posterior_half_life``); set this with the ``paper``
    or ``proportional`` scheme when the policy moves fast enough that a record many steps old misleads."""

    # --- packing (chapter 07) ---------------------------------------------------------------------
    packing: bool = False
    """Train on dense rows: whole sequences back to back in rows of ``max_tokens_per_row`` tokens with a
    block-diagonal attention mask (flash-attention varlen on GPU), instead of one padded sequence per row."""
    max_tokens_per_row: int = 256
    """Token budget of a packed row (a longer sequence gets a row of its own, never truncated). On CPU, a
    few times the typical sequence length (the masked attention pays for row length squared)."""
    packing_window: int = 16
    """The greedy packer looks this many sequences ahead for the longest one that still fits a row. Set it
    only when ``update_density`` (logged per step: real tokens over token slots) is low; on the CPU
    benchmark's packed updates it is 0.89-0.91 (median per run, ``benchmarks/results/cpu-baselines``, seed 1)
    with the default."""
    packing_rows_per_micro_batch: int = 16
    """Packed rows per forward/backward pass (replaces ``micro_batch_size`` when ``packing`` is on)."""
    shared_prefix: bool = False
    """Lay out each prompt once for its group's completions in the update (``P + G·R`` tokens instead of
    ``G·(P + R)``; :mod:`dppo_core.shared_prefix`). Same log-probs, loss and gradient up to float rounding.
    With ``attn_implementation: auto`` the policy runs segment attention: each micro-batch is one unpadded
    row of whole segments (as many tokens as ``packing_rows_per_micro_batch`` rows of ``max_tokens_per_row``
    with ``packing``, else about ``micro_batch_size`` sequences' worth), and attention is computed per
    segment. With ``sdpa`` or ``eager``: segments (a prompt and as many of its completions as fit in
    ``max_tokens_per_row``) packed into rows with ``packing``, else one segment per row, under an explicit
    mask. Flash-attention and ``torch_varlen`` cannot express a shared prefix and are refused."""

    # --- update mode ------------------------------------------------------------------------------
    update_mode: str = "full"
    """``"full"`` fine-tuning, ``"lora"``, ``"qlora4"`` or ``"qlora8"`` (LoRA on a bitsandbytes 4/8-bit
    base)."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj")
    """Module names that get LoRA adapters (Qwen3, Llama and Qwen2 name them so); set it for a model whose
    projection layers are named otherwise (e.g. ``["c_attn", "c_proj"]`` for GPT-2), or to adapt fewer."""
    attn_implementation: str = "auto"
    """The policy's attention kernel: ``"auto"`` (on a CUDA device ``flash_attention_2`` when the
    ``flash-attn`` package is installed, else ``torch_varlen``, so a packed update runs a variable-length
    kernel; ``sdpa`` on CPU; with ``shared_prefix`` segment attention, :mod:`dppo_core.shared_prefix`),
    ``"sdpa"``, ``"eager"``, ``"flash_attention_2"`` (CUDA with ``flash-attn`` only) or ``"torch_varlen"``
    (CUDA of compute capability 8.0+: PyTorch's own variable-length kernel in the packed update, sdpa
    elsewhere, nothing to install; :mod:`dppo_core.varlen`)."""

    # --- run --------------------------------------------------------------------------------------
    max_steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """Seed for prompt sampling, rollouts and initialisation."""
    output_dir: str = "runs/dppo"
    """Where metrics, checkpoints and the final model go."""
    save_steps: int = 50
    """Checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    eval_steps: int = 0
    """Evaluate on held-out problems every this many steps (0: only before and after)."""
    eval_levels: tuple[int, ...] | None = None
    """Levels of the embedded task to evaluate on; None: ``train_levels`` (add level 1 to watch
    forgetting)."""
    eval_problems_per_level: int = 200
    """Held-out problems per level for evaluation."""
    eval_samples: int = 4
    """Samples per held-out problem at temperature 1 (sampled accuracy)."""
    eval_benchmarks: tuple[str, ...] = ()
    """For a task other than the embedded one: math benchmarks to evaluate on (names such as ``math500``,
    ``gsm8k``, or jsonl paths; see :func:`dppo_core.benchmark_data.load_benchmark`), pass@1 greedy and
    sampled, logged in eval.jsonl. Empty: such runs log no accuracy."""
    eval_benchmark_limit: int | None = None
    """Evaluate on the first this many problems of each of ``eval_benchmarks``; None: all of them. Set it to
    keep each evaluation short during a run (e.g. 100), and evaluate the final model on everything with
    ``dppo eval``."""
    log_groups: bool = True
    """Write ``groups.jsonl``: per step, every rolled-out group's prompt id, inclusion probability π_q,
    rewards and completion lengths (what :mod:`dppo_core.tools.bench.ceiling` and offline studies of prompt
    pruning read; 2.4 KB per step of 32 groups of 8 on the embedded task). Set False for very large runs that
    need none of it."""
    tensorboard: bool = False
    """Also write TensorBoard scalars (needs the ``tensorboard`` package), to watch a long run live; the same
    numbers are always in ``metrics.jsonl`` and ``eval.jsonl``."""
    deterministic: bool = True
    """Use deterministic torch algorithms (on CPU this makes runs repeatable step for step)."""
    device: str = "auto"
    """``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``."""
    cpu_threads: int | None = None
    """PyTorch's CPU threads (``torch.set_num_threads``); None: its default, one per core."""

    def __post_init__(self) -> None:
        for name in ("train_levels", "level_weights", "lora_target_modules", "eval_levels",
                     "eval_benchmarks"):
            value = getattr(self, name)
            if isinstance(value, list):
                setattr(self, name, tuple(value))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field that is invalid, and how to fix it."""
        check_fields(self)

    @property
    def plan(self) -> str:
        """The rollout plan this config runs (:data:`dppo_core.registry.ROLLOUT_PLANS`): ``rollout_plan``,
        with ``auto`` resolved (``pilot`` with a ``pilot_size``, else ``plain``). What a run builds from the
        config (the estimator, the plan, the TRL and verl adapters' checks) reads this name, not
        ``pilot_size``; only the pilot plan reads the count."""
        return registry.plan_name(self.rollout_plan, self.pilot_size)

    # --- loading and overriding -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> DPPOConfig:
        known = {f.name for f in fields(cls)}
        # a config.json of a run made before the field was removed
        if "extra" in data and "extra" not in known:
            if data["extra"]:
                raise ConfigError(f"{source}: 'extra' is no longer a config field and holds "
                                  f"{data['extra']!r}; "
                                  "remove it (settings of your own belong in your own code)")
            data = {k: v for k, v in data.items() if k != "extra"}
        unknown = sorted(set(data) - known)
        if unknown:
            import difflib

            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"{source}: unknown key(s) {', '.join(hints)}; see DPPOConfig for the fields")
        types = {f.name: str(f.type) for f in fields(cls)}
        return cls(**{k: coerce_value(k, v, types[k], source) for k, v in data.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> DPPOConfig:
        """The configuration a YAML file describes; ``base: PRESET`` in it starts from that preset (see
        :func:`~dppo_core.config_files.resolve_yaml`), and the file's own fields replace the preset's."""
        path = Path(path)
        return cls.from_dict(resolve_yaml(path), source=str(path))

    def with_overrides(self, overrides: list[str] | dict[str, Any]) -> DPPOConfig:
        """A copy with ``key=value`` strings (values parsed as YAML) or a dict applied."""
        import yaml

        if isinstance(overrides, dict):
            updates = dict(overrides)
        else:
            updates = {}
            for item in overrides:
                if "=" not in item:
                    raise ConfigError(f"override {item!r} must look like key=value, e.g. learning_rate=3e-4")
                key, value = item.split("=", 1)
                updates[key.strip()] = yaml.safe_load(value)
        return DPPOConfig.from_dict({**self.to_dict(), **updates}, source="overrides")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def learning_rate_at(step: int, config: DPPOConfig) -> float:
    """The learning rate of (0-based) ``step``: linear warm-up over ``warmup_steps`` (step 0 at
    ``learning_rate / warmup_steps``), then ``lr_schedule`` decays from ``learning_rate`` towards
    ``min_lr_ratio * learning_rate``, which it would reach at step ``max_steps`` (the last step,
    ``max_steps - 1``, is one step short of it)."""
    c = config
    if step < c.warmup_steps:
        return c.learning_rate * (step + 1) / c.warmup_steps
    if c.lr_schedule == "constant":
        return c.learning_rate
    progress = min(1.0, (step - c.warmup_steps) / max(1, c.max_steps - c.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if c.lr_schedule == "cosine" else 1.0 - progress
    return c.learning_rate * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * shape)


def field_docs() -> dict[str, str]:
    """Each field's documentation (the string under it in the class body), for ``--help`` and docs."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(DPPOConfig))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef)  # the source of a class is its definition
    body = class_def.body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)):
            assert isinstance(node.target, ast.Name)  # a field of a class body is a plain name
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def field_groups() -> dict[str, list[str]]:
    """The fields in class order, under the ``# --- group ---`` comment each stands under (``--help``,
    docs)."""
    import ast
    import inspect
    import re

    source = inspect.getsource(DPPOConfig)
    lines = source.splitlines()
    header = re.compile(r"^\s*# -+ (.+?) -+\s*$")
    groups: dict[str, list[str]] = {}
    current, seen = "other", 0  # the group, and the source lines read for headers so far
    class_def = ast.parse(source).body[0]
    assert isinstance(class_def, ast.ClassDef)  # the source of a class is its definition
    for node in class_def.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            for line in lines[seen : node.lineno - 1]:
                if match := header.match(line):
                    current = match.group(1).strip()
            seen = node.lineno
            groups.setdefault(current, []).append(node.target.id)
    return groups


def preset(name: str) -> DPPOConfig:
    """A named configuration shipped with the package (``dppo_core/presets/NAME.yaml``)."""
    return DPPOConfig.from_yaml(preset_path(name))


def preset_overrides(name: str) -> dict[str, Any]:
    """What preset ``name`` states itself on top of its ``base`` (every field, for a preset without one).

    Keys in the order the file states them, values as the resolved configuration holds them (YAML lists
    as tuples). ``preset_overrides("tiny-dppo")`` is what DPPO changes on tiny-grpo.
    """
    config = preset(name)
    own = read_yaml_mapping(preset_path(name))
    return {key: getattr(config, key) for key in own if key != BASE_KEY}
