"""The lean decode step (dppo_core.engines.lean_decode) against the model's own forward: the same logits bit for bit,
in fp32 and in bf16 with random norm weights."""

from __future__ import annotations

import pytest
import torch

from dppo_core.engines.lean_decode import LeanDecoder, compare_with_forward
from dppo_core.models import load_model
from dppo_core.rollout import HFRollout, SamplingConfig
from dppo_core.tasks import ArithmeticTask

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (refusals and their messages) cannot.


def _tiny(kind: str, attn: str = "sdpa") -> torch.nn.Module:
    """A random two-layer model of ``kind``, with grouped-query heads and (where the architecture has them) biases."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    config = {"qwen3": lambda: Qwen3Config(**common, head_dim=24),  # a head size other than hidden / heads
              "qwen2": lambda: Qwen2Config(**common),  # q, k and v projections with biases
              "llama": lambda: LlamaConfig(**common, attention_bias=True, mlp_bias=True),
              # a scaled rotary embedding, which the model's own rotary module computes
              "llama-linear-rope": lambda: LlamaConfig(**common, rope_parameters={
                  "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})}[kind]()
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # biases are zero at initialisation: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _decode_both(model, steps: int = 6, leave: dict[int, list[int]] | None = None, after_start=None) -> int:
    """:func:`compare_with_forward`, asserting the logits are equal bit for bit; returns the rows compared."""
    worst, compared = compare_with_forward(model, steps, leave, after_start)
    assert worst == 0.0, worst
    return compared


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "llama-linear-rope"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_lean_step_gives_the_forwards_logits_bit_for_bit(kind, attn):
    # rows 2 and 5 (the shortest prompts, with the most padding) leave after step 2; then every padded row but one
    assert _decode_both(_tiny(kind, attn), steps=7, leave={2: [0, 1, 3, 4], 4: [1, 2, 3]}) == 6 * 2 + 4 * 2 + 3 * 3


def _bf16_with_random_norms(kind: str, attn: str = "sdpa") -> torch.nn.Module:
    """:func:`_tiny` in bfloat16, with every RMSNorm weight drawn around 1 (each layer's two norms, Qwen3's
    per-head q_norm and k_norm, the final norm). At initialisation they are all 1, and in fp32 the norm's input
    is already float32: either way the order of the weight product and the cast back to the input's dtype
    makes no difference, so only bf16 with weights other than 1 can tell a slip in that order apart."""
    model = _tiny(kind, attn).to(torch.bfloat16)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 2 + 1 + (2 * 2 if kind == "qwen3" else 0)  # two layers
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_(1.0, 0.3)
            assert norm.weight.dtype == torch.bfloat16 and (norm.weight != 1).float().mean() > 0.9
    return model


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "llama-linear-rope"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_lean_step_is_bit_for_bit_in_bf16_with_random_norm_weights(kind, attn):
    # rollouts run in the model's dtype, bf16 for most checkpoints: every rounding to bf16 (the norms' cast back,
    # the projections, the rotary product, the attention) must happen where the forward rounds
    model = _bf16_with_random_norms(kind, attn)
    assert _decode_both(model, steps=7, leave={2: [0, 1, 3, 4], 4: [1, 2, 3]}) == 6 * 2 + 4 * 2 + 3 * 3


@pytest.mark.numerics
def test_a_cast_order_slip_in_the_norm_is_caught(monkeypatch):
    """The negative control of the test above: a lean RMSNorm that applies the weight before the cast back,
    ``(weight * x32).to(dtype)`` instead of the architectures' ``weight * x32.to(dtype)``, gives other logits in
    bf16 with random norm weights, and the same ones in fp32 (which is why the fp32 tests cannot see it)."""
    from dppo_core.engines import lean_decode

    def slipped(x, norm):
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return (norm.weight * x32).to(x.dtype)

    monkeypatch.setattr(lean_decode, "_rms_norm", slipped)
    assert compare_with_forward(_bf16_with_random_norms("qwen3"), steps=4)[0] > 0
    assert compare_with_forward(_tiny("qwen3"), steps=4)[0] == 0


@pytest.mark.numerics
def test_lean_step_on_the_package_models_attention(warm_small_model_dir):
    # the warm-started model as the trainer loads it, and with the package's own attention implementations,
    # which hand a call without their plan to sdpa
    from dppo_core.shared_prefix import NAME as SEGMENTS
    from dppo_core.shared_prefix import register as register_segments
    from dppo_core.varlen import NAME as VARLEN
    from dppo_core.varlen import register as register_varlen

    register_segments()
    register_varlen()
    model, _ = load_model(warm_small_model_dir)
    _decode_both(model, leave={1: [0, 1, 2, 3, 4]})
    for attn in (SEGMENTS, VARLEN):
        model.set_attn_implementation(attn)
        _decode_both(model, leave={3: [1, 3]})


@pytest.mark.numerics
def test_lean_step_on_a_lora_model(warm_small_model_dir):
    # PEFT LoRA layers (two adapters, one of them active; dropout, as at inference; a bias on lora_B) computed
    # op for op as PEFT's forward does
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(warm_small_model_dir)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, init_lora_weights=False, lora_bias=True,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, config).eval()
    peft_model.add_adapter("other", LoraConfig(r=2, init_lora_weights=False, target_modules=["q_proj"]))
    _decode_both(peft_model, leave={2: [0, 2, 3, 4], 4: [2, 3]})
    peft_model.set_adapter("other")  # a different active adapter: the logits change and still agree
    _decode_both(peft_model, leave={1: [1, 3]})
    merged = get_peft_model(load_model(warm_small_model_dir)[0], LoraConfig(
        r=4, init_lora_weights=False, target_modules=["q_proj", "down_proj"])).eval()
    merged.merge_adapter()  # merged into the base weights: the LoRA path is skipped, as PEFT skips it
    _decode_both(merged)


@pytest.mark.numerics
def test_lean_step_follows_in_place_updates(warm_small_model_dir):
    model, _ = load_model(warm_small_model_dir)
    before = LeanDecoder.for_model(model).step

    def update(m):  # what an optimizer step does: the same tensors, new values (after the decoder started)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.01)

    _decode_both(model, after_start=update)
    assert before.__self__.model is model  # the decoder keeps the model, not copies of its weights


@pytest.mark.numerics
def test_rollouts_with_and_without_the_lean_step_are_identical(warm_small_model_dir, monkeypatch):
    model, tok = load_model(warm_small_model_dir)
    prompts = [p.messages() for p in ArithmeticTask().test_set(2)]
    sampling = SamplingConfig(max_tokens=24, temperature=1.0, seed=11)
    steps = []
    step = LeanDecoder.step

    def counted(self, *args):
        steps.append(len(args[0]))
        return step(self, *args)

    monkeypatch.setattr(LeanDecoder, "step", counted)
    fast = HFRollout(model, tok, batch_size=12).generate(prompts, 4, sampling)
    # the lean step did the decoding: one row per generated token after each sequence's first
    assert sum(steps) == fast.num_generated_tokens - fast.num_completions
    plain = HFRollout(model, tok, batch_size=12, lean=False).generate(prompts, 4, sampling)
    assert len({n for g in fast.lengths() for n in g}) >= 3  # rows left the batch at different steps
    for gf, gp in zip(fast.groups, plain.groups, strict=True):
        for f, p in zip(gf.completions, gp.completions, strict=True):
            assert f.token_ids == p.token_ids and f.logprobs == p.logprobs


def test_unsupported_models_say_why_and_keep_their_forward(warm_small_model_dir, tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    model, tok = load_model(warm_small_model_dir)
    assert LeanDecoder.unsupported(model) is None
    dora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "LoRA variant" in LeanDecoder.unsupported(dora)
    assert HFRollout(dora, tok)._lean_decoder() is None
    with dora.disable_adapter():
        assert "disabled" in LeanDecoder.unsupported(dora)
    dropout = get_peft_model(load_model(warm_small_model_dir)[0], LoraConfig(r=2, target_modules=["v_proj"],
                                                                            lora_dropout=0.1))
    assert "LoRA dropout in training mode" in LeanDecoder.unsupported(dropout.train())
    assert LeanDecoder.unsupported(dropout.eval()) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    assert "model type 'gpt2'" in LeanDecoder.unsupported(gpt2)
    hooked = _tiny("llama")
    handle = hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert "forward hooks on model.layers.1.mlp" in LeanDecoder.unsupported(hooked)
    handle.remove()
    hooked.model.embed_tokens.register_forward_pre_hook(lambda *a: None)  # the lean step calls the embedding
    assert LeanDecoder.unsupported(hooked) is None
    spread = _tiny("llama")
    spread.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert "spread over devices" in LeanDecoder.unsupported(spread)
    dropout = _tiny("qwen3")
    dropout.config.attention_dropout = 0.1
    assert LeanDecoder.unsupported(dropout) is None  # in eval mode, as HFRollout runs it
    assert "attention dropout" in LeanDecoder.unsupported(dropout.train())
    windowed = _tiny("qwen2")
    windowed.config.use_sliding_window = True
    assert "sliding-window" in LeanDecoder.unsupported(windowed)
    flash = _tiny("qwen3")
    flash.config._attn_implementation = "flash_attention_2"
    assert "attention implementation 'flash_attention_2'" in LeanDecoder.unsupported(flash)


def test_a_full_buffer_is_refused():
    from transformers import DynamicCache

    model = _tiny("qwen3")
    ids = torch.randint(1, 97, (2, 4))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        lean = LeanDecoder(model)
        lean.start(cache, torch.ones_like(ids), max_new_tokens=1)
        lean.step(ids[:, 0], torch.tensor([4, 4]))
        with pytest.raises(RuntimeError, match="buffers hold 5 positions and are full"):
            lean.step(ids[:, 0], torch.tensor([5, 5]))
