"""The embedded tiny model: a Qwen3-architecture causal LM and a byte-level BPE tokenizer, built locally.

No download anywhere: the tokenizer is trained on the fly on text of the embedded task
(:mod:`dppo_core.tasks`), the model is initialised from a config, and both are written with
``save_pretrained`` into a cache directory, so transformers (``AutoModelForCausalLM``), PEFT and vLLM all
load them by path like any Hub model.

:func:`warm_start` then fine-tunes the model on worked solutions (supervised, a few CPU minutes) so that
RL starts from a policy with a spread of accuracy across the task's levels. Both steps are cached: the
directory name is a hash of everything that determines the result, so a second call returns at once.

The default warm start ships with the package (:data:`SHIPPED_WARM_START`, about 9 MB): ``warm_start()``
with the default configuration copies it into the cache instead of training, so every machine (a laptop, a
Colab session, CI) starts from the same weights in seconds (what it then computes can still differ in the last
bits on another CPU's kernels). It was built by
``warm_start(force=True)`` on 2 CPU cores of an AMD CPU with the AVX2 kernels pinned (the Makefile's
``ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``); its ``warm_start_log.json`` records that
:func:`kernel_fingerprint`. Its 600 AdamW steps are chaotic in the last bits: rebuilt on another CPU, even under
the same pins, the weights differ (by up to 0.2 on an Intel CPU with AVX-512) and the model is another one (greedy
accuracy 0.51 against the shipped model's 0.70 there): which is why the weights ship.
``tests/test_models.py`` rebuilds it from scratch and checks that it learned as the shipped run did (the loss
curve, the mean greedy accuracy; ``benchmarks/warm_start_rebuild.py`` measures both), and its weights bit for bit
only where the fingerprint matches the recorded one. ``force=True``
(``dppo build --from-scratch``) always builds.

Departures from a "real" small LLM, and why:
1. Digits are split into single tokens before BPE (as Qwen and Llama 3 tokenizers do), which makes
   arithmetic learnable by a tiny model.
2. Input and output embeddings are untied: vLLM keeps the packed lm_head of a tied model after an
   in-memory weight reload on CPU, which would silently desynchronise rollouts from training.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import torch

from dppo_core.tasks import LEVELS, ArithmeticTask, Problem

#: Bump when a change to this module changes what gets built, so stale caches are not reused.
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


#: the default warm start, shipped with the package (see the module docstring)
SHIPPED_WARM_START = Path(__file__).parent / "assets" / "warm-start"
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "warm_start_log.json")


#: The environment variables that choose the CPU's floating-point kernels (the Makefile sets them).
KERNEL_SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def _cpu_vendor() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.machine() or "unknown"


def kernel_fingerprint() -> dict[str, str]:
    """What decides the bits of a float computation on this CPU: the CPU's vendor (``AuthenticAMD``,
    ``GenuineIntel``; the machine type where there is no /proc/cpuinfo), PyTorch's version, the vector kernels
    PyTorch runs (``torch.backends.cpu.get_cpu_capability()``), its thread count (a long sum is split by threads)
    and the settings in :data:`KERNEL_SETTINGS`.

    A chaotic computation (hundreds of optimizer steps) reproduces bit for bit only between equal fingerprints;
    that is what a recording of one is stored with, and :func:`fingerprint_mismatch` compares."""
    return {"cpu_vendor": _cpu_vendor(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": str(torch.get_num_threads()),
            **{k: os.environ.get(k, "") for k in KERNEL_SETTINGS}}


def fingerprint_mismatch(recorded: dict[str, str], current: dict[str, str] | None = None) -> str | None:
    """``None`` where every key of ``recorded`` has its recorded value in ``current`` (default: this machine's
    :func:`kernel_fingerprint`); otherwise the differences, as ``key: recorded -> here``."""
    current = kernel_fingerprint() if current is None else current
    diffs = [f"{k}: {v!r} -> {current.get(k, '')!r}" for k, v in recorded.items() if current.get(k, "") != v]
    return "; ".join(diffs) or None


def warm_start_name(config: WarmStartConfig | None = None, model_config: TinyModelConfig | None = None) -> str:
    """The cache directory name (``warm-<key>``) of :func:`warm_start` for these configurations (defaults: the
    default ones)."""
    base = f"tiny-{(model_config or TinyModelConfig()).key()}"  # build_tiny_model's directory name
    return f"warm-{(config or WarmStartConfig()).key(base)}"


def shipped_warm_start_name() -> str | None:
    """The cache directory name (``warm-<key>``) the shipped warm start stands for, or None if the package has
    none (a checkout without the asset)."""
    log = SHIPPED_WARM_START / "warm_start_log.json"
    if not all((SHIPPED_WARM_START / f).is_file() for f in SHIPPED_FILES):
        return None
    meta = json.loads(log.read_text())
    try:
        return f"warm-{WarmStartConfig(**meta['config']).key(meta['base'])}"
    except (KeyError, TypeError):  # written by a version whose WarmStartConfig had other fields
        return None


def default_cache_dir() -> Path:
    """Where built models go: ``$DPPO_CACHE_DIR``, else ``$XDG_CACHE_HOME/dppo_core``, else ``~/.cache/dppo_core``."""
    if os.environ.get("DPPO_CACHE_DIR"):
        return Path(os.environ["DPPO_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dppo_core"


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


@contextlib.contextmanager
def quiet_transformers():
    """Hide transformers' per-file progress bars (weights loading/writing) inside the block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def atomic_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a temporary sibling of ``target`` and rename it into place.

    A crash or Ctrl-C leaves no half-written ``target``; a concurrent builder that finished first wins.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with quiet_transformers():
            write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    if force and target.exists():
        shutil.rmtree(target)

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

    return atomic_dir(target, write)


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


