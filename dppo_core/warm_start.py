"""The supervised warm start: the embedded tiny model (:mod:`dppo_core.models`) fine-tuned on worked
solutions.

:func:`warm_start` fine-tunes the tiny model on the task's reference solutions (supervised, a few CPU minutes)
so that RL starts from a policy with a spread of accuracy across the task's levels. The result is cached: the
directory name is a hash of everything that determines it (:func:`warm_start_name`), so a second call returns
at once.

The default warm start ships with the package (:data:`SHIPPED_WARM_START`, about 9 MB): ``warm_start()`` with
the default configuration copies it into the cache instead of training, so every machine (a laptop, a Colab
session, CI) starts from the same weights in seconds (what it then computes can still differ in the last bits
on another CPU's kernels). It was built by ``warm_start(force=True)`` on 2 CPU cores of an AMD CPU with the
AVX2 kernels pinned (the Makefile's ``ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``); its
``warm_start_log.json`` records that :func:`~dppo_core.numerics.kernel_fingerprint`. Its 600 AdamW steps are
chaotic in the last bits: rebuilt on another CPU, even under the same pins, the weights differ (by up to 0.2
on an Intel CPU with AVX-512) and the model is another one (greedy accuracy 0.51 against the shipped model's
0.70 there): which is why the weights ship. ``tests/system/test_models.py`` rebuilds it from scratch (``make
test-rebuild``) and checks that it learned as the shipped run did (the loss curve, the mean greedy accuracy;
``benchmarks/warm_start_rebuild.py`` measures both), and its weights bit for bit only where the fingerprint
matches the recorded one; ``make test`` retrains only the first 50 steps (``train_warm_start(..., until=50)``)
and compares their losses with the shipped log. ``force=True`` (``dppo build --from-scratch``) always builds.

The training packs examples first-fit (longest first) into rows of ``row_tokens`` (:func:`pack_examples`: not
:mod:`dppo_core.packing`'s window-greedy packer, whose rows differ, and the shipped weights and every cached
warm start are this packer's result) and takes the trainer's cosine learning-rate schedule
(:func:`learning_rate_schedule`).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dppo_core.config import DPPOConfig, learning_rate_at
from dppo_core.model_files import atomic_dir, default_cache_dir
from dppo_core.models import BUILD_VERSION, TinyModelConfig, build_tiny_model, encode_prompt, load_model
from dppo_core.numerics import kernel_fingerprint
from dppo_core.packing import block_causal_mask
from dppo_core.tasks import LEVELS, ArithmeticTask, Problem

#: the default warm start, shipped with the package (see the module docstring)
SHIPPED_WARM_START = Path(__file__).parent / "assets" / "warm-start"
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "warm_start_log.json")


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


def warm_start_name(config: WarmStartConfig | None = None,
                    model_config: TinyModelConfig | None = None) -> str:
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


def learning_rate_schedule(config: WarmStartConfig) -> DPPOConfig:
    """The warm start's learning-rate schedule as the trainer's (:func:`dppo_core.config.learning_rate_at` of
    it gives step ``t``'s rate): linear warm-up over ``warmup_steps``, then cosine decay from
    ``learning_rate`` towards 10% of it at step ``steps``."""
    return DPPOConfig(learning_rate=config.learning_rate, warmup_steps=config.warmup_steps,
                      max_steps=max(1, config.steps), lr_schedule="cosine", min_lr_ratio=0.1)


def train_warm_start(model: torch.nn.Module, tokenizer, config: WarmStartConfig, *, progress: bool = True,
                     log: Callable[[dict], None] | None = None, until: int | None = None) -> list[float]:
    """:func:`warm_start`'s training, in place on ``model``: ``config.steps`` AdamW steps on packed worked or
    direct solutions; returns the loss of every step (rounded to 5 decimals). Leaves ``model`` in eval mode.

    ``until``: stop after the first ``until`` steps of that run (the same data, learning rates and weights as
    the whole run's first steps, which a shorter ``config.steps`` would not give: the cosine schedule spans
    ``config.steps``). The start of a rebuild, to compare with a recorded loss curve in seconds rather than
    minutes.
    """
    if until is not None and not 0 < until <= config.steps:
        raise ValueError(f"until={until!r} must be a step count in 1..{config.steps} (config.steps)")
    from tqdm.auto import tqdm

    model.train()
    task = ArithmeticTask()
    rng = random.Random(config.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    schedule = learning_rate_schedule(config)
    history = []
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        bar = tqdm(range(until or config.steps), desc="warm start", disable=None if progress else True,
                   mininterval=1.0)
        for step in bar:
            problems = task.sample_train(rng, config.batch_size, config.level_weights)
            styles = ["steps" if rng.random() < config.steps_fraction else "direct" for _ in problems]
            examples = [encode_example(tokenizer, p, p.solution(s))
                        for p, s in zip(problems, styles, strict=True)]
            batch = pack_examples(examples, config.row_tokens, tokenizer.pad_token_id)
            for group in opt.param_groups:
                group["lr"] = learning_rate_at(step, schedule)
            loss = packed_lm_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            history.append(round(loss.item(), 5))
            if step % 20 == 0 or step == (until or config.steps) - 1:
                bar.set_postfix(loss=f"{loss.item():.3f}")
                if log is not None:
                    log({"step": step, "loss": loss.item(), "lr": learning_rate_at(step, schedule),
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

    return atomic_dir(target, write, replace=force)
