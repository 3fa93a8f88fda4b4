"""Chapter 02 exercises, solved and checked: a KV cache, truncated importance weights, the temperature
of a log-prob.

Run: python dppo_core/assets/course/solutions/ch02_rollouts.py   (seconds, on the small model;
tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import torch

from dppo_core.models import TinyModelConfig, build_tiny_model, encode_prompt, load_model
from dppo_core.rollout import HFRollout, SamplingConfig, logprob_mismatch, truncated_importance_weights
from dppo_core.tasks import ArithmeticTask

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Draw as sample_from_scratch does (same generator calls, finished rows kept at eos) and skip the "
        "forward pass after the last token: P + L - 1 positions."),
    2: ("Exponentiate the difference of the two log-probs, clamp it from above only, and detach the inputs "
        "so that the weights carry no gradient."),
    3: ("Divide the logits by the temperature before log_softmax, and shift by one: the logits at position t "
        "score the token at t + 1."),
}

# The tests' small model (tests/conftest.py): built in about a second, cached like the default one.
SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def small_model():
    model, tokenizer = load_model(build_tiny_model(SMALL))
    return model.eval(), tokenizer


# --------------------------------------------------------------------------------------------------
# Exercise 1: sampling with a KV cache, checked against the chapter's loop without one
# --------------------------------------------------------------------------------------------------

@torch.no_grad()
def sample_from_scratch(model, prompt_ids, G, temperature, max_tokens, eos_id, seed):
    """The chapter's loop, unchanged: the whole sequence through the model at every step (no KV cache)."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.tensor([prompt_ids] * G)                 # (G, P): one row per sample
    logps = torch.zeros(G, 0)                            # (G, t) log mu(y_t) so far
    done = torch.zeros(G, dtype=torch.bool)              # (G,) has produced eos
    for _ in range(max_tokens):
        z = model(seq).logits[:, -1].float()             # (G, vocab): the whole sequence, every step
        if temperature == 0:
            logp = torch.log_softmax(z, -1)
            y = logp.argmax(-1)                          # (G,)
        else:
            logp = torch.log_softmax(z / temperature, -1)
            y = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        y = torch.where(done, eos_id, y)                 # finished rows keep emitting eos (cut below)
        logps = torch.cat([logps, logp.gather(-1, y[:, None])], 1)
        seq = torch.cat([seq, y[:, None]], 1)
        done |= y == eos_id
        if done.all():
            break
    samples = []
    for g in range(G):
        ids = seq[g, len(prompt_ids):].tolist()
        n = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
        samples.append({"token_ids": ids[:n], "logprobs": logps[g, :n].tolist(),
                        "finish_reason": "stop" if eos_id in ids else "length"})
    return samples


@torch.no_grad()
def sample_with_kv_cache(model, prompt_ids, G, temperature, max_tokens, eos_id, seed):
    """sample_from_scratch with a KV cache: the prompt once (use_cache=True), then only the newest token.

    Same draws from the same generator, same return value (one dict per sample: token_ids, logprobs,
    finish_reason); the model is not run again after the last token is drawn.
    """
    gen = torch.Generator().manual_seed(seed)
    out = model(torch.tensor([prompt_ids] * G), use_cache=True)   # (G, P): the prompt, once
    past = out.past_key_values
    z = out.logits[:, -1].float()                                   # (G, vocab)
    tokens, logps = [], []
    done = torch.zeros(G, dtype=torch.bool)
    for t in range(max_tokens):
        if temperature == 0:
            logp = torch.log_softmax(z, -1)
            y = logp.argmax(-1)
        else:
            logp = torch.log_softmax(z / temperature, -1)
            y = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        y = torch.where(done, eos_id, y)
        tokens.append(y)
        logps.append(logp.gather(-1, y[:, None]).squeeze(-1))
        done |= y == eos_id
        if done.all() or t == max_tokens - 1:
            break
        out = model(y[:, None], past_key_values=past, use_cache=True)   # (G, 1): one new position per row
        past, z = out.past_key_values, out.logits[:, -1].float()
    ids, lps = torch.stack(tokens, 1), torch.stack(logps, 1)            # (G, L)
    samples = []
    for g in range(G):
        row = ids[g].tolist()
        n = row.index(eos_id) + 1 if eos_id in row else len(row)
        samples.append({"token_ids": row[:n], "logprobs": lps[g, :n].tolist(),
                        "finish_reason": "stop" if eos_id in row else "length"})
    return samples


