"""``attn_implementation="torch_varlen"`` (dppo_core.varlen): PyTorch's variable-length kernel in the packed update.

The kernel itself is CUDA-only (``dppo doctor --gpu`` checks it: packed == padded in bf16 on the GPU). Here, on
CPU, it is replaced by a reference that runs causal sdpa on each sequence separately, which checks everything
around it: that transformers calls our attention function, that the packed forward hands it the right sequence
boundaries through the model (and PEFT) keyword arguments, the layouts and the grouped-query heads, and that every
call without boundaries goes to sdpa.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dppo_core import shared_prefix, varlen
from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.packing import PackSequence, pack, packed_completion_logprobs, varlen_boundaries
from dppo_core.policy import attention_kernel
from dppo_core.shapes import build_shaped_model
from dppo_core.tools.gpu_check_layouts import FP32, boundary_crossing, packing_case, random_sequences

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (integer boundaries and refusals) cannot.


class ReferenceKernel:
    """``varlen_attn`` on CPU: causal sdpa per sequence. Records the boundaries it was given."""

    def __init__(self, params: frozenset[str]):
        self.params = params
        self.calls: list[torch.Tensor] = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=None, is_causal=None, scale=None,
                 enable_gqa=False):
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        assert (window_size == (-1, 0)) if "window_size" in self.params else is_causal
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        if not enable_gqa:
            assert q.shape[1] == k.shape[1]
        self.calls.append(cu_q.clone())
        out = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                      enable_gqa=enable_gqa).transpose(0, 1))
        return torch.cat(out)


@pytest.fixture(params=["torch-2.11", "torch-2.10"])
def reference_kernel(request, monkeypatch):
    """torch 2.11+ takes window_size, scale and enable_gqa; 2.10 has is_causal and no GQA (heads repeated)."""
    params = (frozenset({"window_size", "scale", "enable_gqa"}) if request.param == "torch-2.11"
              else frozenset({"is_causal", "scale"}))
    kernel = ReferenceKernel(params)
    monkeypatch.setattr(varlen, "_kernel", lambda: (kernel, params))
    return kernel


@pytest.fixture(scope="module")
def shaped_dir(cache_dir):
    return build_shaped_model("tiny", cache_dir, dtype="float32")  # 2 query heads, 1 key/value head


def load(path, attention):
    from transformers import AutoModelForCausalLM

    if attention == varlen.NAME:
        varlen.register()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)


@pytest.mark.numerics
def test_packed_equals_padded_through_the_varlen_route(shaped_dir, reference_kernel):
    model = load(shaped_dir, varlen.NAME)
    ok, numbers = packing_case(model, "varlen", FP32, n=6, prompt=(4, 20), completion=(3, 30), pad_id=0)
    assert ok, numbers
    # the padded reference went to sdpa; the packed forward (with grad) and the control took the kernel,
    # once per layer each, with one boundary per sequence (the control: one per row)
    layers = model.config.num_hidden_layers
    assert len(reference_kernel.calls) == 2 * layers
    assert len(reference_kernel.calls[0]) == 6 + 1


def test_boundaries_come_from_the_packed_rows(shaped_dir):
    seqs = random_sequences(300, 5, (2, 6), (1, 9), seed=3)
    batch = pack([PackSequence(p, c) for p, c in seqs], 30, pad_id=0)
    kw = varlen_boundaries(batch)
    lengths = sorted(len(p) + len(c) for p, c in seqs)
    assert sorted((kw["cu_seq_lens_q"][1:] - kw["cu_seq_lens_q"][:-1]).tolist()) == lengths
    assert kw["max_length_q"] == max(lengths) and int(kw["cu_seq_lens_q"][-1]) == sum(lengths)
    crossing = varlen_boundaries(boundary_crossing(batch))
    assert len(crossing["cu_seq_lens_q"]) == batch.num_rows + 1


@pytest.mark.numerics
def test_a_peft_model_passes_the_boundaries_through(shaped_dir, reference_kernel):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load(shaped_dir, varlen.NAME), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    seqs = random_sequences(300, 4, (3, 8), (2, 10), seed=1)
    batch = pack([PackSequence(p, c) for p, c in seqs], 40, pad_id=0)
    lp, mask = packed_completion_logprobs(model, batch)  # auto: the model's implementation picks varlen
    ref, ref_mask = completion_logprobs_with_grad(model, [p for p, _ in seqs], [c for _, c in seqs], 1.0, 0)
    assert reference_kernel.calls, "the packed forward of a PEFT-wrapped torch_varlen model did not take the kernel"
    torch.testing.assert_close(lp * mask, ref * ref_mask, atol=1e-5, rtol=1e-5)


@pytest.mark.numerics
def test_calls_without_boundaries_are_sdpa(shaped_dir, reference_kernel):
    model, sdpa = load(shaped_dir, varlen.NAME), load(shaped_dir, "sdpa")
    ids = torch.randint(3, 300, (3, 12))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :4] = 0  # left padding
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=attention_mask).logits
        b = sdpa(input_ids=ids, attention_mask=attention_mask).logits
        out = model.generate(ids[1:], max_new_tokens=4, do_sample=False)  # a KV cache
        ref = sdpa.generate(ids[1:], max_new_tokens=4, do_sample=False)
    assert not reference_kernel.calls
    torch.testing.assert_close(a, b)
    assert torch.equal(out, ref)


def test_refused_where_it_cannot_run():
    assert not varlen.available("cpu")
    with pytest.raises(ConfigError, match="torch_varlen' cannot run here: it needs a CUDA device"):
        attention_kernel("torch_varlen", torch.device("cpu"))
    with pytest.raises(ConfigError, match="attn_implementation.*CUDA only"):
        DPPOConfig(attn_implementation="torch_varlen", device="cpu")
    with pytest.raises(ConfigError, match="shared-prefix layout needs an attention mask, which torch_varlen"):
        DPPOConfig(attn_implementation="torch_varlen", device="cuda", shared_prefix=True)


def test_the_kernel_is_refused_a_kv_cache_or_a_batch(shaped_dir):
    q = torch.zeros(2, 2, 5, 64)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="one flattened row"):
        varlen.torch_varlen_attention_forward(None, q, q[:, :1], q[:, :1], None, cu_seq_lens_q=cu)


def test_only_on_gpus_whose_flash_kernel_exists(monkeypatch):
    """PyTorch's flash kernel needs compute capability 8.0+: a T4 (7.5) gets sdpa from auto and a clear error
    from an explicit torch_varlen, an H100 (9.0) gets the kernel."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "compute capability 8.0 or more; this GPU has 7.5" in varlen.unavailable_reason(cuda)
    monkeypatch.setattr("dppo_core.policy.flash_attention_available", lambda: False)
    assert attention_kernel("auto", cuda) == "sdpa"
    with pytest.raises(ConfigError, match="compute capability"):
        attention_kernel("torch_varlen", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert varlen.unavailable_reason(cuda) is None
    assert attention_kernel("auto", cuda) == varlen.NAME
    # the shared-prefix layout: segment attention, which varlen cannot express
    assert attention_kernel("auto", cuda, needs_mask=True) == shared_prefix.NAME
