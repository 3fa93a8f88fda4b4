"""Chapter 00 exercises, solved and checked: digit tokens, the parameter count, the standard error.

Run: python dppo_core/assets/course/solutions/ch00_tiny_model.py   (seconds; tests/course/test_solutions.py
runs it too)
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import torch

from dppo_core.evaluate import evaluate_task
from dppo_core.models import SPECIAL_TOKENS, TinyModelConfig, build_tiny_model, build_tokenizer, load_model
from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup
from dppo_core.tasks import ArithmeticTask

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Keep only the ByteLevel pre-tokenizer (add_prefix_space=False) and build_tokenizer's special "
        "tokens: a Digits step left in still splits every digit."),
    2: ("Give k_proj and v_proj kv_heads heads, use head_dim rather than hidden / heads, count the q/k "
        "norms, and count the output head only when untied."),
    3: ("Divide by n (n - 1), not by n, in the standard error; in problems_for stay in Fractions and mind "
        "the strict < when the bound is a whole number."),
}

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


def _tokens(tokenizer, text: str) -> list[str]:
    """The tokens of `text`, for a `tokenizers.Tokenizer` or a transformers tokenizer."""
    if hasattr(tokenizer, "tokenize"):
        return tokenizer.tokenize(text)
    return tokenizer.encode(text).tokens


def exercise_1(tokenizer_without_digit_split=tokenizer_without_digit_split) -> None:
    tok = tokenizer_without_digit_split()
    text = "147+258"
    merged, split = _tokens(tok, text), build_tokenizer().tokenize(text)
    print(f"without the digit split: {merged} | dppo_core: {split}")
    assert split == list(text)                                          # the package: one token per digit
    assert "".join(merged) == text, "the tokens should spell the text (ByteLevel, no prefix space)"
    vocab = tok.get_vocab()
    assert all(s in vocab for s in SPECIAL_TOKENS), "keep build_tokenizer's special tokens"
    # Plain BPE learns multi-digit tokens from frequent numbers ...
    assert any(sum(ch.isdigit() for ch in t) >= 2 for t in merged), \
        "no token holds two digits: digits still split?"
    assert len(merged) < len(split)
    # ... so the same place value is spelled by different chunks in different numbers: among all three-digit
    # numbers, the split into tokens (the tokens' lengths) is not one pattern but several, and the model has
    # to learn carrying separately for each way a number is cut.
    patterns = {tuple(len(t) for t in _tokens(tok, str(n))) for n in range(100, 1000)}
    print(f"three-digit numbers are cut in {len(patterns)} different ways, e.g. {sorted(patterns)[:4]}")
    assert len(patterns) > 1


# --------------------------------------------------------------------------------------------------
# Exercise 2: the parameter count of a Qwen3 model, from its config
# --------------------------------------------------------------------------------------------------


def qwen3_parameters(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                     head_dim: int, tied: bool = False) -> int:
    """Embeddings + per layer (attention with GQA and q/k norms, SwiGLU MLP, two RMSNorms) + final norm +
    head."""
    attention = hidden * heads * head_dim          # q_proj (no bias in Qwen3)
    attention += 2 * hidden * kv_heads * head_dim  # k_proj, v_proj: only kv_heads heads
                                                   # (grouped-query attention)
    attention += heads * head_dim * hidden         # o_proj
    attention += 2 * head_dim                      # q_norm, k_norm (RMSNorm over head_dim, shared by heads)
    mlp = 3 * hidden * intermediate                # gate_proj, up_proj, down_proj
    norms = 2 * hidden                             # input and post-attention RMSNorm
    embeddings = vocab * hidden * (1 if tied else 2)
    return embeddings + layers * (attention + mlp + norms) + hidden


def _qwen3(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied):
    """A randomly initialised Qwen3ForCausalLM of that shape (no tokenizer, nothing saved)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads, head_dim=head_dim,
                                        tie_word_embeddings=tied))


