"""A lean decode step for Llama-family models: the same arithmetic as the model's forward, less machinery.

:class:`~dppo_core.rollout.HFRollout`'s compact loop calls the model once per generated token. On a small
model on a CPU most of that call is not arithmetic: transformers builds a causal mask, a ``DynamicCache``
concatenates every layer's keys and values onto new tensors, and each of the ~70 sub-modules goes through
``nn.Module``'s call machinery.

:class:`LeanDecoder` runs one decode step (one new token per running sequence) with the model's own weights
and its own attention function, op for op what the decoder layers compute, and keeps keys and values in
preallocated buffers written in place. What it leaves out is only the bookkeeping, so its logits are the
forward's bit for bit on CPU in fp32 (tested, with left padding and rows leaving the batch), and the rollout's
samples do not change.

It takes the models it can reproduce exactly and nothing else (:meth:`LeanDecoder.unsupported` says why not):
decoder-only Llama, Qwen2 and Qwen3 architectures (any rotary embedding: the model's own module computes it)
whose projections are ``nn.Linear`` or PEFT LoRA layers over one (no DoRA or other variant, no bitsandbytes
quantisation), with no sliding window, on one device, and with no forward hooks but on the token embedding
(the lean step does not call the other modules, so their hooks would be skipped). Everything else keeps the
model's forward, with the same samples and the old cost.

Memory: the buffers hold every row of a chunk for ``prompt width + max_new_tokens`` positions from the start
(what a ``DynamicCache`` reaches only when its longest sequence ends), and shrink when half of their rows have
finished.

What it buys is measured in ``benchmarks/results/rollout_throughput.md`` (engines ``hf`` and ``hf-forward``:
the same loop with and without it). What it cannot remove: each step is still a couple of hundred small
tensor operations of a few microseconds each, whatever the number of sequences, so on a small model few
sequences pay more per token than many.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from dppo_core.engines.types import base_model

# Types: the model's sub-modules are read here by the names the architectures give them (inner.layers,
# layer.self_attn.q_proj, a LoRA layer's lora_A[name].weight, a norm's variance_epsilon), a structure that
# LeanDecoder.unsupported has checked; torch types every module attribute as Tensor | Module, so what is read
# from them is typed Any.

#: model types whose decoder layer is: RMSNorm -> attention (q/k/v projections, per-head RMSNorm on q and k
#: in Qwen3 only, rotary embedding, softmax attention, o projection) -> residual -> RMSNorm -> SiLU-gated MLP
#: -> residual, with the names transformers gives them
ARCHITECTURES = ("llama", "qwen2", "qwen3")
#: attention implementations whose decode step is transformers' sdpa or eager attention (the package's own
#: ``torch_varlen`` and ``dppo_segments`` hand a call without their plan to sdpa)
ATTENTION = ("sdpa", "eager", "torch_varlen", "dppo_segments")


class LeanDecoder:
    """One-token decode steps for a supported model, with its keys and values in preallocated buffers.

    Use: ``decoder = LeanDecoder.for_model(model)`` (``None`` when the model is not supported), then per chunk
    :meth:`start` with the prompt's filled ``DynamicCache``, :meth:`step` once per token, :meth:`keep` when
    sequences leave the batch. The decoder reads the model's parameters at every step (no copies), so it
    follows an optimizer's in-place updates.
    """

    def __init__(self, model: torch.nn.Module):
        model = base_model(model)
        self.model = model
        inner: Any = model.model
        self.config = cast(Any, model.config)  # (an annotation alone: mypy would keep Tensor | Module)
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.lm_head: Any = model.lm_head
        self.rotary = inner.rotary_emb
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.qk_norm = hasattr(attn, "q_norm")
        # the attention function the layers call (resolved once, not per step)
        self.eager = self.config._attn_implementation == "eager"
        if self.eager:  # the modelling file's own function
            import importlib

            self.attention = importlib.import_module(type(self.layers[0]).__module__).eager_attention_forward
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            # transformers annotates the default as Callable; unsupported() has checked that the
            # implementation is registered, so the default (None, as before) is never what comes back
            self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, None)  # type: ignore[arg-type]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0  # filled positions of the buffers (prompt width + tokens decoded so far)
        self.allocated_rows = 0  # rows of the buffers' memory (the current rows are a leading slice of it)
        self.padding = torch.zeros(0, 0, dtype=torch.bool)  # (rows, capacity): True where a key is a pad
        self.padded = False  # whether any current row has a pad

    @staticmethod
    def unsupported(model: Any) -> str | None:
        """Why ``model``'s forward cannot be reproduced here exactly, or ``None`` when it can."""
        import transformers.models.llama.modeling_llama as llama
        import transformers.models.qwen2.modeling_qwen2 as qwen2
        import transformers.models.qwen3.modeling_qwen3 as qwen3

        model = base_model(model)
        config: Any = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in ARCHITECTURES:
            return f"model type {model_type!r} (the lean step knows {', '.join(ARCHITECTURES)})"
        if type(model).__name__ not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            return (f"{type(model).__name__} is not a plain causal LM of its type (a wrapper other than "
                    "PEFT's)")
        if getattr(model, "training", False) and getattr(config, "attention_dropout", 0.0):
            return "the model is in training mode with attention dropout (the lean step applies none)"
        devices = set((getattr(model, "hf_device_map", None) or {}).values())
        if len(devices) > 1:
            return f"the model is spread over devices {sorted(map(str, devices))}"
        hooked = [name for name, module in model.named_modules()
                  if name != "model.embed_tokens" and (getattr(module, "_hf_hook", None) is not None
                                                       or module._forward_hooks or module._forward_pre_hooks)]
        if hooked:  # the lean step does not call these modules, so their hooks would be skipped
            return f"forward hooks on {', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''}"
        if getattr(config, "use_sliding_window", False) or any(
                t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return "sliding-window attention layers"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act {config.hidden_act!r} (the lean step computes SiLU)"
        if getattr(config, "_attn_implementation", None) not in ATTENTION:
            return f"attention implementation {getattr(config, '_attn_implementation', None)!r}"
        norms = (llama.LlamaRMSNorm, qwen2.Qwen2RMSNorm, qwen3.Qwen3RMSNorm)
        layers = (llama.LlamaDecoderLayer, qwen2.Qwen2DecoderLayer, qwen3.Qwen3DecoderLayer)
        for i, layer in enumerate(model.model.layers):
            if type(layer) not in layers:
                return f"layer {i} is a {type(layer).__name__}"
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                       mlp.down_proj]
            for x in linears:
                if (why := _projection_unsupported(x)) is not None:
                    return why
            if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
                return f"MLP activation {type(mlp.act_fn).__name__}"
            if any(type(n) not in norms for n in (layer.input_layernorm, layer.post_attention_layernorm)):
                return "a norm that is not the architecture's RMSNorm"
        if type(model.lm_head) is not torch.nn.Linear:
            return f"lm_head of type {type(model.lm_head).__name__}"
        return None

    @classmethod
    def for_model(cls, model: Any) -> LeanDecoder | None:
        """A decoder for ``model``, or ``None`` where :meth:`unsupported` gives a reason."""
        return None if cls.unsupported(model) is not None else cls(model)

    def start(self, cache: Any, attention_mask: torch.Tensor, max_new_tokens: int) -> None:
        """Take over the prompt's keys and values from a filled ``DynamicCache`` (its rows are the chunk's
        rows).

        ``attention_mask`` is the prompt's ``(rows, width)`` mask (0 on left padding); the buffers hold
        ``width + max_new_tokens`` positions.
        """
        rows, width = attention_mask.shape
        capacity = width + max_new_tokens
        self.keys, self.values = [], []
        for layer in cache.layers:
            for src, dst in ((layer.keys, self.keys), (layer.values, self.values)):
                buf = src.new_empty((rows, src.shape[1], capacity, src.shape[3]))
                buf[:, :, :width] = src
                dst.append(buf)
        self.length = width
        self.allocated_rows = rows
        self.padding = torch.zeros((rows, capacity), dtype=torch.bool, device=attention_mask.device)
        self.padding[:, :width] = attention_mask == 0
        self.padded = bool(self.padding.any())

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows), as ``DynamicCache.batch_select_indices``
        does."""
        # only the filled positions are copied: in place (the kept rows move to the front of the same
        # buffers), or into smaller buffers once half of the rows have finished, so finished rows give their
        # memory back
        t, m = self.length, len(rows)
        shrink = 2 * m <= self.allocated_rows
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                kept = buf.new_empty((m, *buf.shape[1:])) if shrink else buf[:m]
                kept[:, :, :t] = buf[rows, :, :t]  # the right side is a copy, so overlapping rows are safe
                buffers[i] = kept
        if shrink:
            self.allocated_rows = m
        self.padding = self.padding[rows]
        self.padded = bool(self.padding.any())

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(rows, vocab)`` of the next token after ``input_ids`` ``(rows,)`` at ``position_ids``
        ``(rows,)``.

        The same operations as the model's forward for one new token with a ``DynamicCache`` (the attention
        mask is the one transformers builds: none where no running row has padding, else a boolean mask).
        """
        t = self.length
        if t >= self.keys[0].shape[2]:
            raise RuntimeError(f"the decode buffers hold {t} positions and are full; start() with a larger "
                               "max_new_tokens")
        rows = input_ids.shape[0]
        hidden = self.embed(input_ids[:, None])  # (rows, 1, hidden)
        cos, sin = self.rotary(hidden, position_ids[:, None])  # (rows, 1, head_dim)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        # the mask transformers builds for one query token: for sdpa none when no row has padding, else the
        # allowed keys; for eager an additive float mask (min where masked), always
        allowed = None if not self.padded else ~self.padding[:, None, None, : t + 1]
        mask = allowed
        if self.eager:
            mask = torch.zeros((rows, 1, 1, t + 1), dtype=hidden.dtype, device=hidden.device)
            if allowed is not None:
                mask.masked_fill_(~allowed, torch.finfo(hidden.dtype).min)
        shape = (rows, 1, -1, self.head_dim)
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            h = _rms_norm(hidden, layer.input_layernorm)
            q = _project(attn.q_proj, h).view(shape)
            k = _project(attn.k_proj, h).view(shape)
            v = _project(attn.v_proj, h).view(shape)
            if self.qk_norm:
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (rows, heads, 1, head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[i][:, :, t : t + 1] = k
            self.values[i][:, :, t : t + 1] = v
            out, _ = self.attention(attn, q, self.keys[i][:, :, : t + 1], self.values[i][:, :, : t + 1], mask,
                               dropout=0.0, scaling=attn.scaling, sliding_window=None)
            hidden = residual + _project(attn.o_proj, out.reshape(rows, 1, -1))
            residual = hidden
            h = _rms_norm(hidden, layer.post_attention_layernorm)
            gate = _project(mlp.gate_proj, h)
            up = _project(mlp.up_proj, h)
            hidden = residual + _project(mlp.down_proj, F.silu(gate) * up)
        self.length = t + 1
        hidden = _rms_norm(hidden, self.norm)
        return F.linear(hidden, self.lm_head.weight, self.lm_head.bias)[:, -1]


@torch.no_grad()
def compare_with_forward(model: torch.nn.Module, steps: int = 6, leave: dict[int, list[int]] | None = None,
                         after_start: Any = None, seed: int = 0) -> tuple[float, int]:
    """Decode ``steps`` random tokens with the model's forward (a ``DynamicCache`` and a growing mask) and
    with the lean step, from the same left-padded prefill of six prompts of 1-9 tokens, dropping the rows that
    ``leave[step]`` does not list before that step. ``after_start(model)`` runs once both have their prompt
    cache, before the first step. Returns the largest ``|lean - forward|`` over the logits and how many logit
    rows were compared (what ``tests/system/test_lean_decode.py`` and ``dppo doctor --gpu`` check)."""
    from transformers import DynamicCache

    leave = leave or {}
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    config: Any = model.config
    vocab = config.vocab_size
    lengths = [5, 9, 3, 9, 7, 1]
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):  # left padding
        mask[i, width - n:] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    lean = LeanDecoder.for_model(model)
    if lean is None:
        raise ValueError(f"the lean step does not take this model: {LeanDecoder.unsupported(model)}")
    caches = [DynamicCache(config=config) for _ in range(2)]
    for cache in caches:
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
              use_cache=True)
    lean.start(caches[0], mask, steps)
    reference = caches[1]
    if after_start is not None:
        after_start(model)
    pos, worst, compared = positions[:, -1], 0.0, 0
    for step in range(steps):
        if step in leave:
            keep = torch.tensor(leave[step], device=device)
            reference.batch_select_indices(keep)
            lean.keep(keep)
            mask, pos = mask[keep], pos[keep]
        tok = torch.randint(1, vocab, (len(pos),), generator=gen).to(device)
        pos = pos + 1
        mask = torch.cat([mask, mask.new_ones((len(pos), 1))], dim=-1)
        ref = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos[:, None],
                    past_key_values=reference, use_cache=True, logits_to_keep=1).logits[:, -1]
        got = lean.step(tok, pos)
        worst = max(worst, (got.float() - ref.float()).abs().max().item())
        compared += len(pos)
    return worst, compared


