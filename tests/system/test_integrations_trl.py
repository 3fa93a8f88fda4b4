"""DPPOGRPOTrainer (dppo_core.integrations.trl): TRL's GRPOTrainer with DPPO's pruning, on CPU and a tiny model.

Each training run is one or a few steps of a 2-layer model (a few seconds); the first test of a session also
pays for importing TRL (which imports vLLM: 10-15 s).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dppo_core.config import DPPOConfig
from dppo_core.estimator import DPPOEstimator, Estimator, Selection, Weighting, make_estimator

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (imports and refusals) cannot.

ROWS = [{"id": f"q{i}", "prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(8)]
G = 4


def char_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A deterministic reward with spread within groups (so advantages, and gradients, are not zero)."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


@pytest.fixture(scope="module")
def trl() -> Any:
    trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'dppo-core[bench]'")
    trl.GRPOTrainer  # noqa: B018  (TRL imports its trainers lazily; this one imports vLLM: 10-15 s, paid here)
    return trl


def make_trainer(trl: Any, model_dir: Path, out: Path, estimator: Estimator | None = None, cls: type | None = None,
                 steps: int = 1, **overrides: Any) -> Any:
    """GRPOTrainer (``estimator`` None) or DPPOGRPOTrainer for ``steps`` optimizer steps on ROWS.

    Default batch: 4 prompts x G=4 completions per generation batch, 4 micro-batches of 4 completions.
    """
    from datasets import Dataset
    from transformers import AutoTokenizer

    from dppo_core.integrations.trl import DPPOGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    kwargs = dict(output_dir=str(out), seed=0, max_steps=steps, per_device_train_batch_size=4,
                  gradient_accumulation_steps=4, num_generations=G, max_completion_length=8, learning_rate=1e-2,
                  loss_type="grpo", beta=0.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                  logging_steps=1, disable_tqdm=True, dataloader_pin_memory=False,
                  model_init_kwargs={"dtype": "float32"})
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}  # None: GRPOConfig's own default
    cls = cls or (trl.GRPOTrainer if estimator is None else DPPOGRPOTrainer)
    extra = {} if estimator is None else {"estimator": estimator}
    return cls(model=str(model_dir), reward_funcs=[char_reward], args=trl.GRPOConfig(**kwargs),
               train_dataset=Dataset.from_list(ROWS), processing_class=tokenizer, **extra)


def run(trl: Any, model_dir: Path, out: Path, estimator: Estimator | None = None, cls: type | None = None,
        steps: int = 1, **overrides: Any) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """Train; return the trainer, TRL's train output and each parameter's change."""
    trainer = make_trainer(trl, model_dir, out, estimator, cls, steps, **overrides)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    output = trainer.train()
    delta = {k: v.detach() - before[k] for k, v in trainer.model.named_parameters()}
    return trainer, output, delta


def max_abs(delta: dict[str, torch.Tensor]) -> float:
    return max(float(v.abs().max()) for v in delta.values())


def assert_same_update(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"updates differ by up to {worst:.3g}"


class FixedSelect(Estimator):
    """Keeps the candidates at the given positions with probability ``prob`` each."""

    def __init__(self, positions: list[int], prob: float = 0.5):
        super().__init__()
        self.positions, self.prob = positions, prob

    def select(self, candidate_ids: list[str], step: int, size: int | None = None) -> Selection:
        kept = [i for i in self.positions if i < len(candidate_ids)]
        return Selection(kept, torch.full((len(kept),), self.prob, dtype=torch.float64), len(candidate_ids))


class FixedWeights(Estimator):
    """Every prompt rolled out; completion weights from ``weight_of(P, G)`` (0 = dropped), normaliser ``c``."""

    def __init__(self, weight_of: Any, c: int):
        super().__init__()
        self.weight_of, self.c, self.seen = weight_of, c, []

    def weigh(self, advantages: torch.Tensor, selection: Selection | None = None, step: int = 0) -> Weighting:
        w = self.weight_of(*advantages.shape).to(torch.float64)
        self.seen.append((advantages.clone(), w))
        return Weighting(w > 0, w, self.c)


# --------------------------------------------------------------------------------------------------
# Without pruning it is TRL's GRPOTrainer
# --------------------------------------------------------------------------------------------------


NO_PRUNING = {
    # loss_type, GRPOConfig overrides, steps: GA = steps_per_generation; one generation batch per optimizer step
    "grpo-kl": ("grpo", {"beta": 0.04}, 1),
    # two optimizer steps on one generation batch (S/GA = 2): old log-probs, ratios != 1, KL bias correction
    "dr_grpo-kl-split": ("dr_grpo", {"beta": 0.04, "gradient_accumulation_steps": 2, "steps_per_generation": 4}, 2),
    # two PPO iterations per generation batch
    "sapo-iterations": ("sapo", {"beta": 0.04, "num_iterations": 2}, 2),
    "luspo-sequence": ("luspo", {"beta": 0.04, "importance_sampling_level": "sequence"}, 1),
    # TRL's default loss type: the token sum over every rolled-out completion token, KL importance-corrected (TRL's
    # default use_bias_correction_kl), in one accumulation window and split over two optimizer steps
    "dapo-kl": ("dapo", {"beta": 0.04}, 1),
    "dapo-kl-split": ("dapo", {"beta": 0.04, "gradient_accumulation_steps": 2, "steps_per_generation": 4}, 2),
}


@pytest.mark.numerics
@pytest.mark.parametrize("case", list(NO_PRUNING))
def test_keep_everything_matches_grpo_trainer(trl, small_model_dir, tmp_path, case):
    """With every keep probability 1, one or two steps give TRL's loss and TRL's parameter update."""
    loss_type, overrides, steps = NO_PRUNING[case]
    estimator = (Estimator() if not case.endswith("-split")
                 else DPPOEstimator(prompt_prune_rate=0.0, completion_prune_rate=0.0, drop_zero_advantage=False))
    _, plain, plain_delta = run(trl, small_model_dir, tmp_path / "plain", steps=steps, loss_type=loss_type, **overrides)
    trainer, ours, our_delta = run(trl, small_model_dir, tmp_path / "dppo", estimator, steps=steps,
                                   loss_type=loss_type, **overrides)
    assert max_abs(plain_delta) > 1e-4  # the step did something
    assert ours.training_loss == pytest.approx(plain.training_loss, rel=1e-5, abs=1e-7)
    assert_same_update(our_delta, plain_delta)
    assert trainer.estimator_step == 1  # one generation batch in every case
    assert len(trainer.estimator.history) == 4 * trainer.estimator_step  # every rolled-out prompt observed


# --------------------------------------------------------------------------------------------------
# Prompt pruning happens before generation
# --------------------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_pruned_prompts_never_reach_generation(trl, small_model_dir, tmp_path):
    from dppo_core.integrations.trl import ESTIMATOR_FILE, DPPOGRPOTrainer

    seen: dict[str, list] = {"candidates": [], "generated": []}

    class Recording(DPPOGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            seen["candidates"].append([row["prompt"] for row in inputs])
            return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts):
            seen["generated"].append(list(prompts))
            return super()._generate(prompts)

    estimator = FixedSelect([0, 2], prob=0.5)
    trainer, output, delta = run(trl, small_model_dir, tmp_path, estimator, cls=Recording,
                                 save_strategy="steps", save_steps=1)
    (candidates,), (generated,) = seen["candidates"], seen["generated"]
    groups = [candidates[i:i + G] for i in range(0, len(candidates), G)]
    assert len(groups) == 4
    assert generated == groups[0] + groups[2]  # the kept prompts, G rows each, and nothing else
    ids = {row["prompt"]: row["id"] for row in ROWS}
    assert set(trainer.estimator.history.records) == {ids[groups[0][0]], ids[groups[2][0]]}
    assert max_abs(delta) > 0 and torch.isfinite(torch.tensor(output.training_loss))

    # the estimator's history travels with TRL's checkpoint
    state = json.loads((tmp_path / "checkpoint-1" / ESTIMATOR_FILE).read_text())
    assert state["estimator_step"] == 1
    records = trainer.estimator.history.state_dict()
    trainer.estimator, trainer.estimator_step = Estimator(), 0
    trainer._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-1"))  # what train(resume_from_checkpoint) calls
    assert trainer.estimator_step == 1 and trainer.estimator.history.state_dict() == records


@pytest.mark.numerics
def test_every_prompt_pruned_is_a_step_without_update(trl, small_model_dir, tmp_path):
    seen: list = []

    from dppo_core.integrations.trl import DPPOGRPOTrainer

    class Recording(DPPOGRPOTrainer):
        def _generate(self, prompts):
            seen.append(prompts)
            return super()._generate(prompts)

    trainer, output, delta = run(trl, small_model_dir, tmp_path, FixedSelect([]), cls=Recording)
    assert seen == [] and output.training_loss == 0.0
    assert max_abs(delta) == 0.0  # no gradient reaches AdamW
    assert trainer.estimator_step == 1


@pytest.mark.numerics
def test_dppo_estimator_prunes_and_trains(trl, small_model_dir, tmp_path):
    """The real estimator end to end: 3 steps over 8 prompts. Steps 1-2 see every prompt once (unseen prompts
    are always rolled out); at step 3 the lower-scoring half of the prompts are candidates kept with
    probability 0.5, and systematic sampling keeps exactly 2 or 3 of the 4."""
    estimator = DPPOEstimator(prompt_prune_rate=0.5, completion_prune_rate=0.5, fixed_size_sampling=True,
                              min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2)
    trainer, output, delta = run(trl, small_model_dir, tmp_path, estimator, steps=3, per_device_train_batch_size=8,
                                 gradient_accumulation_steps=2, max_completion_length=4)
    assert trainer.estimator_step == 3 and len(trainer.estimator.history) == 8
    kept = [r for r in trainer.state.log_history if "dppo/prompts_kept" in r]
    assert [r["dppo/prompts_kept"] for r in kept][:2] == [1.0, 1.0] and kept[2]["dppo/prompts_kept"] in (0.5, 0.75)
    assert all(0 < r["dppo/completions_kept"] < 1 for r in kept)
    assert torch.isfinite(torch.tensor(output.training_loss)) and max_abs(delta) > 0


# --------------------------------------------------------------------------------------------------
# The weights and the normaliser reach TRL's loss
# --------------------------------------------------------------------------------------------------


def ramp(p: int, g: int) -> torch.Tensor:
    """Weights 1..P·G, with every third completion dropped."""
    w = torch.arange(1, p * g + 1, dtype=torch.float64).view(p, g)
    return torch.where(torch.arange(p * g).view(p, g) % 3 == 0, 0.0, w)


@pytest.mark.numerics
def test_loss_is_the_weighted_sum_over_the_normaliser(trl, small_model_dir, tmp_path):
    """One PPO iteration (ratio 1, beta 0): TRL's grpo loss of a completion is -A, so the step's loss is
    -Σ_kept w·A / C, with C the estimator's normaliser (not the number of completions kept)."""
    estimator = FixedWeights(ramp, c=40)
    trainer, output, _ = run(trl, small_model_dir, tmp_path, estimator)
    ((advantages, w),) = estimator.seen
    assert advantages.abs().sum() > 0
    expected = float(-(w * advantages).sum() / 40)
    assert output.training_loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert trainer.state.log_history[0]["dppo/completions_kept"] == pytest.approx(10 / 16)


