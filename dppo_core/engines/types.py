"""The engines' shared floor: what a rollout is (prompts, sampling settings, completions, groups, batches) and
what an engine must do (:class:`RolloutEngine`: ``generate`` and ``sync``), with the model helpers every
engine uses. The trainer and the evaluator see only these types; which engine sits behind them does not
matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

if TYPE_CHECKING:
    from peft import PeftModel

Prompt = str | list[dict[str, str]]  # plain text, or a chat conversation (list of messages)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample. ``temperature=0`` means greedy decoding."""

    max_tokens: int = 64  # new tokens per completion at most
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # None: continue the engine's random stream

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, including the stop token when one was produced
    text: str  # decoded without special tokens
    logprobs: list[float]  # per generated token, under the sampling distribution (after temperature / top-p)
    finish_reason: str  # "stop" (an end token was generated) or "length" (max_tokens reached)

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class RolloutGroup:
    """The G completions of one prompt."""

    prompt: Prompt
    prompt_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


@dataclass
class RolloutBatch:
    groups: list[RolloutGroup]

    @property
    def num_completions(self) -> int:
        return sum(len(g.completions) for g in self.groups)

    @property
    def num_generated_tokens(self) -> int:
        return sum(c.length for g in self.groups for c in g.completions)

    def texts(self) -> list[list[str]]:
        """Completion texts, one list of G per prompt."""
        return [[c.text for c in g.completions] for g in self.groups]

    def lengths(self) -> list[list[int]]:
        """Completion lengths in tokens, one list of G per prompt."""
        return [[c.length for c in g.completions] for g in self.groups]


class RolloutEngine(Protocol):
    """What the trainer and the evaluator rely on."""

    name: str

    def generate(self, prompts: Sequence[Prompt], num_generations: int = 1,
                 sampling: SamplingConfig | None = None) -> RolloutBatch: ...

    def sync(self, model: torch.nn.Module) -> None: ...


def is_peft_model(model: Any) -> TypeGuard[PeftModel]:
    """True for a PEFT-wrapped model (``peft.PeftModel``)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper, or ``model`` itself."""
    return model.get_base_model() if is_peft_model(model) else model


def stop_ids(model, tokenizer) -> list[int]:
    """The token ids that end a completion: the model's generation_config eos ids and the tokenizer's."""
    ids = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return sorted(ids)
