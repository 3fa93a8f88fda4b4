"""PyTorch's own variable-length attention as a transformers attention implementation, ``torch_varlen``.

A packed update puts several sequences in one row, so attention must stop at each sequence's boundary.
flash-attn's variable-length kernel does that without any mask (the ``varlen`` route of
:func:`dppo_core.packing.packed_completion_logprobs`), but the flash-attn package has to be compiled for
the installed torch and CUDA, which often fails or takes an hour. PyTorch (2.10 and later) ships a kernel
of the same kind, :func:`torch.nn.attention.varlen.varlen_attn` (CUDA, fp16 and bf16). :func:`register`
makes it a transformers attention implementation::

    from dppo_core.varlen import register
    register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation="torch_varlen")

(``DPPOConfig.attn_implementation: torch_varlen`` does this for you.) Only a forward that carries
``cu_seq_lens_q`` takes the kernel: :func:`~dppo_core.packing.packed_completion_logprobs` passes the packed
sequences' boundaries that way. Every other call (rollouts with a KV cache, a padded batch, evaluation)
goes to transformers' sdpa with the mask sdpa is given, so a ``torch_varlen`` model runs everywhere an sdpa
model does, and only the packed update changes kernel.

The kernel computes attention in the query heads' layout: with grouped-query attention (fewer key/value
heads than query heads, as in Qwen3) it is asked to share each key/value head across its group
(``enable_gqa``) where this PyTorch has that argument, else the key/value heads are repeated.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import torch

#: The name models are loaded with (``attn_implementation="torch_varlen"``).
NAME = "torch_varlen"


def kernel_available() -> bool:
    """Whether this PyTorch has ``torch.nn.attention.varlen.varlen_attn`` (2.10 and later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why ``torch_varlen`` cannot run on ``device``, or None when it can: it needs a CUDA device (the kernel
    has no CPU implementation) of compute capability 8.0 or more (PyTorch's flash kernel: Ampere, Hopper and
    later; not a T4 or V100) and PyTorch 2.10 or later."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it needs a CUDA device (this is {device.type})"
    if not kernel_available():
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (PyTorch 2.10 or later has it)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"PyTorch's flash kernel needs compute capability 8.0 or more; this GPU has {major}.{minor}"
    return None


def available(device: torch.device | str) -> bool:
    """Whether ``torch_varlen`` can run on ``device`` (:func:`unavailable_reason` says why not)."""
    return unavailable_reason(device) is None


@functools.cache
def _kernel() -> tuple[Callable[..., torch.Tensor], frozenset[str]]:
    from torch.nn.attention.varlen import varlen_attn

    # typed Tensor | tuple[Tensor, Tensor]: the tuple only with return_aux, which causal_varlen never passes
    return (cast(Callable[..., torch.Tensor], varlen_attn),
            frozenset(inspect.signature(varlen_attn).parameters))


def causal_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                  max_length: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a flattened batch.

    Args:
        query: (T, H_q, D), the sequences one after another.
        key, value: (T, H_kv, D), H_kv dividing H_q.
        cu_seq_lens: (S + 1,) int, sequence s is tokens ``cu_seq_lens[s]:cu_seq_lens[s + 1]``.
        max_length: the longest sequence.
        scale: the softmax scale (default 1/sqrt(D)).
    Returns (T, H_q, D).
    """
    kernel, params = _kernel()
    kwargs: dict[str, Any] = {}
    # causal: torch 2.10 has is_causal; from 2.11 it is the window (-1, 0) (everything before, nothing after)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if scale is not None and "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this PyTorch's varlen_attn takes no scale and the model asks for {scale}; use "
                         f"attn_implementation='sdpa'")
    h_q, h_kv = query.shape[1], key.shape[1]
    if h_q != h_kv:
        if h_q % h_kv:
            raise ValueError(f"{h_q} query heads are not a multiple of {h_kv} key/value heads")
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            key = key.repeat_interleave(h_q // h_kv, dim=1)
            value = value.repeat_interleave(h_q // h_kv, dim=1)
    cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    return kernel(query, key, value, cu, cu, int(max_length), int(max_length), **kwargs)


def torch_varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                                   dropout: float = 0.0, scaling: float | None = None,
                                   sliding_window: int | None = None,
                                   cu_seq_lens_q: torch.Tensor | None = None,
                                   cu_seq_lens_k: torch.Tensor | None = None,
                                   max_length_q: int | None = None, max_length_k: int | None = None,
                                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="torch_varlen"``.

    ``query`` is (B, H_q, T, D) and ``key``/``value`` (B, H_kv, T, D), as transformers passes them; the
    result is (B, T, H_q, D). With ``cu_seq_lens_q`` (a packed forward: B = 1, the sequences flattened into
    one row) it runs :func:`causal_varlen`; otherwise it is transformers' sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError("torch_varlen takes one flattened row and no KV cache with cu_seq_lens_q; got "
                         f"query {tuple(query.shape)} and key {tuple(key.shape)}")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(
            cu_seq_lens_k.cpu(), cu_seq_lens_q.cpu()):
        raise ValueError("torch_varlen takes the same sequence boundaries for queries and keys")
    if sliding_window is not None:
        raise ValueError("torch_varlen does not apply a sliding window; load the model with "
                         "attn_implementation='sdpa'")
    if dropout:
        raise ValueError("torch_varlen has no attention dropout (the packed update runs in eval mode)")
    max_length = (max_length_q if max_length_q is not None
                  else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max()))
    out = causal_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                        cu_seq_lens_q, int(max_length), scaling)
    return out[None], None


def register_attention(name: str, forward: Callable[..., Any]) -> None:
    """Make ``attn_implementation=name`` loadable in transformers with ``forward`` as its attention function
    (idempotent). Its mask is sdpa's, for the calls that ``forward`` hands to sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def register() -> None:
    """Make ``attn_implementation="torch_varlen"`` loadable in transformers (idempotent)."""
    register_attention(NAME, torch_varlen_attention_forward)
