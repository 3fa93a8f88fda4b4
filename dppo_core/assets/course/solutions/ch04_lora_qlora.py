"""Chapter 04 exercises, solved and checked: LoRA's gradients at initialisation, the memory of Qwen3-32B,
merging an adapter into the weights, what the strong GRPO baseline trains of a real model's run.

Run: python dppo_core/assets/course/solutions/ch04_lora_qlora.py
(seconds: the small model, Qwen3 shapes built on the meta device, which allocates no memory, and the committed
SmolLM2 run's logs; tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from dppo_core.models import TinyModelConfig, build_tiny_model, load_model
from dppo_core.rollout import sequence_logprobs

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Both gradients carry the scale and sum over the batch: dL/dB is (d_out, r) from g and A x, "
        "dL/dA is (r, d_in) from B^T g and x, so check the shapes."),
    2: ("Count the parameters as in chapter 00's exercise 2; in lora and qlora4 only the adapter pays for "
        "gradients and Adam, and NF4 is for linear layers only."),
    3: ("Add scale times B @ A (in that order, so that it has the shape of W) to W: without the alpha / r "
        "scale the merged model's log-probs move."),
    4: ("Every completion's length counts in the first total; in the second only those of groups with at "
        "least two different rewards."),
}

# The tests' small model (tests/conftest.py): built in about a second, cached like the default one.
SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# --------------------------------------------------------------------------------------------------
# Exercise 1: LoRA's gradients, and why B starts at zero and A at random
# --------------------------------------------------------------------------------------------------


def lora_grads(A: torch.Tensor, B: torch.Tensor, x: torch.Tensor, g: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dA and dL/dB of h = W x + scale * B A x, for a batch: x (n, d_in), g = dL/dh (n, d_out).

    dL/dB = scale * g (A x)^T and dL/dA = scale * B^T g x^T, summed over the batch.
    """
    grad_B = scale * g.T @ (x @ A.T)          # (d_out, n) @ (n, r) -> (d_out, r)
    grad_A = scale * (g @ B).T @ x            # (r, n) @ (n, d_in) -> (r, d_in)
    return grad_A, grad_B


class _LoRALinear(nn.Module):
    """The chapter's layer, h = W x + (alpha / r) B A x, with A and B given."""

    def __init__(self, base: nn.Linear, A: torch.Tensor, B: torch.Tensor, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A, self.B = nn.Parameter(A.clone()), nn.Parameter(B.clone())
        self.scale = alpha / A.shape[0]

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.A.T) @ self.B.T


def exercise_1(lora_grads=lora_grads) -> None:
    gen = torch.Generator().manual_seed(0)
    d_in, d_out, r, alpha, n = 16, 8, 4, 8.0, 32
    base = nn.Linear(d_in, d_out)
    x, target = torch.randn(n, d_in, generator=gen), torch.randn(n, d_out, generator=gen)

    def autograd(A, B):
        layer = _LoRALinear(base, A, B, alpha)
        h = layer(x)
        h.retain_grad()
        ((h - target) ** 2).mean().backward()
        return layer.A.grad, layer.B.grad, h.grad

    # Against autograd, with A and B both non-zero (a layer in the middle of training):
    A, B = torch.randn(r, d_in, generator=gen), torch.randn(d_out, r, generator=gen)
    ga, gb, g = autograd(A, B)
    mine_a, mine_b = lora_grads(A, B, x, g, alpha / r)
    assert mine_a.shape == (r, d_in) and mine_b.shape == (d_out, r)
    assert torch.allclose(mine_a, ga, atol=1e-6) and torch.allclose(mine_b, gb, atol=1e-6)
    # Both zero: each factor's gradient goes through the other, so both are exactly zero, at every step.
    zeros_a, zeros_b = lora_grads(torch.zeros(r, d_in), torch.zeros(d_out, r), x, g, alpha / r)
    assert (zeros_a == 0).all() and (zeros_b == 0).all()
    # A random, B zero (LoRA's init): B A = 0, so training starts at the pretrained model; B moves at once,
    # A from the second step on.
    A0 = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
    _, _, g0 = autograd(A0, torch.zeros(d_out, r))
    first_a, first_b = lora_grads(A0, torch.zeros(d_out, r), x, g0, alpha / r)
    assert torch.allclose(first_b, autograd(A0, torch.zeros(d_out, r))[1], atol=1e-6)
    assert (first_a == 0).all() and first_b.abs().max() > 0
    print(f"both zero: |grad A| = |grad B| = 0 (stuck); A random, B zero: |grad A| = 0, "
          f"|grad B| max {first_b.abs().max().item():.3f}")


