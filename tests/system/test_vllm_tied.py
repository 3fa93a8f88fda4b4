"""vLLM full-weight sync into a model with tied input and output embeddings (Qwen3-0.6B and -1.7B do this).

vLLM's in-place reload used to leave the LM head with its old processed weight (on CPU, the packed copy its
matmul uses): 0.39 mean |Δ log-prob| after a sync, found by `dppo doctor --gpu`. The engine now ties the head
again after every reload. Its own module: an engine's close() tears down vLLM's process-wide state, so it
must not run beside tests/system/test_vllm.py's module-wide engines.
"""

from __future__ import annotations

import pytest
import torch

from dppo_core.engines.vllm import VLLMRollout
from dppo_core.models import load_model
from dppo_core.rollout import HFRollout, SamplingConfig
from dppo_core.tasks import ArithmeticTask

pytestmark = [pytest.mark.vllm, pytest.mark.numerics]

TOL = 1e-4


def _max_diff(a, b):
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_full_sync_reaches_a_tied_lm_head(cache_dir):
    from dppo_core.shapes import build_shaped_model
    from dppo_core.tools.gpu_check_rollouts import perturb

    tied_dir = build_shaped_model("tiny", cache_dir, dtype="float32")
    model, tok = load_model(tied_dir)
    assert model.config.tie_word_embeddings
    e = VLLMRollout(tied_dir, tok, kv_cache_memory_bytes=1 << 27)
    try:
        assert e.tied_embeddings
        prompts = [p.messages() for p in ArithmeticTask().test_set(1)[:4]]
        batch = e.generate(prompts, 2, SamplingConfig(max_tokens=12, seed=0))
        seqs = [g.prompt_ids + c.token_ids for g in batch.groups for c in g.completions]
        perturb(model, scale=0.02)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert _max_diff(e.score(seqs), HFRollout(model, tok).score(seqs)) > 1e-2  # stale before the sync
        e.sync(model)
        assert _max_diff(e.score(seqs), HFRollout(model, tok).score(seqs)) < TOL
        with torch.no_grad():  # a second update and sync: the reload starts from the re-tied head
            model.model.embed_tokens.weight.mul_(1.5)
        e.sync(model)
        assert _max_diff(e.score(seqs), HFRollout(model, tok).score(seqs)) < TOL
    finally:
        e.close()