# --------------------------------------------------------------------------------------------------
# Warm start: supervised fine-tuning on worked solutions
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start on the embedded task. Defaults take about 3 minutes on 2 CPU cores.

    The level mix leans away from the extremes: level 1 is learned almost at once, and a uniform mix
    left the model on the "format plateau" (loss ~1.1) for a minute in our measurements.
    """

    steps: int = 600  # optimizer steps
    batch_size: int = 64  # examples per step
    learning_rate: float = 3e-3  # AdamW peak, cosine decay to 10% after `warmup_steps`
    warmup_steps: int = 20
    weight_decay: float = 0.0
    level_weights: tuple[float, ...] = (1.0, 2.0, 3.0, 3.0, 2.0)  # sampling weight of each level 1..5
    steps_fraction: float = 0.5  # share of examples with worked steps (the rest answer directly)
    row_tokens: int = 256  # examples are packed into rows of this many tokens
    seed: int = 0

    def key(self, base: str) -> str:
        payload = json.dumps({"build": BUILD_VERSION, "base": base, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a prompt: chat-templated with the generation prompt when it is a message list.

    The template is rendered to text and then encoded, which is also what vLLM does with chat prompts,
    so both engines see the same ids.
    """
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


@dataclass
class Example:
    """A tokenised training sequence: prompt then completion, loss on the completion only."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 on completion tokens
    meta: dict = field(default_factory=dict)


def encode_example(tokenizer, problem: Problem, completion: str) -> Example:
    """Token ids of chat prompt + completion + ``<|im_end|>``, tokenised the way generation sees them."""
    prompt_ids = encode_prompt(tokenizer, problem.messages())
    completion_ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Example(
        input_ids=list(prompt_ids) + completion_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(completion_ids),
        meta={"id": problem.id, "level": problem.level},
    )


def pack_examples(examples: Sequence[Example], row_tokens: int, pad_id: int) -> dict[str, torch.Tensor]:
    """First-fit packing of short examples into rows of ``row_tokens`` for supervised training.

    Returns ``input_ids``, ``labels`` (-100 where no loss), ``position_ids`` (restarting at 0 for each
    example) and a boolean block-diagonal causal ``attention_mask`` of shape (rows, 1, T, T), so no
    token attends across an example boundary.
    """
    rows: list[list[Example]] = []
    used: list[int] = []
    for ex in sorted(examples, key=lambda e: -len(e.input_ids)):
        n = len(ex.input_ids)
        if n > row_tokens:
            raise ValueError(f"example {ex.meta.get('id')} has {n} tokens, more than row_tokens={row_tokens}")
        for r, u in enumerate(used):
            if u + n <= row_tokens:
                rows[r].append(ex)
                used[r] += n
                break
        else:
            rows.append([ex])
            used.append(n)
    T = max(used)
    R = len(rows)
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)
    labels = torch.full((R, T), -100, dtype=torch.long)
    position_ids = torch.zeros((R, T), dtype=torch.long)
    seq_ids = torch.full((R, T), -1, dtype=torch.long)  # which example each slot holds; -1 = padding
    for r, row in enumerate(rows):
        pos = 0
        for s, ex in enumerate(row):
            n = len(ex.input_ids)
            ids = torch.tensor(ex.input_ids)
            input_ids[r, pos : pos + n] = ids
            # labels[t] is the token predicted at position t, shifted inside the example only
            lab = torch.where(torch.tensor(ex.loss_mask) == 1, ids, torch.tensor(-100))
            labels[r, pos : pos + n - 1] = lab[1:]
            position_ids[r, pos : pos + n] = torch.arange(n)
            seq_ids[r, pos : pos + n] = s
            pos += n
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attention_mask": block_causal_mask(seq_ids),
    }


def block_causal_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """(rows, T) sequence ids -> (rows, 1, T, T) bool mask: attend only to earlier tokens of the same sequence.

    Padding slots (id -1) attend to themselves only, so no row of the softmax is empty.
    """
    T = seq_ids.shape[1]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]  # (rows, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    eye = torch.eye(T, dtype=torch.bool)
    return ((same & causal) | eye)[:, None]


def packed_lm_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens of a packed batch."""
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
    ).logits  # (rows, T, vocab)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
    )


