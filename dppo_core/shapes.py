"""Qwen3 models of a published shape with random weights, for timing and for checks of the GPU paths: the
layer shapes of Qwen3-0.6B and Qwen3-1.7B (and a tiny one), built locally with the embedded tokenizer, no
download.

``model: random:NAME`` in a configuration names one (:func:`resolve_random_model`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelShape:
    """The layer shapes of a Qwen3 model (the vocabulary is the embedded tokenizer's)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True


#: Qwen3's published layer shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B), and a tiny one.
SHAPES: dict[str, ModelShape] = {
    "qwen3-1.7b": ModelShape(2048, 6144, 28, 16, 8, 128),
    "qwen3-0.6b": ModelShape(1024, 3072, 28, 16, 8, 128),
    # head_dim 64: vLLM's CPU attention supports a few head sizes only (16 is refused on AVX2)
    "tiny": ModelShape(128, 256, 2, 2, 1, 64, max_position_embeddings=512),
}
#: ``model: random:NAME`` in a configuration builds (or reuses) the model of shape NAME with random weights.
RANDOM_PREFIX = "random:"


def build_shaped_model(name: str, cache_dir: str | Path | None = None, dtype: str = "bfloat16") -> Path:
    """Build (or reuse) a Qwen3 model of shape ``SHAPES[name]`` with random weights (seed 0) and the embedded
    tokenizer; return its directory (loads with ``from_pretrained`` and in vLLM). Stored in ``dtype``."""
    from dppo_core.model_files import atomic_dir, default_cache_dir
    from dppo_core.models import BUILD_VERSION, TinyModelConfig, build_tokenizer, qwen3_config

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}")
    shape = SHAPES[name]
    key = hashlib.sha256(json.dumps({"build": BUILD_VERSION, "dtype": dtype, **asdict(shape)},
                                    sort_keys=True).encode()).hexdigest()[:12]
    target = Path(cache_dir or default_cache_dir()) / f"shape-{name}-{key}"
    if (target / "config.json").exists():
        return target

    def write(tmp: Path) -> None:
        from transformers import GenerationConfig, Qwen3ForCausalLM

        tokenizer = build_tokenizer()
        tokenizer.model_max_length = shape.max_position_embeddings
        layers = {k: v for k, v in asdict(shape).items() if k != "tie_word_embeddings"}
        config = qwen3_config(TinyModelConfig(**layers), tokenizer)
        config.tie_word_embeddings = shape.tie_word_embeddings
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(config)
        model.to(getattr(torch, dtype))
        model.config.dtype = dtype
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                   pad_token_id=tokenizer.pad_token_id)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "dppo_build.json").write_text(json.dumps({"kind": "random", "shape": name, **asdict(shape)},
                                                        indent=2))

    return atomic_dir(target, write)


def resolve_random_model(model: str, dtype: str | None = None) -> str:
    """``random:NAME`` → the directory of :func:`build_shaped_model`'s model (stored in bfloat16 where CUDA is
    available, else float32, unless ``dtype`` says); any other value unchanged."""
    if not model.startswith(RANDOM_PREFIX):
        return model
    dtype = dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    return str(build_shaped_model(model[len(RANDOM_PREFIX):], dtype=dtype))
