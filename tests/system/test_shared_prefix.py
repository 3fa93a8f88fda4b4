"""The prompt once per group (dppo_core.shared_prefix): the same completion log-probs, loss and gradient as the
padded layout, with segment attention (the default route, `attn_implementation: auto`), sdpa with an explicit
mask and eager, packed, one group per row and one unpadded row, at temperature 1 and others (as the update's
layouts score at `temperature`); mutant masks, plans and positions are caught; the token count is P + sum of R
per segment; the trainer's update with `shared_prefix: true` steps with the plain update's gradient."""

from __future__ import annotations

import random

import pytest
import torch
from run_helpers import parity_reward

from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.logprobs import Sequences, completion_logprobs_with_grad, layout_micro_batches
from dppo_core.packing import PackSequence, attention_implementation
from dppo_core.shared_prefix import (
    NAME,
    build_shared_batch,
    plan_segments,
    register,
    segment_attention,
    segment_plan,
    shared_prefix_logprobs,
    shared_prefix_mask,
    shared_prefix_micro_batches,
)

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (layouts, masks and refusals) cannot.

PAD = 0


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch._C: an in-process vLLM engine no-ops torch.set_num_threads
    yield
    torch._C.set_num_threads(before)


@pytest.fixture(scope="module", params=[NAME, "sdpa", "eager"])
def model(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    register()
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=request.param)
    return m.eval()


