"""Chapter 09 exercises, solved and checked: shares of the kept prompts, summed vs averaged gradients,
and what per-rank pruning draws would lose.

Run: python dppo_core/assets/course/solutions/ch09_scaling_out.py   (a few seconds, no model;
tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import itertools

import torch

from dppo_core import pruning
from dppo_core.distributed import DistInfo, shard

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Multiply before dividing, n * rank // world_size, so that the shares are contiguous in rank order "
        "and the extra prompts go to the later ranks."),
    2: ("DDP averages over the ranks: divide by the global num_total, not by the share's own size (no mean), "
        "and scale up by the number of ranks."),
    3: ("Each rank draws the whole (P, G) matrix with step_generator(seed + rank, step, 'completions') and "
        "keeps only its shard's rows, joined in rank order."),
}

# --------------------------------------------------------------------------------------------------
# Exercise 1: who rolls out what
# --------------------------------------------------------------------------------------------------


def my_shard(n: int, rank: int, world_size: int) -> range:
    """The kept prompts rank ``rank`` of ``world_size`` rolls out: [floor(n r / W), floor(n (r + 1) / W))."""
    return range(n * rank // world_size, n * (rank + 1) // world_size)


def exercise_1(my_shard=my_shard) -> None:
    for n in range(0, 13):
        for world in (1, 2, 3, 4, 5):
            mine = [list(my_shard(n, r, world)) for r in range(world)]
            assert mine == [list(shard(n, DistInfo(rank=r, world_size=world))) for r in range(world)]
            assert sum(mine, []) == list(range(n))            # contiguous, in rank order: the global order
    shares = [list(my_shard(10, r, 3)) for r in range(3)]
    print("10 prompts, 3 ranks:", shares)
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    one = [list(my_shard(1, r, 3)) for r in range(3)]
    assert one == [[], [], [0]]
    # Ranks 0 and 1 roll out nothing, but the all-reduce is a collective: every rank must call it, or the
    # rank that has the prompt waits forever. They contribute zero gradients (DPPOTrainer.update runs on an
    # empty share; dppo_core.distributed.all_reduce_gradients fills missing grads with zeros), and all
    # ranks then take the same optimizer step.


# --------------------------------------------------------------------------------------------------
# Exercise 2: DDP averages, our loss needs a sum
# --------------------------------------------------------------------------------------------------


def ddp_share_loss(per_example_loss: torch.Tensor, num_total: int, world_size: int) -> torch.Tensor:
    """The loss one rank backpropagates, from its share's per-example losses, so that DDP's all-reduce, which
    AVERAGES the ranks' gradients, gives the full batch's gradient of sum(all losses) / num_total."""
    return world_size * per_example_loss.sum() / num_total


def exercise_2(ddp_share_loss=ddp_share_loss) -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 5, generator=gen), torch.randn(12, generator=gen)
    w0 = torch.randn(5, generator=gen)
    C = 12                                                   # the global normaliser: all 12 examples

    def grad(idx, loss_of_share=lambda losses: losses.sum() / C):   # each rank's share, over the GLOBAL C
        w = w0.clone().requires_grad_()
        loss_of_share((x[idx] @ w - y[idx]) ** 2).backward()
        return w.grad

    full = grad(torch.arange(12))
    ranks = [grad(torch.arange(0, 6)), grad(torch.arange(6, 12))]
    assert torch.allclose(ranks[0] + ranks[1], full, atol=1e-6)              # all_reduce(SUM): exact
    averaged = (ranks[0] + ranks[1]) / 2                                     # what DDP's all-reduce does
    assert torch.allclose(averaged, full / 2, atol=1e-6)
    for cuts in ((0, 6, 12), (0, 4, 8, 12), (0, 1, 5, 12), (0, 3, 3, 9, 12)):   # 2-4 ranks, uneven, one empty
        world = len(cuts) - 1
        fixed = [grad(torch.arange(a, b), lambda losses, w=world: ddp_share_loss(losses, C, w))
                 for a, b in itertools.pairwise(cuts)]
        assert torch.allclose(sum(fixed) / world, full, atol=1e-6)  # DDP's average of the fixed losses
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


def per_rank_keep(probs: torch.Tensor, seed: int, step: int, world_size: int) -> torch.Tensor:
    """The global keep mask (P, G) when each rank draws the whole matrix with its own generator,
    ``step_generator(seed + rank, step, "completions")`` (independent draws), and keeps the rows of its own
    share of the P groups (``shard``)."""
    rows = []
    for r in range(world_size):
        draw = pruning.sample_keep(probs, pruning.step_generator(seed + r, step, "completions"))
        rows.append(draw[list(shard(probs.shape[0], DistInfo(rank=r, world_size=world_size)))])
    return torch.cat(rows)


def exercise_3(per_rank_keep=per_rank_keep) -> None:
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(8, 4, generator=gen)                    # 8 groups of G = 4, global matrix
    probs = pruning.completion_keep_probs(adv, 0.5, min_keep_prob=0.2)
    seed, world, steps = 0, 2, 4000
    # rank 0's rows are its own draw's, rank 1's its own: check one step exactly
    own = [pruning.sample_keep(probs, pruning.step_generator(seed + r, 7, "completions"))
           for r in range(world)]
    assert torch.equal(per_rank_keep(probs, seed, 7, world), torch.cat([own[0][:4], own[1][4:]]))
    assert torch.equal(per_rank_keep(probs, seed, 7, 1), own[0])        # one rank: the single process's draw
    counts_shared = torch.zeros_like(probs)
    counts_rank = torch.zeros_like(probs)
    differs = 0
    for step in range(steps):
        shared = pruning.sample_keep(probs, pruning.step_generator(seed, step, "completions"))
        per_rank = per_rank_keep(probs, seed, step, world)
        counts_shared += shared
        counts_rank += per_rank
        differs += int(not torch.equal(shared, per_rank))
    se = (probs * (1 - probs) / steps).sqrt()
    # Each completion is still kept with probability p (the rank's own stream is a valid random stream), so
    # the 1/p-weighted estimate stays unbiased ...
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