def exercise_2(qwen3_parameters=qwen3_parameters) -> None:
    cfg = TinyModelConfig()
    model, tokenizer = load_model(build_tiny_model(cfg))                 # the chapter's model (cached)
    shape = (len(tokenizer), cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
             cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    ours, theirs = qwen3_parameters(*shape), sum(p.numel() for p in model.parameters())
    print(f"TinyModelConfig(): formula {ours:,}, the model {theirs:,}")
    assert ours == theirs, f"TinyModelConfig(): your formula gives {ours:,}, the model has {theirs:,}"
    # Other shapes, built directly: more query heads than kv heads, head_dim != hidden / heads, tied
    # embeddings.
    for other in [(100, 32, 48, 1, 4, 2, 16, False), (57, 24, 40, 3, 3, 1, 12, True),
                  (80, 16, 16, 2, 2, 2, 8, False)]:
        expected = sum(p.numel() for p in _qwen3(*other).parameters())
        got = qwen3_parameters(*other[:-1], tied=other[-1])
        assert got == expected, f"shape {other}: your formula gives {got:,}, the model has {expected:,}"
    # Which part holds most of the default model? Measured on the model's own tensors, and read off the
    # formula (the MLP is what intermediate = 0 removes); the two must agree.
    part = {"embeddings and head": 0, "attention": 0, "MLP": 0, "norms": 0}
    for name, p in model.named_parameters():
        key = ("MLP" if ".mlp." in name else "attention" if ".self_attn." in name and "norm" not in name
               else "embeddings and head" if "embed" in name or "lm_head" in name else "norms")
        part[key] += p.numel()
    mlp_by_formula = ours - qwen3_parameters(len(tokenizer), cfg.hidden_size, 0, *shape[3:])
    assert mlp_by_formula == part["MLP"]
    print("shares of the default model: " + ", ".join(f"{k} {v / theirs:.0%}" for k, v in part.items()))
    assert max(part, key=part.get) == "MLP"


# --------------------------------------------------------------------------------------------------
# Exercise 3: the standard error evaluate_task reports, and how many problems make it small
# --------------------------------------------------------------------------------------------------


def standard_error(accuracies: list[float]) -> float:
    """SE of the mean of per-problem accuracies a_j: sqrt(sum_j (a_j - mean)^2 / (n (n - 1)))."""
    n = len(accuracies)
    mean = sum(accuracies) / n
    return math.sqrt(sum((a - mean) ** 2 for a in accuracies) / (n * (n - 1)))


def problems_for(se: Fraction, accuracy: Fraction) -> int:
    """The fewest problems n whose 0/1 scores, right with share `accuracy`, have SE < `se`.

    The sample variance of n such scores is n p (1 - p) / (n - 1), so SE^2 = p (1 - p) / (n - 1): the fewest n
    with n - 1 > p (1 - p) / se^2. In exact fractions, so that a bound that is an integer (225 for p = 0.9,
    se = 0.02) is not rounded to the wrong side.
    """
    p, e = Fraction(accuracy), Fraction(se)
    return math.floor(p * (1 - p) / e**2) + 2


class ScriptedEngine:
    """A stand-in rollout engine: problem k (in the order it is asked) gets `right[k]` right samples first."""

    def __init__(self, task: ArithmeticTask, right: list[int]):
        self.answers = {p.prompt: p.answer for level in task.levels for p in task.test(level)}
        self.right, self.seen = right, 0

    def generate(self, prompts, num_generations, sampling):
        groups = []
        for messages in prompts:
            answer, k = self.answers[messages[-1]["content"]], self.right[self.seen]
            self.seen += 1
            texts = [f"\\boxed{{{answer if i < k else answer + 1}}}" for i in range(num_generations)]
            groups.append(RolloutGroup(messages, [], [Completion([], t, [], "stop") for t in texts]))
        return RolloutBatch(groups)


def exercise_3(standard_error=standard_error, problems_for=problems_for) -> None:
    task = ArithmeticTask()
    level1 = task.test(1)                                   # all 21 held-out level-1 problems
    rng = random.Random(0)
    cases = [[1] * 19 + [0] * 2, [1] * 10 + [0] * 11, [rng.randint(0, 2) for _ in level1]]
    for right in cases:
        samples = max(right) if max(right) > 1 else 1
        reported = evaluate_task(ScriptedEngine(task, right), level1, samples_per_problem=samples).levels[1]
        ours = standard_error([k / samples for k in right])
        assert math.isclose(ours, reported.stderr, rel_tol=1e-9), (right, ours, reported.stderr)
    print(f"19 of 21 right: SE {standard_error([1.0] * 19 + [0.0] * 2):.4f}, as evaluate_task reports")
    # The fewest problems for a target SE, against a search over n in exact arithmetic:
    for se, p in [("0.02", "0.9"), ("0.01", "0.5"), ("0.05", "0.75"), ("0.03", "0.2"), ("0.1", "0.5")]:
        se, p = Fraction(se), Fraction(p)
        n = problems_for(se, p)
        assert isinstance(n, int) and n >= 2
        assert p * (1 - p) / (n - 1) < se**2, \
            f"SE({n} problems) = sqrt({p * (1 - p) / (n - 1)}) is not < {se}"
        assert n == 2 or p * (1 - p) / (n - 2) >= se**2, f"{n - 1} problems already give SE < {se}"
    n = problems_for(Fraction("0.02"), Fraction("0.9"))
    print(f"SE < 0.02 at accuracy 0.9 needs {n} problems; level 1 has {len(level1)}")
    # The same on scores the chapter's formula sees: 0/1 scores at that accuracy, when n makes it a whole
    # count.
    scores = [1.0] * 9 + [0.0]
    assert math.isclose(standard_error(scores * 30), math.sqrt(0.09 / 299), rel_tol=1e-9)


def main() -> None:
    torch.manual_seed(0)
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 00 solutions: all checks passed")


if __name__ == "__main__":
    main()
