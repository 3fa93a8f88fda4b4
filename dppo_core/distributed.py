"""Data-parallel training over ``torch.distributed``: who rolls out what, and what crosses ranks.

Launched by ``torchrun --nproc_per_node N -m dppo_core train ...`` (or ``accelerate launch``), each
of the N processes (ranks) runs the same :class:`~dppo_core.trainer.DPPOTrainer` loop. One step:

    every rank   select_prompts(step)           same history + same seeded draw -> the same kept list
    rank r       rolls out its contiguous share  of the kept prompts (G completions each) and scores them;
                 it owns those groups: their advantages use only the group's own G rewards
    all ranks    all_gather the groups' rewards  -> every rank holds the global (P, G) rewards and
                 advantages, updates the prompt history identically, and draws completion pruning over
                 the global matrix (so the draws equal a single process's)
    rank r       forward/backward on its kept sequences, with the global normaliser
    all ranks    all_reduce(SUM) of the gradients -> every rank holds the full-batch gradient and takes
                 the same optimizer step (so the weights never diverge)
    rank 0       writes logs, evaluations and checkpoints; the others wait at a barrier

The loss is a sum over sequences divided by a constant that does not depend on which rank holds a
sequence, so the summed gradients equal the single-process gradient of the same global batch (to float
rounding). This is what DDP's gradient all-reduce does at a gradient-accumulation boundary; it is done
here once per optimizer step over a flat buffer, which also lets a rank with nothing to train (all its
completions pruned) take part with zeros. Backend: NCCL on CUDA, gloo on CPU.

The helpers below are safe to call in a single process (``world_size == 1``): they then do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job: rank, number of ranks and the local (per-machine) rank."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group started by ``torchrun``/``accelerate launch`` (``WORLD_SIZE`` > 1), else one
    process.

    The backend is NCCL when the run uses CUDA, gloo otherwise. Calling it again reuses the group.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
            if var not in os.environ:
                raise RuntimeError(f"WORLD_SIZE={world} but {var} is not set: start data-parallel runs with "
                                   "`torchrun --nproc_per_node N -m dppo_core train ...` or "
                                   "`accelerate launch`")
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)


def shard(n: int, info: DistInfo) -> range:
    """This rank's contiguous share of ``n`` items (shares differ in size by at most one; may be empty)."""
    return range(n * info.rank // info.world_size, n * (info.rank + 1) // info.world_size)


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` in a single process."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def from_main(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` (picklable) on every rank; ``obj`` itself in a single process. The trainer passes each
    draw through it (the prompt selection, the continue draw, the completion weighting): every rank computes
    them from the same history and seeded streams, and this makes them agree to the bit whatever each rank's
    arithmetic (a float near-tie in the ``fitted`` prior's grid could break differently on two CPUs)."""
    if not info.enabled:
        return obj
    box = [obj if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_groups(rewards: torch.Tensor, lengths: list[int], reward_means: dict[str, float],
                  info: DistInfo) -> tuple[torch.Tensor, list[int], dict[str, float]]:
    """Every rank's groups in global (rank) order: rewards (P, G), completion lengths, mean reward per
    function.

    The one gather of a step before the update (the update then all-reduces the gradients and gathers its
    statistics): after it every rank holds the whole step's rewards, computes the
    same advantages and history, and draws the same completion pruning. Single process: returned as is.
    """
    if not info.enabled:
        return rewards, lengths, reward_means
    ranks = all_gather_objects((rewards, lengths, reward_means, rewards.shape[0]), info)
    total = sum(r[3] for r in ranks)
    means = {k: sum(r[2].get(k, 0.0) * r[3] for r in ranks) / total for k in ranks[0][2]}
    return torch.cat([r[0] for r in ranks]), [n for r in ranks for n in r[1]], means


def job_layout_stats(stats: dict[str, float], layout: dict[str, float], info: DistInfo) -> dict[str, float]:
    """An update's layout statistics for the whole job: the per-rank ``stats`` and ``layout`` summed over
    ranks (``grad_norm`` is the same on every rank; the largest engine log-prob difference is the largest over
    ranks). Single process: ``layout`` as it is."""
    if not info.enabled:
        return layout
    ranks = all_gather_objects({**stats, **layout}, info)
    summed = {k: sum(r[k] for r in ranks)
              for k in ("loss", "clip_fraction", "kl", "update_rows", "update_capacity", "padding_avoided",
                        "prompt_tokens_shared", "engine_weight_mean", "engine_weight_truncated")
              if k in ranks[0]}
    if "engine_logprob_diff_max" in ranks[0]:
        summed["engine_logprob_diff_max"] = max(r["engine_logprob_diff_max"] for r in ranks)
    real = sum(r["update_density"] * r["update_capacity"] for r in ranks)
    return {**layout, **summed, "update_density": real / max(1, summed["update_capacity"])}


def all_reduce_max(value: float, info: DistInfo) -> float:
    """The largest ``value`` over ranks (e.g. "did any rank ask to stop?")."""
    if not info.enabled:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], info: DistInfo) -> None:
    """Sum ``.grad`` over ranks in place, in one flat buffer.

    A parameter without a gradient on a rank counts as zeros there; one without a gradient on every rank
    keeps ``grad = None`` (so the optimizer skips it, as a single process would).
    """
    if not info.enabled:
        return
    params = list(params)
    if not params:
        return
    sizes = [p.numel() for p in params]
    device = params[0].device
    flat = torch.zeros(sum(sizes) + len(params), dtype=torch.float32, device=device)
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            flat[offset : offset + sizes[i]] = p.grad.detach().reshape(-1).float()
            flat[sum(sizes) + i] = 1.0
        offset += sizes[i]
    dist.all_reduce(flat)
    offset = 0
    for i, p in enumerate(params):
        if flat[sum(sizes) + i] > 0:
            g = flat[offset : offset + sizes[i]].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        offset += sizes[i]


def broadcast_parameters(params: Sequence[torch.nn.Parameter], info: DistInfo, src: int = 0) -> None:
    """Copy rank ``src``'s parameter values to every rank (so all ranks start from the same weights)."""
    if not info.enabled:
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=src)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def shutdown() -> None:
    """Leave the process group, if this process joined one (at the end of ``dppo train``)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
