"""Chapter 00 exercises, solved and checked: digit tokens, the parameter count, the standard error.

Run: python notebooks/solutions/ch00_tiny_model.py   (seconds; tests/test_solutions.py runs it too)
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import torch

from dppo_core.evaluate import evaluate_task
from dppo_core.models import (
    SPECIAL_TOKENS,
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    count_parameters,
    load_model,
)
from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup
from dppo_core.tasks import ArithmeticTask

# The tests' small model (tests/conftest.py): built in about a second, cached like the default one.
SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)


# --------------------------------------------------------------------------------------------------
# Exercise 1: a tokenizer without the digit pre-tokenizer
# --------------------------------------------------------------------------------------------------

def tokenizer_without_digit_split(n_problems: int = 5000, seed: int = 0):
    """build_tokenizer's BPE, trained on task text, but with ByteLevel pre-tokenization only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    texts = []
    for p in ArithmeticTask().sample_train(rng, n_problems):
        texts += [p.prompt, p.solution("steps"), p.solution("direct")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # no Digits(individual_digits=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def exercise_1() -> None:
    text = "147+258"
    merged = tokenizer_without_digit_split().encode(text).tokens
    split = build_tokenizer().tokenize(text)
    print(f"without the digit split: {merged} | dppo_core: {split}")
    # The package's tokenizer gives one token per digit ...
    assert split == list(text)
    # ... while plain BPE learns multi-digit tokens from frequent numbers, so the same digit is spelled by
    # different tokens depending on its neighbours ("14"+"7" here, "1"+"47" elsewhere): the model has to
    # learn place value separately for every chunk, and carries cross token boundaries irregularly.
    assert any(sum(ch.isdigit() for ch in t) >= 2 for t in merged)
    assert len(merged) < len(split)


# --------------------------------------------------------------------------------------------------
# Exercise 2: the parameter count of a Qwen3 model, from its config
# --------------------------------------------------------------------------------------------------

def qwen3_parameters(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                     head_dim: int, tied: bool = False) -> int:
    """Embeddings + per layer (attention with GQA and q/k norms, SwiGLU MLP, two RMSNorms) + final norm + head."""
    attention = hidden * heads * head_dim          # q_proj (no bias in Qwen3)
    attention += 2 * hidden * kv_heads * head_dim  # k_proj, v_proj: only kv_heads heads (grouped-query attention)
    attention += heads * head_dim * hidden         # o_proj
    attention += 2 * head_dim                      # q_norm, k_norm (RMSNorm over head_dim, shared by heads)
    mlp = 3 * hidden * intermediate                # gate_proj, up_proj, down_proj
    norms = 2 * hidden                             # input and post-attention RMSNorm
    embeddings = vocab * hidden * (1 if tied else 2)
    return embeddings + layers * (attention + mlp + norms) + hidden


def exercise_2() -> None:
    for cfg in (TinyModelConfig(), SMALL):
        model, tokenizer = load_model(build_tiny_model(cfg))
        ours = qwen3_parameters(len(tokenizer), cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        print(f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers: formula {ours:,} == count_parameters "
              f"{count_parameters(model):,}")
        assert ours == count_parameters(model)
    # Where the default model's parameters are: the SwiGLU MLPs hold almost three quarters of them.
    cfg = TinyModelConfig()
    total = qwen3_parameters(309, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                             cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    mlp_share = cfg.num_hidden_layers * 3 * cfg.hidden_size * cfg.intermediate_size / total
    print(f"MLP share of the default model: {mlp_share:.0%}")
    assert 0.7 < mlp_share < 0.75


# --------------------------------------------------------------------------------------------------
# Exercise 3: the standard error evaluate_task reports, and how many problems make it small
# --------------------------------------------------------------------------------------------------

class ScriptedEngine:
    """A stand-in rollout engine: answers right for the first `n_right` prompts it sees, wrong after."""

    def __init__(self, task: ArithmeticTask, n_right: int):
        self.answers = {p.prompt: p.answer for level in task.levels for p in task.test(level)}
        self.n_right, self.seen = n_right, 0

    def generate(self, prompts, num_generations, sampling):
        groups = []
        for messages in prompts:
            answer = self.answers[messages[-1]["content"]]
            given = answer if self.seen < self.n_right else answer + 1
            self.seen += 1
            text = f"\\boxed{{{given}}}"
            groups.append(RolloutGroup(messages, [], [Completion([], text, [], "stop")] * num_generations))
        return RolloutBatch(groups)


def standard_error(accuracy: float, n: int) -> float:
    """SE of a mean of n 0/1 scores, with the sample variance (n - 1 in the denominator) as evaluate_task uses."""
    return math.sqrt(accuracy * (1 - accuracy) * n / (n - 1) / n)


def problems_for(se: str, accuracy: str) -> int:
    """The fewest problems n with SE < se, i.e. p(1-p)/(n-1) < se^2 (in exact fractions: no rounding at 225)."""
    p, e = Fraction(accuracy), Fraction(se)
    return math.floor(p * (1 - p) / e**2) + 2


def exercise_3() -> None:
    task = ArithmeticTask()
    level1 = task.test(1)                                   # all 21 held-out level-1 problems
    result = evaluate_task(ScriptedEngine(task, n_right=19), level1).levels[1]
    ours = standard_error(19 / 21, 21)
    print(f"19 of 21 right: accuracy {result.accuracy:.3f}, SE {result.stderr:.4f} (ours {ours:.4f})")
    assert math.isclose(result.stderr, ours, rel_tol=1e-12)
    n = problems_for("0.02", "0.9")
    print(f"SE < 0.02 at accuracy 0.9 needs {n} problems (n - 1 must exceed 0.9 * 0.1 / 0.02^2 = 225)")
    assert n == 227 and standard_error(0.9, n) < 0.02 < standard_error(0.9, n - 2)


def main() -> None:
    torch.manual_seed(0)
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 00 solutions: all checks passed")


if __name__ == "__main__":
    main()