def _groups(seed, n_groups=5, g=4, vocab=300):
    """GRPO-shaped sequences: ``n_groups`` prompts, ``g`` completions each (some groups partly pruned)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))]
        for _ in range(rng.randint(1, g)):
            out.append(PackSequence(prompt, [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]))
    rng.shuffle(out)  # the layout must not rely on a group's sequences being next to each other
    return out


def _padded(model, seqs, temperature=1.0):
    logp, mask = completion_logprobs_with_grad(model, [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs],
                                               temperature, PAD)
    return logp * mask, mask


def _shared(model, seqs, budget, rows_per_micro_batch=2, one_row=False, temperature=1.0):
    """Log-probs of every sequence through the micro-batches, in input order."""
    n = len(seqs)
    t_c = max(len(s.completion_ids) for s in seqs)
    logp = torch.zeros(n, t_c)
    mask = torch.zeros(n, t_c)
    for idx, batch in shared_prefix_micro_batches(seqs, budget, rows_per_micro_batch, pad_id=PAD, one_row=one_row):
        if one_row:
            assert batch.num_rows == 1 and batch.density == 1.0
        lp, m = shared_prefix_logprobs(model, batch, temperature)
        logp[idx, : lp.shape[1]] = lp
        mask[idx, : m.shape[1]] = m
    return logp, mask


@pytest.mark.numerics
@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("seed,budget", [(0, 128), (1, 64), (2, None), (3, 40)])
def test_shared_prefix_logprobs_equal_padded(model, seed, budget, one_row):
    seqs = _groups(seed)
    with torch.no_grad():
        ref, ref_mask = _padded(model, seqs)
        logp, mask = _shared(model, seqs, budget, one_row=one_row)
    assert torch.equal(mask, ref_mask)
    assert (logp - ref).abs().max() < 1e-5


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_shared_prefix_logprobs_equal_padded_at_a_temperature(model, temperature):
    """The update scores completions at ``config.temperature`` (dppo_core.logprobs passes it on): the shared-prefix
    layout equals the padded one at T != 1 too, in rows and in one unpadded row. The temperature has power here:
    the log-probs at T differ from those at T = 1 by far more than the tolerance, so a shared_prefix_logprobs that
    ignored it (and scored at T = 1) would fail."""
    seqs = _groups(11)
    with torch.no_grad():
        ref, ref_mask = _padded(model, seqs, temperature)
        at_one, _ = _padded(model, seqs)
        for one_row in (False, True):
            logp, mask = _shared(model, seqs, 96, one_row=one_row, temperature=temperature)
            assert torch.equal(mask, ref_mask)
            assert (logp - ref).abs().max() < 1e-5, f"one_row={one_row}"
    assert (ref - at_one).abs().max() > 1e-2


@pytest.mark.numerics
def test_loss_and_gradient_equal_padded(model):
    seqs = _groups(4, n_groups=6)
    adv = torch.randn(len(seqs))

    def grads(logp, mask):
        model.zero_grad(set_to_none=True)
        loss = -(logp * mask * adv[:, None]).sum() / mask.sum()
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    loss_ref, g_ref = grads(*_padded(model, seqs))
    for one_row in (False, True):
        loss, g = grads(*_shared(model, seqs, 96, one_row=one_row))
        assert abs(loss - loss_ref) < 1e-6
        assert ((g - g_ref).norm() / g_ref.norm()).item() < 1e-5


def test_each_prompt_is_laid_out_once_per_segment():
    seqs = _groups(5, n_groups=4, g=8)
    batch = build_shared_batch(seqs, plan_segments(seqs, None), [[s] for s in range(4)], pad_id=PAD)
    prompts = {tuple(s.prompt_ids) for s in seqs}
    assert batch.real_tokens == sum(len(p) for p in prompts) + sum(len(s.completion_ids) for s in seqs)
    assert batch.prompt_copies_saved == sum(len(s.prompt_ids) for s in seqs) - sum(len(p) for p in prompts)
    # a budget splits a group into segments, each with its own copy of the prompt, none over the budget
    for budget in (30, 50, 80):
        for seg in plan_segments(seqs, budget):
            length = len(seqs[seg[0]].prompt_ids) + sum(len(seqs[i].completion_ids) for i in seg)
            assert length <= budget or len(seg) == 1
            assert len({tuple(seqs[i].prompt_ids) for i in seg}) == 1


def test_the_mask_lets_a_completion_see_its_prompt_and_itself_only():
    seqs = [PackSequence([5, 6], [7, 8]), PackSequence([5, 6], [9])]
    batch = build_shared_batch(seqs, [[0, 1]], [[0]], pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    m = shared_prefix_mask(batch)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0],
                 [1, 1, 1, 0, 0],
                 [1, 1, 1, 1, 0],
                 [1, 1, 0, 0, 1]]  # token 9 sees the prompt and itself, not 7 and 8
    # both completions' first tokens are predicted at the prompt's last position (column 1)
    assert batch.pred_cols.tolist() == [1, 2, 1] and batch.targets.tolist() == [7, 8, 9]


@pytest.mark.numerics
def test_a_mask_that_lets_completions_see_each_other_is_caught(model, monkeypatch):
    from dppo_core import shared_prefix

    if model.config._attn_implementation == NAME:
        pytest.skip("segment attention takes no mask; its plan's mutants are tested below")

    def leaky(batch):
        seg = batch.segment_ids
        T = seg.shape[1]
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        return ((same & torch.ones(T, T, dtype=torch.bool).tril()) | torch.eye(T, dtype=torch.bool))[:, None]

    seqs = _groups(6)
    with torch.no_grad():
        ref, _ = _padded(model, seqs)
        monkeypatch.setattr(shared_prefix, "shared_prefix_mask", leaky)
        logp, _ = _shared(model, seqs, 128)
    assert (logp - ref).abs().max() > 1e-2


@pytest.mark.numerics
def test_completion_positions_that_restart_are_caught(model, monkeypatch):
    """RoPE is relative, so positions restarting at 0 for each completion change what a token sees."""
    from dppo_core import shared_prefix

    real = shared_prefix.build_shared_batch

    def restarting(*a, **k):
        b = real(*a, **k)
        prompt = (b.branch_ids == -1) & (b.segment_ids >= 0)
        b.position_ids = torch.where(prompt, b.position_ids, b.position_ids - b.position_ids.where(
            prompt, torch.zeros_like(b.position_ids)).amax(dim=1, keepdim=True) - 1).clamp_min(0)
        return b

    monkeypatch.setattr(shared_prefix, "build_shared_batch", restarting)
    seqs = _groups(7, n_groups=1, g=4)
    with torch.no_grad():
        ref, _ = _padded(model, seqs)
        logp, _ = _shared(model, seqs, None)
    assert (logp - ref).abs().max() > 1e-3


def _segment_mutants():
    """Plans that each break one rule of who attends to whom."""
    p = lambda plan: plan.prompt_index.shape[1]  # noqa: E731

    def future(plan):  # a completion token sees its own later tokens
        for b in plan.blocks:
            b.mask[..., p(plan):] = b.valid[:, None, None, :]

    def other_prompt(plan):  # a completion attends to another segment's prompt
        for b in plan.blocks:
            b.segment = (b.segment + 1) % plan.prompt_index.shape[0]

    def no_prompt(plan):  # a completion does not see its prompt (beyond its first key)
        for b in plan.blocks:
            b.mask[..., 1:p(plan)] = False

    def prompt_sees_ahead(plan):  # a prompt token sees later prompt tokens
        plan.prompt_mask[:] = plan.prompt_valid[:, None, None, :]

    return [future, other_prompt, no_prompt, prompt_sees_ahead]


@pytest.mark.numerics
@pytest.mark.parametrize("mutant", _segment_mutants(), ids=lambda f: f.__name__)
def test_segment_plan_mutants_are_caught(tiny_model_dir, monkeypatch, mutant):
    from transformers import AutoModelForCausalLM

    from dppo_core import shared_prefix

    register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=NAME).eval()
    real = shared_prefix.segment_plan

    def mutated(*a, **k):
        plan = real(*a, **k)
        mutant(plan)
        return plan

    seqs = _groups(9, n_groups=3, g=3)
    with torch.no_grad():
        ref, _ = _padded(model, seqs)
        assert (_shared(model, seqs, None, one_row=True)[0] - ref).abs().max() < 1e-5
        monkeypatch.setattr(shared_prefix, "segment_plan", mutated)
        logp, _ = _shared(model, seqs, None, one_row=True)
    assert (logp - ref).abs().max() > 1e-3


@pytest.mark.numerics
@pytest.mark.parametrize("heads,dv", [((4, 4), 8), ((4, 2), 8), ((3, 1), 8), ((4, 2), 5)])
def test_segment_attention_equals_transformers_masked_sdpa(heads, dv):
    """On random queries, keys and values in a padded multi-row layout, against transformers' own sdpa attention
    (its repeat_kv for grouped-query heads) with the explicit shared-prefix mask; a value head size other than
    the query's too."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hq, hkv = heads
    seqs = _groups(10, n_groups=4, g=3)
    segments = plan_segments(seqs, 60)
    batch = build_shared_batch(seqs, segments, [list(range(0, len(segments), 2)), list(range(1, len(segments), 2))],
                               pad_id=PAD)
    r, t = batch.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(r, hq, t, 8, generator=gen)
    k, v = torch.randn(r, hkv, t, 8, generator=gen), torch.randn(r, hkv, t, dv, generator=gen)
    out = segment_attention(q, k, v, segment_plan(batch, block=3), scaling=0.3)  # blocks of 3 completions
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = hq // hkv, True, False
    ref, _ = sdpa_attention_forward(module, q, k, v, shared_prefix_mask(batch), scaling=0.3)
    real = batch.segment_ids >= 0
    assert out.shape == ref.shape == (r, t, hq, dv)
    assert (out[real] - ref[real]).abs().max() < 1e-5
    assert out[~real].abs().max() == 0  # padding gets zeros
    # the other head order (query head i on key/value head i % hkv, tiled) would be told apart by this check
    if hkv not in (1, hq):
        tiled = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat(1, hq // hkv, 1, 1), v.repeat(1, hq // hkv, 1, 1), attn_mask=shared_prefix_mask(batch),
            scale=0.3).transpose(1, 2)
        assert (out[real] - tiled[real]).abs().max() > 1e-2


