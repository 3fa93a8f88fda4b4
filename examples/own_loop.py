"""DPPO in a hand-written GRPO loop, from the package's public pieces only (no DPPOTrainer).

Each step: draw candidate prompts, let the estimator ``select`` which to roll out (prompt pruning), sample G
completions per kept prompt, reward them, compute group advantages, ``observe`` them (the history the next
steps' prompt pruning reads), ``weigh`` them (completion pruning: a keep mask, weights 1/(pi_q p_qi) and the
normaliser C = |B|·G of the whole candidate batch), and take one AdamW step on the weighted loss of the kept
completions. Embedded warm-started tiny model and arithmetic task, on CPU, seeded; a few seconds a step.

    .venv/bin/python examples/own_loop.py [--steps N] [--output-dir DIR]

Writes the estimator's state (its prompt history, what a resumed run loads) to the output directory.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from dppo_core.config import DPPOConfig
from dppo_core.estimator import make_estimator
from dppo_core.grpo import group_advantages, policy_loss
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.models import load_model
from dppo_core.rewards import math_reward
from dppo_core.rollout import HFRollout, SamplingConfig
from dppo_core.tasks import ArithmeticTask
from dppo_core.warm_start import warm_start

CONFIG = DPPOConfig(pruning="dppo", prompt_prune_rate=0.5, completion_prune_rate=0.5, beta=0.0,
                    prompts_per_step=8, num_generations=8, max_completion_length=48, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", default=None, help="default: a new temporary directory")
    args = parser.parse_args()
    c, k, g = CONFIG, CONFIG.prompts_per_step, CONFIG.num_generations
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    model, tokenizer = load_model(warm_start(progress=False))
    engine, est = HFRollout(model, tokenizer), make_estimator(c)
    optimizer = torch.optim.AdamW(model.parameters(), lr=c.learning_rate, weight_decay=c.weight_decay)
    pool = ArithmeticTask(levels=(2, 3, 4)).sample_train(rng, 2 * k)  # a small pool: prompts recur, history acts
    for step in range(args.steps):
        candidates = rng.sample(pool, est.num_candidates(k))
        sel = est.select([p.id for p in candidates], step, size=k)  # before rollout: pruned prompts cost nothing
        kept = [candidates[i] for i in sel.indices]
        if not kept:  # every candidate pruned: the estimate is 0, no update
            print(f"step {step + 1}  prompts 0/{sel.window}  no update")
            continue
        sampling = SamplingConfig(max_tokens=c.max_completion_length, temperature=c.temperature, seed=step)
        batch = engine.generate([p.messages() for p in kept], g, sampling)
        rewards = torch.tensor([[math_reward(comp, str(p.answer)) for comp in grp.completions]
                                for p, grp in zip(kept, batch.groups, strict=True)])
        adv = group_advantages(rewards, c.scale_rewards)  # over whole groups, before any completion is dropped
        est.observe([p.id for p in kept], rewards, adv, step)
        w = est.weigh(adv, sel, step)  # keep mask, weights 1/(pi_q p_qi), normaliser |B|·G
        train = [(q, i) for q, i in w.keep.nonzero().tolist() if batch.groups[q].completions[i].token_ids]
        loss = torch.zeros(())
        if train:  # the kept completions (those without tokens have no loss), in one padded batch
            logp, mask = completion_logprobs_with_grad(
                model, [batch.groups[q].prompt_ids for q, _ in train],
                [batch.groups[q].completions[i].token_ids for q, i in train], c.temperature, tokenizer.pad_token_id)
            loss, _ = policy_loss(logp, torch.stack([adv[q, i] for q, i in train]), mask, epsilon=c.epsilon,
                                  weights=torch.stack([w.weights[q, i] for q, i in train]),
                                  loss_type=c.loss_type, num_sequences=w.num_sequences)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.max_grad_norm)
            optimizer.step()  # HFRollout samples from this model: no weight sync
        weight_max = max((float(w.weights[q, i]) for q, i in train), default=0.0)
        print(f"step {step + 1}  reward {rewards.mean():.3f}  prompts {len(kept)}/{sel.window}  "
              f"completions {len(train)}/{rewards.numel()} (max weight {weight_max:.2f}, C={w.num_sequences})  "
              f"loss {loss.item():+.5f}")
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="dppo-own-loop-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimator.json").write_text(json.dumps(est.state_dict()))
    print(f"estimator state: {out / 'estimator.json'}")


if __name__ == "__main__":
    main()
