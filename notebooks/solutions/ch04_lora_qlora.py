"""Chapter 04 exercises, solved and checked: LoRA's initialisation, the memory of Qwen3-32B, merging.

Run: python notebooks/solutions/ch04_lora_qlora.py   (seconds: the small model, and Qwen3 shapes built
on the meta device, which allocates no memory; tests/test_solutions.py runs it too)
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from dppo_core.models import TinyModelConfig, build_tiny_model, load_model
from dppo_core.rollout import sequence_logprobs

# The tests' small model (tests/conftest.py): built in about a second, cached like the default one.
SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)


# --------------------------------------------------------------------------------------------------
# Exercise 1: why LoRA initialises B to zero and A at random, not both to zero
# --------------------------------------------------------------------------------------------------

class LoRALinear(nn.Module):
    """The chapter's layer: h = W x + (alpha / r) B A x."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, init_a: str = "kaiming"):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.zeros(r, base.in_features))     # (r, d_in)
        self.B = nn.Parameter(torch.zeros(base.out_features, r))    # (d_out, r)
        if init_a == "kaiming":
            nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.A.T) @ self.B.T


def first_step_grads(init_a: str) -> tuple[float, float]:
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 8), r=4, alpha=8, init_a=init_a)
    x, target = torch.randn(32, 16), torch.randn(32, 8)
    ((layer(x) - target) ** 2).mean().backward()
    return layer.A.grad.abs().max().item(), layer.B.grad.abs().max().item()


def exercise_1() -> None:
    # dL/dB = scale * g (A x)^T and dL/dA = scale * B^T g x^T (g = dL/dh): each factor's gradient goes through
    # the other. Both zero: both gradients are zero, forever. A random, B zero: the output starts exactly at the
    # pretrained model (B A = 0) and B moves at once; A follows from the second step.
    a_grad, b_grad = first_step_grads("zeros")
    assert a_grad == 0.0 and b_grad == 0.0
    a_grad, b_grad = first_step_grads("kaiming")
    assert a_grad == 0.0 and b_grad > 0.0
    print(f"both zero: |grad A| = |grad B| = 0 (stuck); A random, B zero: |grad A| = 0, |grad B| max {b_grad:.3f}")


# --------------------------------------------------------------------------------------------------
# Exercise 2: what full / LoRA / QLoRA need for Qwen3-32B, and what fits on an 80 GB GPU
# --------------------------------------------------------------------------------------------------

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(hidden, heads, kv_heads, head_dim, mlp):
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (mlp, hidden), "up_proj": (mlp, hidden), "down_proj": (hidden, mlp)}


def memory_table(hidden, layers, heads, kv_heads, head_dim, mlp, vocab, tied, r=64):
    """Bytes of weights + gradients + Adam moments per mode, as in the chapter (bf16 weights, fp32 grads/Adam)."""
    linear = layers * sum(o * i for o, i in shapes(hidden, heads, kv_heads, head_dim, mlp).values())
    other = vocab * hidden * (1 if tied else 2) + layers * (2 * hidden + 2 * head_dim) + hidden
    total = linear + other
    lora = layers * sum(r * (o + i) for o, i in shapes(hidden, heads, kv_heads, head_dim, mlp).values())
    return total, {
        "full": total * 2 + total * (4 + 8),
        "lora": total * 2 + lora * (2 + 4 + 8),
        "qlora4": linear * 0.53 + other * 2 + lora * (2 + 4 + 8),
    }


def meta_parameters(hidden, layers, heads, kv_heads, head_dim, mlp, vocab, tied) -> int:
    """The real parameter count: transformers' Qwen3 built on the meta device (shapes only, no memory)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def exercise_2() -> None:
    GiB, gpu = 2**30, 80e9
    qwen3_4b = dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, mlp=9728, vocab=151_936, tied=True)
    qwen3_32b = dict(hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128, mlp=25600, vocab=151_936, tied=False)
    for name, shape in (("Qwen3-4B", qwen3_4b), ("Qwen3-32B", qwen3_32b)):
        total, modes = memory_table(**shape)
        assert total == meta_parameters(**shape)       # our count == transformers' model of that shape
        fits = [m for m, b in modes.items() if b < gpu]
        print(f"{name}: {total / 1e9:.2f}B parameters; " +
              ", ".join(f"{m} {b / GiB:.1f} GiB" for m, b in modes.items()) + f"; under 80 GB: {fits}")
    _, modes = memory_table(**qwen3_4b)
    assert [round(b / GiB, 1) for b in modes.values()] == [52.4, 9.2, 4.2]     # the chapter's table
    _, modes = memory_table(**qwen3_32b)
    # Full fine-tuning needs several GPUs; LoRA fits, but bf16 weights alone are 61 GiB of the 74.5, leaving
    # little for activations and the rollout engine's KV cache; QLoRA leaves most of the GPU free.
    assert modes["full"] > 4 * gpu and modes["lora"] < gpu and modes["qlora4"] < gpu / 2


# --------------------------------------------------------------------------------------------------
# Exercise 3: merge_and_unload gives the same model
# --------------------------------------------------------------------------------------------------

def exercise_3() -> None:
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_model(build_tiny_model(SMALL))
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)                     # a "trained" adapter
    seqs = [tokenizer.encode(t) for t in ("What is 7+5? \\boxed{12}", "75+72: 75+70=145. 145+2=147.")]
    adapter = sequence_logprobs(peft_model, seqs)
    merged_model = copy.deepcopy(peft_model).merge_and_unload()   # W <- W + (alpha / r) B A, adapter removed
    merged = sequence_logprobs(merged_model, seqs)
    diff = max((a - b).abs().max().item() for a, b in zip(adapter, merged, strict=True))
    assert diff < 1e-5 and type(merged_model).__name__ == "Qwen3ForCausalLM"
    untouched = sequence_logprobs(load_model(build_tiny_model(SMALL))[0], seqs)   # the base model, freshly loaded
    moved = max((a - b).abs().max().item() for a, b in zip(adapter, untouched, strict=True))
    assert moved > 1e-3                                 # the adapter does change the model: the check can fail
    # The trainer syncs the adapter, not merged weights: the engine keeps the base weights and takes a few MB
    # per step (a new LoRARequest) instead of a full reload, and merging every step would also need the
    # unmerged copy back for training (or rounding errors accumulate in bf16).
    print(f"merged == adapter log-probs (max |diff| {diff:.1e}); the adapter moved them by up to {moved:.2f}")


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 04 solutions: all checks passed")


if __name__ == "__main__":
    main()
