"""Chapter 09 exercises, solved and checked: shares of the kept prompts, summed vs averaged gradients,
and what per-rank pruning draws would lose.

Run: python notebooks/solutions/ch09_scaling_out.py   (a few seconds, no model; tests/test_solutions.py runs it too)
"""

from __future__ import annotations

import torch

from dppo_core import pruning
from dppo_core.distributed import DistInfo, shard

# --------------------------------------------------------------------------------------------------
# Exercise 1: who rolls out what
# --------------------------------------------------------------------------------------------------


def exercise_1() -> None:
    shares = [list(shard(10, DistInfo(rank=r, world_size=3))) for r in range(3)]
    print("10 prompts, 3 ranks:", shares)
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    one = [list(shard(1, DistInfo(rank=r, world_size=3))) for r in range(3)]
    assert one == [[], [], [0]]
    # Ranks 0 and 1 roll out nothing, but the all-reduce is a collective: every rank must call it, or the
    # rank that has the prompt waits forever. They contribute zero gradients (DPPOTrainer.update runs on an
    # empty share; dppo_core.distributed.all_reduce_gradients fills missing grads with zeros), and all
    # ranks then take the same optimizer step.


# --------------------------------------------------------------------------------------------------
# Exercise 2: DDP averages, our loss needs a sum
# --------------------------------------------------------------------------------------------------


def exercise_2() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 5, generator=gen), torch.randn(12, generator=gen)
    w0 = torch.randn(5, generator=gen)
    C = 12                                                   # the global normaliser: all 12 examples

    def grad(idx):
        w = w0.clone().requires_grad_()
        loss = ((x[idx] @ w - y[idx]) ** 2).sum() / C      # each rank's share, divided by the GLOBAL C
        loss.backward()
        return w.grad

    full = grad(torch.arange(12))
    ranks = [grad(torch.arange(0, 6)), grad(torch.arange(6, 12))]
    assert torch.allclose(ranks[0] + ranks[1], full, atol=1e-6)              # all_reduce(SUM): exact
    averaged = (ranks[0] + ranks[1]) / 2                                     # what DDP's all-reduce does
    assert torch.allclose(averaged, full / 2, atol=1e-6)
    assert torch.allclose(2 * averaged, full, atol=1e-6)                     # fix: multiply the loss by W
    # Adam's step is m / sqrt(v): invariant to a constant gradient scale (up to eps), so the weights barely
    # change; grad_norm (and SGD, and gradient clipping thresholds) see the factor 1/W.
    def adam_step(g):
        opt_w = w0.clone().requires_grad_()
        opt = torch.optim.Adam([opt_w], lr=1e-2)
        opt_w.grad = g.clone()
        opt.step()
        return opt_w.detach()

    assert torch.allclose(adam_step(full), adam_step(averaged), atol=1e-6)
    assert abs(averaged.norm() - full.norm() / 2) < 1e-6
    print(f"grad norm: summed {full.norm():.4f}, averaged {averaged.norm():.4f}; Adam steps equal")


# --------------------------------------------------------------------------------------------------
# Exercise 3: per-rank completion draws
# --------------------------------------------------------------------------------------------------


def exercise_3() -> None:
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(8, 4, generator=gen)                    # 8 groups of G = 4, global matrix
    probs = pruning.completion_keep_probs(adv, 0.5, min_keep_prob=0.2)
    seed, world, steps = 0, 2, 4000
    counts_shared = torch.zeros_like(probs)
    counts_rank = torch.zeros_like(probs)
    differs = 0
    for step in range(steps):
        shared = pruning.sample_keep(probs, pruning.step_generator(seed, step, "completions"))
        per_rank = torch.cat([pruning.sample_keep(probs, pruning.step_generator(seed + r, step, "completions"))
                              [list(shard(8, DistInfo(rank=r, world_size=world)))] for r in range(world)])
        counts_shared += shared
        counts_rank += per_rank
        differs += int(not torch.equal(shared, per_rank))
    se = (probs * (1 - probs) / steps).sqrt()
    # Each completion is still kept with probability p (the rank's own stream is a valid random stream), so the
    # 1/p-weighted estimate stays unbiased ...
    assert ((counts_rank / steps - probs).abs() <= 5 * se + 1e-9).all()
    assert ((counts_shared / steps - probs).abs() <= 5 * se + 1e-9).all()
    # ... but the draws are no longer the single process's: a W-rank run stops reproducing the 1-process run
    # (and a fixed-size design would no longer keep a constant global count: each rank would draw its own).
    assert differs > 0.9 * steps
    print(f"inclusion frequencies within 5 SE for both; per-rank draws differ from one process in "
          f"{differs / steps:.0%} of steps")


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 09 solutions: all checks passed")


if __name__ == "__main__":
    main()