class FixedWeightsWithLengths(FixedWeights):
    """:class:`FixedWeights` that also records each completion's token count (as the ``length`` scheme reads it)."""

    needs_lengths = True

    def weigh(self, advantages: torch.Tensor, selection: Selection | None = None, step: int = 0,
              lengths: torch.Tensor | None = None) -> Weighting:
        self.lengths = lengths
        return super().weigh(advantages, selection, step)


@pytest.mark.numerics
def test_trls_default_loss_type_trains_with_dppos_estimator(trl, small_model_dir, tmp_path):
    """GRPOConfig's own loss_type (dapo in TRL 1.16) and use_bias_correction_kl (True) left as they are: the real
    estimator pruning completions trains, and the loss is Σ_kept w·(token sum of ℓ) over every rolled-out
    completion token (fixed before the completion draw), not over the kept ones."""
    estimator = DPPOEstimator(completion_prune_rate=0.5, fixed_size_sampling=True, min_completion_keep_prob=0.2,
                              beta=0.04)  # TRL's KL term: completions with A = 0 keep a loss
    trainer, output, delta = run(trl, small_model_dir, tmp_path / "dppo", estimator, loss_type=None, beta=0.04)
    assert trainer.args.loss_type == "dapo" and trainer.args.use_bias_correction_kl
    kept = [r["dppo/completions_kept"] for r in trainer.state.log_history if "dppo/completions_kept" in r]
    assert kept and all(0 < k < 1 for k in kept)
    assert max_abs(delta) > 0 and torch.isfinite(torch.tensor(output.training_loss))

    # one PPO iteration (ratio 1, beta 0): a completion's per-token loss is -A, its token sum -A·T
    fixed = FixedWeightsWithLengths(ramp, c=16)
    _, output, _ = run(trl, small_model_dir, tmp_path / "fixed", fixed, loss_type=None)
    ((advantages, w),) = fixed.seen
    lengths = fixed.lengths.to(torch.float64)
    assert advantages.abs().sum() > 0 and (w == 0).any() and lengths.sum() > lengths[w > 0].sum()
    expected = float(-(w * advantages * lengths).sum() / lengths.sum())
    assert output.training_loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    kept_only = float(-(w * advantages * lengths).sum() / lengths[w > 0].sum())  # what TRL's count would give
    assert output.training_loss != pytest.approx(kept_only, rel=1e-3)


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type,bias_correction", [("grpo", True), ("dr_grpo", True), ("dapo", True),
                                                       ("dapo", False)])
