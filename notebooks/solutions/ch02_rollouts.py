"""Chapter 02 exercises, solved and checked: a KV cache, truncated importance weights, the temperature
of a log-prob.

Run: python notebooks/solutions/ch02_rollouts.py   (seconds, on the small model; tests/test_solutions.py
runs it too)
"""

from __future__ import annotations

import torch

from dppo_core.models import TinyModelConfig, build_tiny_model, encode_prompt, load_model
from dppo_core.rollout import HFRollout, SamplingConfig, logprob_mismatch, truncated_importance_weights
from dppo_core.tasks import ArithmeticTask

# The tests' small model (tests/conftest.py): built in about a second, cached like the default one.
SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def small_model():
    model, tokenizer = load_model(build_tiny_model(SMALL))
    return model.eval(), tokenizer


# --------------------------------------------------------------------------------------------------
# Exercise 1: sampling with a KV cache, checked against the chapter's loop without one
# --------------------------------------------------------------------------------------------------

def _pick(z, temperature, gen):
    logp = torch.log_softmax(z / (temperature or 1.0), -1)
    y = logp.argmax(-1) if temperature == 0 else torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    return y, logp.gather(-1, y[:, None]).squeeze(-1)


@torch.no_grad()
def sample(model, prompt_ids, G, temperature, max_tokens, eos_id, seed, kv_cache):
    """The chapter's sample_from_scratch; with kv_cache=True each step feeds only the newest token.

    Returns (token ids per sample, log-probs per sample, token positions the model was run on in total).
    """
    gen = torch.Generator().manual_seed(seed)
    seq = torch.tensor([prompt_ids] * G)                     # (G, P)
    out = model(seq, use_cache=kv_cache)
    passes = seq.shape[1]
    past = out.past_key_values if kv_cache else None
    z = out.logits[:, -1].float()                            # (G, vocab)
    tokens, logps = [], []
    done = torch.zeros(G, dtype=torch.bool)
    for t in range(max_tokens):
        y, lp = _pick(z, temperature, gen)
        y = torch.where(done, eos_id, y)
        tokens.append(y)
        logps.append(lp)
        seq = torch.cat([seq, y[:, None]], 1)
        done |= y == eos_id
        if done.all() or t == max_tokens - 1:
            break
        if kv_cache:
            out = model(y[:, None], past_key_values=past, use_cache=True)   # one new position per row
            past, passes = out.past_key_values, passes + 1
        else:
            out = model(seq)                                                # the whole sequence again
            passes += seq.shape[1]
        z = out.logits[:, -1].float()
    ids, lps = torch.stack(tokens, 1), torch.stack(logps, 1)  # (G, L)
    samples = []
    for g in range(G):
        row = ids[g].tolist()
        n = row.index(eos_id) + 1 if eos_id in row else len(row)
        samples.append((row[:n], lps[g, :n]))
    return samples, passes


def exercise_1() -> None:
    model, tokenizer = small_model()
    prompt = encode_prompt(tokenizer, ArithmeticTask().test_set(1)[0].messages())
    P, L = len(prompt), 24
    for temperature in (0.0, 0.8):
        plain, plain_passes = sample(model, prompt, 4, temperature, L, tokenizer.eos_token_id, 0, kv_cache=False)
        cached, cached_passes = sample(model, prompt, 4, temperature, L, tokenizer.eos_token_id, 0, kv_cache=True)
        assert [s[0] for s in plain] == [s[0] for s in cached]             # the same tokens
        diff = max((a[1] - b[1]).abs().max().item() for a, b in zip(plain, cached, strict=True))
        assert diff < 1e-4
        steps = max(len(s[0]) for s in plain)                              # model calls = tokens generated
        # Without a cache step t runs over P + t positions: sum_t (P + t) = O(L (P + L)); with one, P + (L - 1).
        assert plain_passes == sum(P + t for t in range(steps))
        assert cached_passes == P + steps - 1
        print(f"T={temperature}: same tokens, log-probs within {diff:.1e}; {steps} steps cost {plain_passes} token "
              f"positions without the cache, {cached_passes} with it")


# --------------------------------------------------------------------------------------------------
# Exercise 2: truncated importance sampling, exactly
# --------------------------------------------------------------------------------------------------

def my_tis(logp_train, logp_engine, cap=2.0):
    return torch.exp(logp_train.detach() - logp_engine.detach()).clamp(max=cap)


def exercise_2() -> None:
    gen = torch.Generator().manual_seed(0)
    logp_train, logp_engine = -3 * torch.rand(50, generator=gen), -3 * torch.rand(50, generator=gen)
    assert torch.equal(my_tis(logp_train, logp_engine), truncated_importance_weights(logp_train, logp_engine, cap=2.0))
    # Exactly, on a 12-token vocabulary: the engine samples from mu, the trainer wants pi.
    z = 2 * torch.randn(12, generator=gen, dtype=torch.float64)
    mu = torch.softmax(z, 0)                                                          # the engine's copy
    pi = torch.softmax(z + 0.5 * torch.randn(12, generator=gen, dtype=torch.float64), 0)  # the trainer's, a bit off
    w = pi / mu
    assert torch.isclose((mu * w).sum(), torch.tensor(1.0, dtype=torch.float64))  # E_mu[pi/mu] = sum pi = 1
    for cap in (1.0, 2.0, 5.0):
        w_cap = my_tis(pi.log(), mu.log(), cap)
        expected = (mu * w_cap).sum()                   # E_mu[min(pi/mu, C)] = sum_x min(pi(x), C mu(x))
        bias = (pi - cap * mu).clamp(min=0).sum()       # the mass of the tokens the engine under-samples by > C
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
            logp = torch.log_softmax(model(ids).logits[0, :-1].float() / temperature, -1)  # position t predicts t + 1
            start = len(group.prompt_ids) - 1
            ours = logp[start:].gather(-1, ids[0, start + 1 :, None]).squeeze(-1)
            diffs.append((ours - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def exercise_3() -> None:
    model, tokenizer = small_model()
    prompts = [p.messages() for p in ArithmeticTask().test_set(1)[:3]]
    T = 0.7
    batch = HFRollout(model, tokenizer).generate(prompts, 4, SamplingConfig(max_tokens=16, temperature=T, seed=0))
    mean_ok, max_ok = my_mismatch(model, batch, T)
    package = logprob_mismatch(model, batch, temperature=T)
    assert abs(mean_ok - package.mean_abs) < 1e-5 and max_ok < 1e-4
    mean_wrong, _ = my_mismatch(model, batch, 1.0)
    print(f"at the sampling temperature T={T}: mean |dlogp| {mean_ok:.1e} (dppo_core: {package.mean_abs:.1e}); "
          f"scored at T=1 instead: {mean_wrong:.2f}")
    assert mean_wrong > 1e4 * mean_ok    # a systematic mismatch, not rounding (larger still for a trained model)


def main() -> None:
    torch.manual_seed(0)
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 02 solutions: all checks passed")


if __name__ == "__main__":
    main()