def _lr_at(step: int, cfg: WarmStartConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_warm_start(model: torch.nn.Module, tokenizer, config: WarmStartConfig, *, progress: bool = True,
                     log: Callable[[dict], None] | None = None) -> list[float]:
    """:func:`warm_start`'s training, in place on ``model``: ``config.steps`` AdamW steps on packed worked or
    direct solutions; returns the loss of every step (rounded to 5 decimals). Leaves ``model`` in eval mode."""
    from tqdm.auto import tqdm

    model.train()
    task = ArithmeticTask()
    rng = random.Random(config.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    history = []
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        bar = tqdm(range(config.steps), desc="warm start", disable=None if progress else True, mininterval=1.0)
        for step in bar:
            problems = task.sample_train(rng, config.batch_size, config.level_weights)
            styles = ["steps" if rng.random() < config.steps_fraction else "direct" for _ in problems]
            examples = [encode_example(tokenizer, p, p.solution(s)) for p, s in zip(problems, styles, strict=True)]
            batch = pack_examples(examples, config.row_tokens, tokenizer.pad_token_id)
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, config)
            loss = packed_lm_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            history.append(round(loss.item(), 5))
            if step % 20 == 0 or step == config.steps - 1:
                bar.set_postfix(loss=f"{loss.item():.3f}")
                if log is not None:
                    log({"step": step, "loss": loss.item(), "lr": _lr_at(step, config),
                         "elapsed_s": time.perf_counter() - start})
    model.eval()
    return history


def warm_start(
    config: WarmStartConfig | None = None,
    model_config: TinyModelConfig | None = None,
    cache_dir: str | Path | None = None,
    *,
    force: bool = False,
    progress: bool = True,
    log: Callable[[dict], None] | None = None,
) -> Path:
    """Fine-tune the tiny model on the task's reference solutions; return the cached result's directory.

    Each step draws ``batch_size`` training problems (levels by ``level_weights``), writes each as a
    worked (``steps_fraction``) or direct solution, packs them into rows and takes one AdamW step on the
    completion tokens' cross-entropy. Deterministic for a seed on a given machine. ``log`` receives
    ``{"step", "loss", "lr", "elapsed_s"}`` every 20 steps; the full loss curve is saved as
    ``warm_start_log.json`` next to the weights.

    The configuration the package ships a warm start for (the default one) is copied from
    :data:`SHIPPED_WARM_START` into the cache instead of trained, unless ``force`` (which always trains); its
    ``warm_start_log.json`` then says ``"source": "shipped"``.
    """
    config = config or WarmStartConfig()
    model_config = model_config or TinyModelConfig()
    cache = Path(cache_dir or default_cache_dir())
    target = cache / warm_start_name(config, model_config)
    if target.exists() and (target / "config.json").exists() and not force:
        return target
    if force and target.exists():
        shutil.rmtree(target)
    if not force and shipped_warm_start_name() == target.name:
        def copy(tmp: Path) -> None:
            for name in SHIPPED_FILES:
                shutil.copyfile(SHIPPED_WARM_START / name, tmp / name)
            meta = json.loads((tmp / "warm_start_log.json").read_text())
            (tmp / "warm_start_log.json").write_text(json.dumps({**meta, "source": "shipped"}))

        return atomic_dir(target, copy)
    base = build_tiny_model(model_config, cache)
    if len(config.level_weights) != len(LEVELS):
        raise ValueError(f"level_weights needs one weight per level {LEVELS}, got {config.level_weights!r}")

    def write(tmp: Path) -> None:
        model, tokenizer = load_model(base)
        start = time.perf_counter()
        history = train_warm_start(model, tokenizer, config, progress=progress, log=log)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {"kind": "warm_start", "base": base.name, "seconds": round(time.perf_counter() - start, 1),
                "config": asdict(config), "kernels": kernel_fingerprint(), "loss": history}
        (tmp / "warm_start_log.json").write_text(json.dumps(meta))

    return atomic_dir(target, write)