class PositionCounter(torch.nn.Module):
    """Wraps a model and counts the token positions each row is run on (the length of every input_ids)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.positions = model, 0

    def forward(self, input_ids=None, *args, **kwargs):
        self.positions += input_ids.shape[-1]
        return self.model(input_ids, *args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def exercise_1(sample_with_kv_cache=sample_with_kv_cache) -> None:
    model, tokenizer = small_model()
    eos = tokenizer.eos_token_id
    for problem, temperature, max_tokens in [(0, 0.0, 24), (0, 0.8, 24), (1, 0.8, 24), (2, 1.0, 6)]:
        prompt = encode_prompt(tokenizer, ArithmeticTask().test_set(1)[problem].messages())
        plain_model, cached_model = PositionCounter(model), PositionCounter(model)
        plain = sample_from_scratch(plain_model, prompt, 4, temperature, max_tokens, eos, seed=problem)
        cached = sample_with_kv_cache(cached_model, prompt, 4, temperature, max_tokens, eos, seed=problem)
        assert len(cached) == 4, "one sample per row, G of them"
        assert [s["token_ids"] for s in cached] == [s["token_ids"] for s in plain], "not the same tokens"
        assert [s["finish_reason"] for s in cached] == [s["finish_reason"] for s in plain]
        diff = max(max((abs(a - b) for a, b in zip(x["logprobs"], y["logprobs"], strict=True)), default=0.0)
                   for x, y in zip(plain, cached, strict=True))
        assert diff < 1e-4, f"log-probs differ by {diff:.1e}"
        # Without a cache step t runs over P + t positions: sum_t (P + t); with one, the prompt once and then
        # one position per new token after the first: P + (L - 1).
        P, L = len(prompt), max(len(s["token_ids"]) for s in plain)
        assert plain_model.positions == sum(P + t for t in range(L))
        assert cached_model.positions == P + L - 1, \
            (f"your loop ran the model on {cached_model.positions} positions; a cache needs "
             f"P + L - 1 = {P + L - 1}")
        print(f"T={temperature}: same tokens, log-probs within {diff:.1e}; {L} steps cost "
              f"{plain_model.positions} token positions without the cache, {cached_model.positions} with it")


# --------------------------------------------------------------------------------------------------
# Exercise 2: truncated importance sampling, exactly
# --------------------------------------------------------------------------------------------------

def my_tis(logp_train, logp_engine, cap=2.0):
    """w = min(pi / mu, cap) per token, from the two log-probs; detached (a constant factor in the loss)."""
    return torch.exp(logp_train.detach() - logp_engine.detach()).clamp(max=cap)


def exercise_2(my_tis=my_tis) -> None:
    gen = torch.Generator().manual_seed(0)
    logp_train, logp_engine = -3 * torch.rand(50, generator=gen), -3 * torch.rand(50, generator=gen)
    for cap in (1.0, 2.0, 5.0):
        assert torch.allclose(my_tis(logp_train, logp_engine, cap),
                              truncated_importance_weights(logp_train, logp_engine, cap=cap)), f"cap={cap}"
    w = my_tis(logp_train.clone().requires_grad_(), logp_engine)
    assert not w.requires_grad, \
        "detach the weights: they are a constant factor in the loss, no gradient through them"
    # Exactly, on a 12-token vocabulary: the engine samples from mu, the trainer wants pi.
    z = 2 * torch.randn(12, generator=gen, dtype=torch.float64)
    mu = torch.softmax(z, 0)                                                          # the engine's copy
    # the trainer's, a bit off
    pi = torch.softmax(z + 0.5 * torch.randn(12, generator=gen, dtype=torch.float64), 0)
    w = pi / mu
    assert torch.isclose((mu * w).sum(), torch.tensor(1.0, dtype=torch.float64))  # E_mu[pi/mu] = sum pi = 1
    for cap in (1.0, 2.0, 5.0):
        w_cap = my_tis(pi.log(), mu.log(), cap)
        expected = (mu * w_cap).sum()                   # E_mu[min(pi/mu, C)] = sum_x min(pi(x), C mu(x))
        bias = (pi - cap * mu).clamp(min=0).sum()       # the mass of the tokens the engine under-samples
                                                        # by > C
        assert torch.isclose(expected, 1 - bias)
        assert float(w_cap.max()) <= cap
        print(f"C={cap}: E[w] = {expected.item():.4f} = 1 - {bias.item():.4f} (bias), "
              f"largest weight {w_cap.max().item():.2f}")
    try:
        truncated_importance_weights(logp_train, logp_engine, cap=0.5)
    except ValueError:
        pass
    else:
        raise AssertionError("a cap below 1 must be refused")


# --------------------------------------------------------------------------------------------------
# Exercise 3: a log-prob belongs to a temperature
# --------------------------------------------------------------------------------------------------

@torch.no_grad()
def my_mismatch(model, batch, temperature):
    """Per-token |log pi_T - log mu| for the batch: one forward per completion, logits / T."""
    diffs = []
    for group in batch.groups:
        for c in group.completions:
            ids = torch.tensor([list(group.prompt_ids) + list(c.token_ids)])
            # position t predicts t + 1
            logp = torch.log_softmax(model(ids).logits[0, :-1].float() / temperature, -1)
            start = len(group.prompt_ids) - 1
            ours = logp[start:].gather(-1, ids[0, start + 1 :, None]).squeeze(-1)
            diffs.append((ours - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def exercise_3(my_mismatch=my_mismatch) -> None:
    model, tokenizer = small_model()
    prompts = [p.messages() for p in ArithmeticTask().test_set(1)[:3]]
    T = 0.7
    batch = HFRollout(model, tokenizer).generate(prompts, 4,
                                                 SamplingConfig(max_tokens=16, temperature=T, seed=0))
    mean_ok, max_ok = my_mismatch(model, batch, T)
    package = logprob_mismatch(model, batch, temperature=T)
    assert abs(mean_ok - package.mean_abs) < 1e-5 and max_ok < 1e-4
    mean_wrong, _ = my_mismatch(model, batch, 1.0)
    assert abs(mean_wrong - logprob_mismatch(model, batch, temperature=1.0).mean_abs) < 1e-5
    print(f"at the sampling temperature T={T}: mean |dlogp| {mean_ok:.1e} (dppo_core: "
          f"{package.mean_abs:.1e}); scored at T=1 instead: {mean_wrong:.2f}")
    # a systematic mismatch, not rounding (larger still for a trained model)
    assert mean_wrong > 1e4 * mean_ok


def main() -> None:
    torch.manual_seed(0)
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 02 solutions: all checks passed")


if __name__ == "__main__":
    main()