def test_loss_and_gradient_are_the_weighted_sum(trl, small_model_dir, tmp_path, loss_type, bias_correction):
    """One micro-batch through DPPOGRPOTrainer._compute_loss against the loss written out by hand:
    (S/GA)·(1/C)·Σ w·ℓ (dapo: (S/GA)·Σ w·(token sum of ℓ) / the generation batch's tokens), ℓ = TRL's clipped
    surrogate plus beta·k3 KL (times the ratio with TRL's bias correction, its default), with ratios away from 1
    (some clipped) and a reference policy away from the model."""
    beta, eps, steps_per_generation, accumulation = 0.04, 0.2, 4, 2
    trainer = make_trainer(trl, small_model_dir, tmp_path, Estimator(), loss_type=loss_type, beta=beta,
                           gradient_accumulation_steps=accumulation, steps_per_generation=steps_per_generation,
                           use_bias_correction_kl=bias_correction)
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    gen = torch.Generator().manual_seed(1)
    n, prompt_len, completion_len = 5, 3, 6
    prompt_ids = torch.randint(10, 300, (n, prompt_len), generator=gen)
    completion_ids = torch.randint(10, 300, (n, completion_len), generator=gen)
    mask = torch.ones(n, completion_len, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0

    def logps() -> torch.Tensor:  # the completion tokens' log-probs, written out (no TRL kernel)
        ids = torch.cat([prompt_ids, completion_ids], 1)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, prompt_len - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, completion_ids[..., None]).squeeze(-1)

    with torch.no_grad():
        logp0 = logps()
    old = logp0 + 0.3 * torch.randn(logp0.shape, generator=gen)
    ref = logp0 + 0.5 * torch.randn(logp0.shape, generator=gen)
    advantages = torch.randn(n, generator=gen)
    weights = torch.tensor([1.0, 2.5, 4.0, 0.5, 3.0], dtype=torch.float64)
    c = 12.0
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": mask, "advantages": advantages, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(), "dppo_weights": weights,
              "dppo_normalizer": torch.tensor(c, dtype=torch.float64)}

    def grads(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    ours = trainer._compute_loss(model, inputs)
    our_grads = grads(ours)

    logp = logps()
    ratio = torch.exp(logp - old)
    a = advantages[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    d = ref - logp
    per_token = per_token + beta * (torch.exp(d) - d - 1) * (ratio if bias_correction else 1.0)
    sums = (per_token * mask).sum(-1)
    if loss_type == "dapo":  # over the generation batch's tokens (here this micro-batch's), not over C
        hand = (weights.float() * sums).sum() / mask.sum() * steps_per_generation / accumulation
    else:
        per_row = sums / mask.sum(-1) if loss_type == "grpo" else sums / 8  # dr_grpo: / max_completion_length
        hand = (weights.float() * per_row).sum() / c * steps_per_generation / accumulation
    hand_grads = grads(hand)

    assert float(ours) == pytest.approx(float(hand), rel=1e-5)
    assert our_grads.keys() == hand_grads.keys()
    scale = max(float(g.abs().max()) for g in hand_grads.values())
    assert scale > 0
    assert_same_update(our_grads, hand_grads, atol=1e-5 * scale)


# --------------------------------------------------------------------------------------------------
# What it refuses, and TRL as an optional extra
# --------------------------------------------------------------------------------------------------


REFUSED = {
    # dapo is exact with completion pruning; with prompt pruning its normaliser counts completions never generated
    "dapo": ({"loss_type": "dapo"}, DPPOEstimator(prompt_prune_rate=0.5),
             r"loss_type='dapo'.*never generated.*loss_type='dr_grpo'.*prompt_prune_rate=0"),
    "bnpo": ({"loss_type": "bnpo"}, Estimator(), r"loss_type='bnpo'.*token count.*loss_type='dr_grpo'"),
    "batch-scaled": ({"scale_rewards": "batch"}, DPPOEstimator(prompt_prune_rate=0.5), r"scale_rewards='batch'"),
    "dense": ({}, DPPOEstimator(prompt_prune_rate=0.5, dense_prompts=True), r"dense_prompts"),
    # TRL generates a group in one call: the config's pilot (a rollout plan) cannot run there
    "pilot": ({}, make_estimator(DPPOConfig(pruning="dppo", pilot_size=2)), r"no pilot plan.*pilot_size 0"),
    # the estimator drops A = 0 completions (its beta 0), but TRL's KL term gives them a loss
    "kl": ({"beta": 0.04}, DPPOEstimator(completion_prune_rate=0.5), r"beta=0 and drops.*beta=0.04"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_would_be_biased_is_refused(trl, small_model_dir, tmp_path, case):
    overrides, estimator, match = REFUSED[case]
    with pytest.raises(ValueError, match=match):
        make_trainer(trl, small_model_dir, tmp_path, estimator, **overrides)
    if case == "batch-scaled":  # without prompt pruning, batch statistics are those of the full batch
        make_trainer(trl, small_model_dir, tmp_path, DPPOEstimator(completion_prune_rate=0.5), **overrides)


def test_importing_the_package_does_not_import_trl():
    code = "import sys, dppo_core, dppo_core.integrations; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_trl_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    monkeypatch.delitem(sys.modules, "dppo_core.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'dppo-core\[bench\]'"):
        importlib.import_module("dppo_core.integrations.trl")


def test_an_untested_trl_is_refused_in_one_line(trl, monkeypatch):
    from dppo_core.integrations.trl import SUPPORTED_TRL, check_trl_version

    check_trl_version(trl.__version__)  # the installed one (the bench extra's pin) is supported
    assert tuple(int(p) for p in trl.__version__.split(".")[:2]) in SUPPORTED_TRL
    for version in ("1.16.0", "1.16.3", "1.16.0.dev0"):
        check_trl_version(version)
    monkeypatch.delenv("DPPO_TRL_UNTESTED", raising=False)
    for version in ("1.15.0", "1.17.0", "1.19.1", "2.16.0", "1.1"):
        with pytest.raises(ImportError, match=rf"tested with TRL 1\.16\.x and found trl {version}: pip install") as e:
            check_trl_version(version)
        assert "\n" not in str(e.value)
    monkeypatch.setenv("DPPO_TRL_UNTESTED", "1")
    with pytest.warns(UserWarning, match="found trl 1.19.0"):
        check_trl_version("1.19.0")
