"""The trainable policy: a causal LM for full fine-tuning, or a LoRA / QLoRA (bitsandbytes 4/8-bit) adapter on
one.

``load_policy`` checks what a user passes (a directory without config.json, an encoder loaded as a causal
LM) and works around bitsandbytes' CPU 4-bit kernel, which otherwise stops LoRA learning silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from dppo_core.config import ConfigError, DPPOConfig


def resolve_model_path(config: DPPOConfig) -> str:
    """The path (or Hub id) of ``config.model``: ``tiny`` is the embedded warm start (the shipped copy,
    cached); a name of :data:`dppo_core.pretrained.PRETRAINED` (``smollm2-135m``) its converted directory,
    fetched the first time (:func:`dppo_core.pretrained.build_pretrained`)."""
    from dppo_core.pretrained import FetchError, resolve_pretrained

    if config.model == "tiny":
        from dppo_core.warm_start import warm_start

        return str(warm_start())
    try:
        model = resolve_pretrained(config.model)
    except FetchError as exc:
        raise ConfigError(f"model={config.model!r}: {exc}") from exc
    if model != config.model:
        return model
    path = Path(config.model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model={config.model!r} is a directory without config.json; pass the "
                              "directory that save_pretrained wrote, a Hub id, or 'tiny'")
        return str(path)
    if config.model.startswith((".", "/", "~")):
        raise ConfigError(f"model={config.model!r} does not exist; pass a model directory, a Hub id, or "
                          "'tiny'")
    return config.model  # a Hub id


def disable_4bit_cpu_bf16_path(model: torch.nn.Module) -> int:
    """Work around bitsandbytes' CPU 4-bit kernel losing autograd after an eval-mode forward.

    bitsandbytes 0.50 repacks 4-bit weights for its AVX512-BF16 inference kernel on the first no-grad
    forward (e.g. ``generate``); the training path then has no autograd kernel and LoRA silently stops
    learning. Turning that fast path off on every ``Linear4bit`` keeps training correct. Returns the
    number of modules changed.
    """
    n = 0
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "support_avx512bf16_for_cpu"):
            # bitsandbytes' attribute (torch: Tensor | Module)
            cast(Any, module).support_avx512bf16_for_cpu = False
            n += 1
    return n


def check_causal(model: torch.nn.Module, model_path: str) -> None:
    """Refuse a model whose first position sees the second (e.g. BERT loaded as ``BertLMHeadModel``).

    AutoModelForCausalLM accepts some encoders without an error; training one would be silently wrong.
    """
    device = next(model.parameters()).device
    # one call per sequence: same shapes and kernels, so a causal model gives equal rows
    with torch.no_grad():
        first = [model(input_ids=torch.tensor([[1, t]], device=device), use_cache=False).logits[0, 0].float()
                 for t in (2, 3)]
    if (first[0] - first[1]).abs().max() > 1e-4 * torch.stack(first).abs().max() + 1e-6:
        raise ConfigError(f"model={model_path!r} ({type(model).__name__}) is not causal: its output at a "
                          "position depends on later tokens; pass a decoder-only causal LM (e.g. Qwen3)")


def flash_attention_available() -> bool:
    """Whether flash-attention 2 imports and works with this torch (installed is not enough: a wheel built
    against another torch fails at import)."""
    try:
        from transformers.utils import is_flash_attn_2_available

        return bool(is_flash_attn_2_available())
    except Exception:  # noqa: BLE001 - a broken install is "not available"
        return False


def attention_kernel(choice: str, device: torch.device, needs_mask: bool = False) -> str:
    """The attention implementation to load the policy with, for ``DPPOConfig.attn_implementation``.

    ``"auto"``: with ``needs_mask`` (the shared-prefix layout), segment attention
    (:data:`dppo_core.shared_prefix.NAME`: per-segment attention in the update, sdpa in every other call);
    else on CUDA, ``flash_attention_2`` when ``flash_attn`` imports, else ``torch_varlen`` (PyTorch's
    own variable-length kernel, :mod:`dppo_core.varlen`) where this PyTorch has it: a packed update then
    runs a variable-length kernel (:mod:`dppo_core.packing`), 1.42x faster than the block-diagonal mask on
    an H200 (``benchmarks/results/gpu/attention``); else, on CPU, ``sdpa``. An explicit
    ``flash_attention_2`` without the package raises with the install command.
    """
    has_flash = flash_attention_available()
    if choice == "auto":
        if needs_mask:
            from dppo_core import shared_prefix

            shared_prefix.register()
            return shared_prefix.NAME
        if device.type != "cuda":
            return "sdpa"
        if has_flash:
            return "flash_attention_2"
        from dppo_core import varlen

        if varlen.available(device):
            varlen.register()
            return varlen.NAME
        return "sdpa"
    if choice == "flash_attention_2" and not (device.type == "cuda" and has_flash):
        raise ConfigError("attn_implementation='flash_attention_2' needs a CUDA device and the flash-attn "
                          "package (pip install flash-attn --no-build-isolation); use "
                          "attn_implementation=auto or sdpa")
    if choice == "torch_varlen":
        from dppo_core import varlen

        why = varlen.unavailable_reason(device)
        if why is not None:
            raise ConfigError(f"attn_implementation='torch_varlen' cannot run here: {why}; use "
                              "attn_implementation=auto or sdpa")
        varlen.register()
    return choice


def load_policy(config: DPPOConfig, model_path: str, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The trainable policy for ``config.update_mode`` and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_core.model_files import quiet_transformers

    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model={model_path!r}: its tokenizer or config could not be loaded ({exc}); "
                              "pass a directory written by save_pretrained, a Hub id, or 'tiny'") from exc
        tokenizer.padding_side = "left"
        kwargs: dict[str, Any] = {"dtype": torch.float32 if device.type == "cpu" else torch.bfloat16,
                                  "attn_implementation": attention_kernel(config.attn_implementation, device,
                                                                          needs_mask=config.shared_prefix)}
        if config.update_mode in ("qlora4", "qlora8"):
            from transformers import BitsAndBytesConfig

            if config.update_mode == "qlora4":
                kwargs["quantization_config"] = BitsAndBytesConfig(
                    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=kwargs["dtype"])
            else:
                kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
            if device.type == "cuda":
                kwargs["device_map"] = {"": device.index or 0}
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
        except (OSError, ValueError) as exc:
            first = str(exc).splitlines()[0]
            raise ConfigError(f"model={model_path!r} could not be loaded as a causal LM: {first}; pass a "
                              "decoder-only model (e.g. Qwen3) saved with save_pretrained, or "
                              "'tiny'") from exc
    if "quantization_config" not in kwargs:
        # PreTrainedModel.to is wrapped with functools.wraps, which the type stubs cannot call as a method
        cast(torch.nn.Module, model).to(device)
        check_causal(model, model_path)
    if config.update_mode == "full":
        return model, tokenizer
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    if config.update_mode == "qlora4" and device.type == "cpu":
        disable_4bit_cpu_bf16_path(peft_model)
    return peft_model, tokenizer


def load_reference(config: DPPOConfig, model_path: str, device: torch.device) -> torch.nn.Module | None:
    """A frozen copy of the initial policy for the KL term: only for full fine-tuning with ``beta > 0``.

    With LoRA the reference is the base model with the adapter disabled (no second copy), so None.
    """
    if not (config.beta > 0 and config.update_mode == "full"):
        return None
    from dppo_core.models import load_model

    # the policy's dtype (bf16 on a GPU, fp32 on CPU), so that the KL term compares like with like
    ref_model, _ = load_model(model_path, device=device,
                              dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    # with the shared-prefix layout the policy runs segment attention: so does the reference, so that it takes
    # the same unpadded rows at the same cost (other kernels stay sdpa)
    kernel = attention_kernel(config.attn_implementation, device, needs_mask=config.shared_prefix)
    from dppo_core.shared_prefix import NAME as SEGMENTS

    if kernel == SEGMENTS:
        ref_model.set_attn_implementation(kernel)
    return ref_model.requires_grad_(False).eval()
