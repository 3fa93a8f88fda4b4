"""GRPO's mathematics as pure tensor functions: group-relative advantages and the clipped policy loss.

For a prompt q with G completions and rewards r_{q,1..G}:

    A_{q,i} = (r_{q,i} - mean_j r_{q,j}) / (std_j r_{q,j} + eps)                    (scale_rewards="group")

Per token t of completion (q,i), with ratio rho = pi_theta / pi_old:

    l_t = -min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL3_t
    KL3_t = exp(ref - logp) - (ref - logp) - 1                                     (the k3 estimator)

and the step's loss over a batch B of candidate prompts, each completion multiplied by its weight w:

    grpo:     L = (1 / (|B| G))        sum_{q,i} w_{q,i} * mean_t l_t
    dr_grpo:  L = (1 / (|B| G L_max))  sum_{q,i} w_{q,i} * sum_t l_t
              (Dr. GRPO also needs scale_rewards="none")
    dapo:     L = (1 / sum_{q,i} T_{q,i}) sum_{q,i} w_{q,i} * sum_t l_t

The weight is 1 for GRPO and 1 / (pi_q p_{q,i}) for DPPO's kept completions. For ``grpo`` and ``dr_grpo`` the
normaliser is a constant given by the caller (``num_sequences`` = |B| G, the full candidate batch, not the
number of sequences present), so a pruned, reweighted sum is an unbiased estimate of the full-batch loss and
its gradient at parameters fixed before the draw (with ``group`` or ``none`` advantage scaling; ``batch`` only
without prompt pruning; docs/estimator.md). ``dapo`` divides by a token count: the trainer passes the tokens
of every rolled-out completion (kept or pruned), so completion pruning leaves it unbiased; the token count of
prompts pruned before rollout is unknown, so under prompt pruning the loss would be a ratio estimator about 1
/ mean(π) too large, and :class:`~dppo_core.config.DPPOConfig` refuses that combination. (Dividing by the kept
tokens only would inflate the loss by 1 / kept share.)

With an engine other than the training model (vLLM), each token's whole ``l_t``, the KL term included, is also
multiplied by the engine weight ``min(pi_old / mu, C)`` (``token_weights``;
:func:`truncated_importance_weights`), which corrects for the engine sampling from its own copy mu of the
policy: the k3 term is an average over the sampled tokens as much as the surrogate is (docs/estimator.md, "The
three weights").

Departures from TRL's GRPOTrainer, and why:
1. The normaliser is explicit (``num_sequences``, ``max_completion_length``, ``num_tokens``) instead of
   being read off the micro-batch, so that micro-batching and pruning cannot change the estimator.
2. ``scale_rewards`` adds ``eps`` to the standard deviation (as TRL does) and uses the population
   standard deviation of the G rewards (TRL uses the sample std); a zero-std group gets A = 0 either way.
"""

from __future__ import annotations

import torch

from dppo_core.config import LOSS_TYPES, SCALE_REWARDS


def group_advantages(rewards: torch.Tensor, scale_rewards: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages from rewards of shape (num_prompts, G); returns the same shape.

    ``scale_rewards``: ``"group"`` divides by each group's std, ``"batch"`` by the std of all rewards,
    ``"none"`` only subtracts the group mean (Dr. GRPO).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape (num_prompts, G), got {tuple(rewards.shape)}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards = rewards.float()
    if rewards.numel() == 0:  # no group (every prompt pruned): nothing to centre
        return rewards.clone()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    # a group whose rewards are all equal has A = 0 exactly: its float32 mean can miss a value such as 3.7 or
    # 0.1 by a rounding, which would give every completion the same small advantage (and a keep probability, a
    # gradient)
    centred = torch.where(rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True), 0.0,
                          centred)
    if scale_rewards == "group":
        return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    if scale_rewards == "batch":
        return centred / (rewards.std(unbiased=False) + eps)
    return centred


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    num_sequences: int | None = None,
    max_completion_length: int | None = None,
    num_tokens: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped GRPO surrogate (plus beta * KL) for a micro-batch of N completions.

    Args:
        logprobs: (N, T) log-probs of the completion tokens under the current policy (with grad).
        advantages: (N,) one advantage per completion.
        completion_mask: (N, T) 1 on real completion tokens, 0 on padding.
        old_logprobs: (N, T) log-probs under the policy that sampled; None means "the current policy"
            (one PPO epoch: the ratio is 1 and only its gradient matters).
        ref_logprobs: (N, T) log-probs under the reference policy; needed when ``beta > 0``.
        weights: (N,) per-completion weight; None means all ones (plain GRPO).
        num_sequences: the constant normaliser |B| G for ``grpo`` and ``dr_grpo``; default N.
        max_completion_length: L_max for ``dr_grpo``; default T.
        num_tokens: the token count to divide by for ``dapo`` (all micro-batches of the step); default
            the tokens in this micro-batch.
        token_weights: (N, T) detached per-token factors of the loss, the surrogate and the KL term alike,
            e.g. the engine weights of :func:`truncated_importance_weights`; None means all ones (the engine
            is the policy).

    Returns the scalar loss and detached statistics (``clip_fraction``, ``kl``, ``ratio_mean``), each a
    token mean over this micro-batch.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if logprobs.shape != completion_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must have the same shape (N, T)")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (log-probs under the reference policy)")
    n, t = logprobs.shape
    mask = completion_mask.to(logprobs.dtype)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    eps_high = epsilon if epsilon_high is None else epsilon_high

    ratio = torch.exp(logprobs - old_logprobs)  # (N, T)
    adv = advantages.to(logprobs.dtype)[:, None]  # (N, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (N, T)
    kl = None
    if beta > 0:
        assert ref_logprobs is not None  # checked above
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
    if token_weights is not None:  # the engine's mismatch, corrected token by token: the KL term's too
        per_token = per_token * token_weights.to(device=per_token.device, dtype=per_token.dtype)

    w = (torch.ones(n, dtype=logprobs.dtype, device=logprobs.device) if weights is None
         else weights.to(device=logprobs.device, dtype=logprobs.dtype))
    token_sums = (per_token * mask).sum(dim=1)  # (N,)
    lengths = mask.sum(dim=1)
    if loss_type == "grpo":
        per_seq = token_sums / lengths.clamp(min=1)
        loss = (w * per_seq).sum() / (num_sequences or n)
    elif loss_type == "dr_grpo":
        loss = (w * token_sums).sum() / ((num_sequences or n) * (max_completion_length or t))
    else:  # dapo
        loss = (w * token_sums).sum() / max(1, num_tokens if num_tokens is not None else int(lengths.sum()))

    with torch.no_grad():
        total = mask.sum().clamp(min=1)
        is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        stats = {
            "clip_fraction": (is_clipped.to(mask.dtype) * mask).sum() / total,
            "ratio_mean": (ratio * mask).sum() / total,
            "kl": (kl * mask).sum() / total if kl is not None else torch.zeros((), dtype=logprobs.dtype),
        }
    return loss, stats