# --------------------------------------------------------------------------------------------------
# Exercise 2: what full / LoRA / QLoRA need for Qwen3-32B, and what fits on an 80 GB GPU
# --------------------------------------------------------------------------------------------------


def memory_table(hidden, layers, heads, kv_heads, head_dim, mlp, vocab, tied, r=64):
    """(number of parameters, {mode: bytes of weights + gradients + Adam moments}) for a Qwen3 shape, as in
    the chapter: bf16 weights 2 bytes, fp32 gradients 4 and Adam moments 8, NF4 weights 0.53 (linear layers
    only), a rank-r adapter on every linear layer of every decoder layer."""
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (mlp, hidden), "up_proj": (mlp, hidden), "down_proj": (hidden, mlp)}
    linear = layers * sum(o * i for o, i in shapes.values())
    other = vocab * hidden * (1 if tied else 2) + layers * (2 * hidden + 2 * head_dim) + hidden
    total = linear + other
    lora = layers * sum(r * (o + i) for o, i in shapes.values())
    return total, {
        "full": total * 2 + total * (4 + 8),
        "lora": total * 2 + lora * (2 + 4 + 8),
        "qlora4": linear * 0.53 + other * 2 + lora * (2 + 4 + 8),
    }


def meta_counts(hidden, layers, heads, kv_heads, head_dim, mlp, vocab, tied, r=64) -> tuple[int, int, int]:
    """From transformers' Qwen3 of that shape on the meta device (shapes only, no memory): (all parameters,
    parameters of the decoder layers' linear layers, parameters of a rank-r adapter on each of them)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.endswith(TARGETS)]
    return (sum(p.numel() for p in model.parameters()), sum(m.weight.numel() for m in linears),
            sum(r * (m.in_features + m.out_features) for m in linears))


def exercise_2(memory_table=memory_table) -> None:
    GiB, gpu = 2**30, 80e9
    qwen3_4b = dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, mlp=9728, vocab=151_936,
                    tied=True)
    qwen3_32b = dict(hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128, mlp=25600, vocab=151_936,
                     tied=False)
    for name, shape in (("Qwen3-4B", qwen3_4b), ("Qwen3-32B", qwen3_32b)):
        total, modes = memory_table(**shape)
        n, n_lin, n_a = meta_counts(**shape)              # counted on transformers' model of that shape
        assert total == n, (name, total, n)
        expected = {"full": 14 * n, "lora": 2 * n + 14 * n_a,
                    "qlora4": 0.53 * n_lin + 2 * (n - n_lin) + 14 * n_a}
        assert set(modes) == set(expected) and all(math.isclose(modes[m], expected[m], rel_tol=1e-9)
                                                   for m in modes), \
            (name, modes, expected)
        fits = [m for m, b in modes.items() if b < gpu]
        print(f"{name}: {total / 1e9:.2f}B parameters; " +
              ", ".join(f"{m} {b / GiB:.1f} GiB" for m, b in modes.items()) + f"; under 80 GB: {fits}")
    _, modes = memory_table(**qwen3_32b)
    # Full fine-tuning needs several GPUs; LoRA fits, but bf16 weights alone are 61 GiB of the 74.5, leaving
    # little for activations and the rollout engine's KV cache; QLoRA leaves most of the GPU free.
    assert modes["full"] > 4 * gpu and modes["lora"] < gpu and modes["qlora4"] < gpu / 2


# --------------------------------------------------------------------------------------------------
# Exercise 3: merging the adapter into W gives the same model
# --------------------------------------------------------------------------------------------------


def merged_weight(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A: the weight of a plain linear layer that computes what the LoRA layer computes."""
    return W + scale * B @ A