def test_segment_attention_refuses_what_it_does_not_apply():
    from dppo_core.shared_prefix import segment_attention_forward

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="softcap"):
        segment_attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)


@pytest.mark.numerics
def test_segment_attention_is_sdpa_outside_the_update(tiny_model_dir):
    """The rollouts and evaluation of a model loaded for segment attention: the same samples as with sdpa."""
    from transformers import AutoModelForCausalLM

    from dppo_core.models import load_model
    from dppo_core.rollout import HFRollout, SamplingConfig
    from dppo_core.tasks import ArithmeticTask

    register()
    sdpa, tok = load_model(tiny_model_dir)
    seg = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=NAME)
    prompts = [p.messages() for p in ArithmeticTask().test_set(1)[:3]]
    sampling = SamplingConfig(max_tokens=12, temperature=1.0, seed=2)
    a, b = (HFRollout(m, tok).generate(prompts, 4, sampling) for m in (sdpa, seg))
    assert [[c.token_ids for c in g.completions] for g in a.groups] == \
        [[c.token_ids for c in g.completions] for g in b.groups]
    assert [[c.logprobs for c in g.completions] for g in a.groups] == \
        [[c.logprobs for c in g.completions] for g in b.groups]


def test_flash_attention_is_refused_with_a_way_out(tiny_model_dir):
    with pytest.raises(ConfigError, match="shared-prefix layout needs an attention mask"):
        DPPOConfig(shared_prefix=True, attn_implementation="flash_attention_2", device="cuda")