def truncated_importance_weights(logp_train: torch.Tensor, logp_engine: torch.Tensor, cap: float = 2.0, *,
                                 level: str = "token", mask: torch.Tensor | None = None) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights for rollouts sampled by a mismatched engine.

    The engine samples from :math:`\\mu` (its copy of the policy); the policy gradient needs samples of
    :math:`\\pi` (the trainer's). Reweighting by :math:`\\pi / \\mu` corrects that; truncating at ``C`` bounds
    the variance at the price of a bias where the engine under-samples a token:

    .. math:: w_t = \\min\\bigl(\\exp(\\log\\pi_t - \\log\\mu_t),\\ C\\bigr)   (``level="token"``)
    .. math:: w = \\min\\bigl(\\exp(\\textstyle\\sum_t \\log\\pi_t - \\log\\mu_t),\\ C\\bigr)
       (``level="sequence"``)

    The sequence weight makes a whole completion's draw one from :math:`\\pi` (exact below ``C``); the token
    weight corrects each token's draw given a prefix that the engine sampled, the frameworks' default (lower
    variance, not exact for completions of more than one token).

    Args:
        logp_train: per-token log-probs of the sampled tokens under the training policy at the sampling
            temperature (the old policy's: the parameters the completions were sampled at), shape (..., T).
        logp_engine: the engine's sampling log-probs of the same tokens, same shape.
        cap: ``C`` >= 1; 2 is the value Yao et al. (2025, "Your efficient RL framework secretly brings
            you off-policy RL training") recommend.
        level: ``"token"`` or ``"sequence"`` (one weight per row of the last dimension, broadcast over it).
        mask: 1 on real tokens, 0 on padding (needed for ``"sequence"``; default all ones).

    Returns:
        ``w`` of the same shape, detached (a constant factor in the loss: no gradient flows through it).
        Multiply it into the per-token policy loss before aggregation (``policy_loss(token_weights=w)``).
    """
    if logp_train.shape != logp_engine.shape:
        raise ValueError(f"logp_train {tuple(logp_train.shape)} and logp_engine {tuple(logp_engine.shape)} "
                         "must have the same shape (one entry per sampled token)")
    if cap < 1:
        raise ValueError("cap must be >= 1 (weights below 1 would be clipped to below the on-policy value), "
                         f"got {cap}")
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    # at least float32 (bf16 log-probs), float64 kept
    dtype = torch.promote_types(logp_train.dtype, torch.float32)
    log_ratio = logp_train.detach().to(dtype) - logp_engine.detach().to(dtype)
    if level == "sequence":
        m = torch.ones_like(log_ratio) if mask is None else mask.to(log_ratio)
        log_ratio = (log_ratio * m).sum(dim=-1, keepdim=True).expand_as(log_ratio)
    return torch.exp(log_ratio).clamp(max=cap)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``tokens`` (B, T) under ``logits`` (B, T, V) at a sampling temperature.

    ``logits[:, t]`` must be the prediction for ``tokens[:, t]`` (shift before calling). Computed as
    ``logit - logsumexp`` row by row, which avoids materialising a second (B, T, V) tensor. At least float32
    (bf16 logits are promoted; float64 ones, as in the exact tests, stay float64).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 to float32; float64 kept
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)