def exercise_3(merged_weight=merged_weight) -> None:
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
    # Ours: a fresh copy of the base model, each target layer's weight replaced by merged_weight(...).
    ours = load_model(build_tiny_model(SMALL))[0]
    layers = dict(ours.named_modules())
    n = 0
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            plain = layers[name.removeprefix("base_model.model.")]
            with torch.no_grad():
                plain.weight.copy_(merged_weight(module.base_layer.weight, module.lora_A["default"].weight,
                                                 module.lora_B["default"].weight, module.scaling["default"]))
            n += 1
    assert n == len(TARGETS) * SMALL.num_hidden_layers
    merged = sequence_logprobs(ours, seqs)
    diff = max((a - b).abs().max().item() for a, b in zip(adapter, merged, strict=True))
    assert diff < 1e-5, diff
    peft_merged = copy.deepcopy(peft_model).merge_and_unload()      # PEFT does the same
    pairs = zip(ours.parameters(), peft_merged.parameters(), strict=True)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in pairs)
    # the base model, freshly loaded
    untouched = sequence_logprobs(load_model(build_tiny_model(SMALL))[0], seqs)
    moved = max((a - b).abs().max().item() for a, b in zip(adapter, untouched, strict=True))
    assert moved > 1e-3  # the adapter does change the model: the check can fail
    # The trainer syncs the adapter, not merged weights: the engine keeps the base weights and takes a few MB
    # per step (a new LoRARequest) instead of a full reload, and merging every step would also need the
    # unmerged copy back for training (or rounding errors accumulate in bf16).
    print(f"merged == adapter log-probs (max |diff| {diff:.1e}); the adapter moved them by up to {moved:.2f}")


# --------------------------------------------------------------------------------------------------
# Exercise 4: what grpo_skip trains of a real model's run
# --------------------------------------------------------------------------------------------------


def mixed_tokens(rows: list[dict]) -> tuple[int, int]:
    """Rows of a run's ``groups.jsonl`` (each step's groups: ``rewards`` and ``lengths``, one list per
    group) -> (tokens generated, tokens in the groups whose rewards are not all equal)."""
    generated = mixed = 0
    for row in rows:
        for rewards, lengths in zip(row["rewards"], row["lengths"], strict=True):
            generated += sum(lengths)
            if len(set(rewards)) > 1:
                mixed += sum(lengths)
    return generated, mixed


def exercise_4(mixed_tokens=mixed_tokens) -> None:
    import json

    from dppo_core.tools.bench.report import committed_result

    # two steps by hand: all right, all wrong, mixed; a partial reward; a one-completion group
    rows = [{"rewards": [[1, 1], [0, 0], [1, 0]], "lengths": [[5, 6], [7, 8], [9, 10]]},
            {"rewards": [[0.5, 0.5, 0.0], [1]], "lengths": [[1, 2, 3], [4]]}]
    assert mixed_tokens(rows) == (55, 25), mixed_tokens(rows)
    assert mixed_tokens([]) == (0, 0)
    # The committed GRPO run on SmolLM2 (benchmarks/results/smollm2): every token it generated was trained,
    # and its groups' tokens add up to the run's own count of them (its metrics, summed in summary.json).
    text = committed_result("benchmarks/results/smollm2/grpo/groups.jsonl")
    groups = [json.loads(line) for line in text.splitlines() if line.strip()]
    run = json.loads(committed_result("benchmarks/results/smollm2/summary.json"))["grpo"]
    generated, mixed = mixed_tokens(groups)
    assert generated == run["tokens_generated"] == run["tokens_trained"], (generated, run["tokens_generated"])
    assert (generated, mixed) == globals()["mixed_tokens"](groups)   # the solution above, on the real run
    # Why the strong baseline trains only these: with beta = 0, every completion of an all-equal group has
    # advantage 0, so its loss and its gradient are exactly 0; GRPO computes them and adds nothing.
    print(f"GRPO trained {generated:,} tokens; {mixed:,} ({mixed / generated:.0%}) were in mixed groups, all "
          "that grpo_skip trains for the same gradient")


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    exercise_4()
    print("chapter 04 solutions: all checks passed")


if __name__ == "__main__":
    main()
