"""How the compact loop lays out a chunk's prompts for their forward: each distinct prompt once, and the
prefix all of them share once (:class:`dppo_core.engines.hf.HFRollout`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: The shortest common prefix worth its own forward: shorter ones are computed with each prompt. The embedded
#: task's chat template shares fewer tokens than this, so its prompts are laid out as before.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all of ``prompts`` (two or more distinct ones) share, leaving each at least one
    token of its own (its first logits come from the forward of its own tokens); 0 for fewer than two prompts
    or a prefix shorter than :data:`MIN_SHARED_PREFIX`."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    head = prompts[0]
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != head[i]), n)
    return n if n >= MIN_SHARED_PREFIX else 0


def prefix_padded(prompt_ids: Sequence[Sequence[int]], shared: int,
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[shared prefix | left padding | the rest of the prompt]`` and their mask (0 on the padding): the
    prompts' tokens at the positions a left-padded batch gives them, counted from the first real token."""
    width = max(len(p) for p in prompt_ids) - shared
    input_ids = torch.full((len(prompt_ids), shared + width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompt_ids):
        rest = len(p) - shared
        input_ids[i, :shared] = torch.tensor(p[:shared])
        input_ids[i, shared + width - rest:] = torch.tensor(p[shared:])
        attention_mask[i, :shared] = 1
        attention_mask[i, shared + width - rest:] = 1
    return input_ids, attention_mask


def distinct_rows(prompt_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, copies)``: the first row of each distinct prompt, and for every row the index in ``first`` of
    its prompt, so ``x[first][copies]`` is ``x`` for anything computed from the prompt alone."""
    index: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    copies: list[int] = []
    for row, ids in enumerate(prompt_ids):
        key = tuple(ids)
        if key not in index:
            index[key] = len(first)
            first.append(row)
        copies.append(index[key])
    return torch.tensor(first, dtype=torch.long), torch.tensor(copies, dtype=torch.long)


def copy_rows(logits: torch.Tensor, cache: Any, copies: torch.Tensor) -> torch.Tensor:
    """The distinct prompts' last logits and cache rows, copied to every sequence (``copies``: each one's
    prompt)."""
    if len(copies) > logits.shape[0]:
        cache.batch_select_indices(copies)
        logits = logits[copies]
    return logits