def _lora_linear_type() -> type[Any] | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _projection_unsupported(layer: Any) -> str | None:
    """Why :func:`_project` cannot compute ``layer``'s forward exactly, or ``None``."""
    if type(layer) is torch.nn.Linear:
        return None
    if type(layer) is not _lora_linear_type():
        return f"a projection of type {type(layer).__name__} (quantised or another adapter)"
    if type(layer.base_layer) is not torch.nn.Linear:
        return f"a LoRA layer over a {type(layer.base_layer).__name__} (a quantised base)"
    if layer.disable_adapters:
        return "LoRA adapters disabled"
    for name in layer.active_adapters:
        if name in getattr(layer, "lora_variant", {}):
            return f"the LoRA variant {type(layer.lora_variant[name]).__name__} (DoRA or another)"
        if (name in layer.lora_A and layer.training
                and type(layer.lora_dropout[name]) is not torch.nn.Identity):
            return "LoRA dropout in training mode"
        if name in layer.lora_A and (type(layer.lora_A[name]) is not torch.nn.Linear
                                     or type(layer.lora_B[name]) is not torch.nn.Linear):
            return "LoRA factors that are not linear layers"
    return None


def _project(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for an ``nn.Linear`` or a PEFT LoRA ``Linear``, op for op what their forwards compute
    (PEFT's: ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` per active adapter, dropout the identity at
    inference, the result cast back to the base's dtype)."""
    if type(layer) is torch.nn.Linear:
        return F.linear(x, layer.weight, layer.bias)
    base = layer.base_layer
    result = F.linear(x, base.weight, base.bias)
    if layer.merged:
        return result
    dtype = result.dtype
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a, b = layer.lora_A[name], layer.lora_B[name]
        x = layer._cast_input_dtype(x, a.weight.dtype)
        result = result + F.linear(F.linear(x, a.weight, a.bias), b.weight, b.bias) * layer.scaling[name]
    return result.to(dtype)


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """What Llama/Qwen RMSNorm's forward computes (in float32, cast back before the weight)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
