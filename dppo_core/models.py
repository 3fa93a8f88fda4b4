"""The embedded tiny model: a Qwen3-architecture causal LM and a byte-level BPE tokenizer, built locally.

No download anywhere: the tokenizer is trained on the fly on text of the embedded task
(:mod:`dppo_core.tasks`), the model is initialised from a config, and both are written with
``save_pretrained`` into a cache directory (:func:`dppo_core.model_files.default_cache_dir`), so transformers
(``AutoModelForCausalLM``), PEFT and vLLM all load them by path like any Hub model. The directory name is a
hash of everything that determines the result, so a second call returns at once.

:mod:`dppo_core.warm_start` then fine-tunes the model on worked solutions (and ships the result), so that RL
starts from a policy with a spread of accuracy across the task's levels.

Departures from a "real" small LLM, and why:
1. Digits are split into single tokens before BPE (as Qwen and Llama 3 tokenizers do), which makes
   arithmetic learnable by a tiny model.
2. Input and output embeddings are untied: vLLM keeps the packed lm_head of a tied model after an
   in-memory weight reload on CPU, which would silently desynchronise rollouts from training.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch

from dppo_core.model_files import atomic_dir, default_cache_dir, quiet_transformers
from dppo_core.tasks import ArithmeticTask

#: Bump when a change to this module or to :mod:`dppo_core.warm_start` changes what gets built, so stale
#: caches are not reused.
BUILD_VERSION = 2  # 2: level 1 gained its worked form (tokenizer corpus and warm-start data changed)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

#: Qwen-style chat template: ``<|im_start|>role\ncontent<|im_end|>\n`` per message.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of the embedded model. The defaults give about 2.3M parameters.

    A wider model (hidden 256) learned no faster per CPU minute in our measurements: it takes half as
    many steps per second, so the default stays narrow.
    """

    vocab_size: int = 512  # BPE target; the byte alphabet (256) and the special tokens are included
    hidden_size: int = 192
    intermediate_size: int = 576
    num_hidden_layers: int = 5
    num_attention_heads: int = 3
    num_key_value_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 512
    seed: int = 0

    def key(self) -> str:
        payload = json.dumps({"build": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _tokenizer_corpus(n: int = 20_000, seed: int = 0) -> list[str]:
    """Task text the BPE merges are learned from: chat-formatted prompts and both solution styles."""
    rng = random.Random(seed)
    task = ArithmeticTask()
    texts = []
    for p in task.sample_train(rng, n):
        texts.append(f"{IM_START}user\n{p.prompt}{IM_END}\n{IM_START}assistant\n")
        texts.append(p.solution("steps"))
        texts.append(p.solution("direct"))
    return texts


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer trained on the task's text, wrapped as ``PreTrainedTokenizerFast``.

    Byte-level means every string can be encoded (nothing maps to an unknown token); the digit
    pre-tokenizer keeps every digit a token of its own.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(seed=seed), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        model_max_length=TinyModelConfig.max_position_embeddings,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def qwen3_config(cfg: TinyModelConfig, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        dtype="float32",
    )


def build_tiny_model(
    config: TinyModelConfig | None = None,
    cache_dir: str | Path | None = None,
    *,
    force: bool = False,
) -> Path:
    """Build (or reuse) the embedded tiny model and tokenizer; return the directory that holds both.

    The directory loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``, and in vLLM with ``LLM(model=str(path))``. The same config
    (including its ``seed``) always gives the same weights and tokenizer.
    """
    config = config or TinyModelConfig()
    target = Path(cache_dir or default_cache_dir()) / f"tiny-{config.key()}"
    if target.exists() and not force:
        if (target / "config.json").exists():
            return target

    def write(tmp: Path) -> None:
        from transformers import GenerationConfig, Qwen3ForCausalLM

        tokenizer = build_tokenizer(config.vocab_size, seed=config.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = Qwen3ForCausalLM(qwen3_config(config, tokenizer))
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_new_tokens=64,
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "dppo_build.json").write_text(json.dumps({"kind": "tiny", **asdict(config)}, indent=2))

    return atomic_dir(target, write, replace=force)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a causal LM and its tokenizer from ``path`` (a directory, or a Hub id when online)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if Path(path).exists() else path
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path)
        # PreTrainedModel.to is wrapped with functools.wraps, which the type stubs cannot call as a method
        model = cast(torch.nn.Module, AutoModelForCausalLM.from_pretrained(path, dtype=dtype)).to(device)
    tokenizer.padding_side = "left"
    return model, tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a prompt: chat-templated with the generation prompt when it is a message list.

    The template is rendered to text and then encoded, which is also what vLLM does with chat prompts,
    so both engines see the same ids.
    """
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)