@pytest.mark.numerics
def test_the_update_layout_saves_the_prompt_copies_and_trains_the_same(small_model_dir, tmp_path):
    """Through the trainer's own layout and update: one step with shared_prefix on and off, same gradient."""
    from dppo_core.trainer import DPPOTrainer

    seqs_cfg = dict(model=str(small_model_dir), prompts_per_step=4, num_generations=4, max_completion_length=12,
                    max_steps=1, save_steps=0, train_levels=(2, 3), learning_rate=1e-3, eval_steps=0)
    grads = {}
    for shared in (False, True):
        for packing in (False, True):
            config = DPPOConfig(**seqs_cfg, output_dir=str(tmp_path / f"{shared}{packing}"), shared_prefix=shared,
                                packing=packing, max_tokens_per_row=96)
            trainer = DPPOTrainer(config, reward_funcs=[parity_reward], progress=False)
            trainer.engine = trainer.make_engine()
            record = trainer.train_step()
            # the gradient the optimizer stepped with (the update leaves it in .grad)
            grads[(shared, packing)] = torch.cat([p.grad.flatten() for p in trainer.model.parameters()
                                                  if p.grad is not None])
            if shared:  # auto: segment attention, one unpadded row per micro-batch
                assert trainer.model.config._attn_implementation == NAME
                assert record["prompt_tokens_shared"] > 0 and record["update_density"] == 1
    base = grads[(False, False)]
    assert base.norm() > 0
    for key, g in grads.items():
        assert ((g - base).norm() / base.norm()).item() < 1e-5, key


@pytest.mark.numerics
def test_every_update_layout_scores_at_the_configured_temperature(model):
    """Through the update's own layouts (layout_micro_batches, as the trainer calls it) with ``temperature: 0.7``:
    padded, packed, shared prefix and shared prefix packed each give the padded log-probs at 0.7, which differ
    from those at 1 by far more than the tolerance, so a layout that dropped ``config.temperature`` would fail."""
    seqs = _groups(12)
    s = Sequences([x.prompt_ids for x in seqs], [x.completion_ids for x in seqs], torch.zeros(len(seqs)),
                  torch.ones(len(seqs), dtype=torch.float64), 1)
    segments = attention_implementation(model) == NAME  # as the trainer decides
    with torch.no_grad():
        ref, ref_mask = _padded(model, seqs, 0.7)
        assert (ref - _padded(model, seqs)[0]).abs().max() > 1e-2
        for shared in (False, True):
            for packing in (False, True):
                c = DPPOConfig(temperature=0.7, shared_prefix=shared, packing=packing, max_tokens_per_row=96,
                               packing_rows_per_micro_batch=2, micro_batch_size=8, num_generations=4)
                mbs, forward, _ = layout_micro_batches(s, c, PAD, segments=segments)
                for k, idx in enumerate(mbs):
                    logp, mask = forward(model, k)
                    width = logp.shape[1]
                    assert torch.equal(mask, ref_mask[idx, :width])
                    diff = (logp * mask - ref[idx, :width]).abs().max()
                    assert diff < 1e-5, f"shared_prefix={shared}, packing={packing}"


def test_layout_micro_batches_takes_the_shared_prefix_route():
    c = DPPOConfig(shared_prefix=True, packing=True, max_tokens_per_row=64, packing_rows_per_micro_batch=2)
    seqs = _groups(8)
    s = Sequences([x.prompt_ids for x in seqs], [x.completion_ids for x in seqs], torch.zeros(len(seqs)),
                  torch.ones(len(seqs), dtype=torch.float64), 1)
    for segments in (False, True):
        mbs, _, stats = layout_micro_batches(s, c, PAD, segments=segments)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(seqs)))
        assert stats["prompt_tokens_shared"] > 0
        assert stats["update_density"] * stats["update_capacity"] + stats["prompt_tokens_shared"] == \
            pytest.approx(sum(len(x) for x in seqs))
        if segments:  # one row per micro-batch and no padding: exactly the tokens the shared layout needs
            assert stats["update_density"] == 1 and stats["update_rows"] == len(mbs)
            assert stats["update_capacity"] == sum(len(x) for x in seqs) - stats["prompt_tokens_shared"]
