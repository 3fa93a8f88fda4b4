"""The embedded tiny model and tokenizer: build, determinism, loading, packing, warm start."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dppo_core.models import (
    TinyModelConfig,
    WarmStartConfig,
    block_causal_mask,
    build_tiny_model,
    count_parameters,
    encode_example,
    encode_prompt,
    pack_examples,
    packed_lm_loss,
    warm_start,
)
from dppo_core.tasks import ArithmeticTask


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, tokenizer


def test_loads_with_auto_classes_as_qwen3(loaded):
    model, tokenizer = loaded
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not model.config.tie_word_embeddings
    assert 2_000_000 <= count_parameters(model) <= 5_000_000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_tokenizer_round_trips_task_text(loaded):
    _, tokenizer = loaded
    rng = random.Random(0)
    for p in ArithmeticTask().sample_train(rng, 200):
        for text in (p.prompt, p.solution("steps"), p.solution("direct")):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids) == text


def test_tokenizer_is_byte_level_and_splits_digits(loaded):
    _, tokenizer = loaded
    for text in ("Ünïcödé ✓ 漢字", "tabs\tand\nnewlines", "12345678"):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2026", add_special_tokens=False)) == list("2026")


def test_chat_template_renders_qwen_style(loaded):
    _, tokenizer = loaded
    msgs = [{"role": "user", "content": "What is 1+2?"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = encode_prompt(tokenizer, msgs)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_build_is_deterministic_for_a_seed(tmp_path):
    small = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    a = build_tiny_model(small, tmp_path / "a")
    b = build_tiny_model(small, tmp_path / "b")
    other = build_tiny_model(TinyModelConfig(**{**small.__dict__, "seed": 1}), tmp_path / "c")
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    ma, mb, mo = (AutoModelForCausalLM.from_pretrained(d) for d in (a, b, other))
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(ma.lm_head.weight, mo.lm_head.weight)
    # a second call reuses the cache instead of rebuilding
    assert build_tiny_model(small, tmp_path / "a") == a
    assert json.loads((a / "dppo_build.json").read_text())["hidden_size"] == 64


def test_packed_logits_equal_unpacked(loaded):
    """Packing with position ids restarting per example and a block-diagonal mask changes nothing."""
    model, tokenizer = loaded
    problems = ArithmeticTask().test_set(4)
    examples = [encode_example(tokenizer, p, p.solution("steps")) for p in problems]
    batch = pack_examples(examples, 128, tokenizer.pad_token_id)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        for r in range(batch["input_ids"].shape[0]):
            starts = (batch["position_ids"][r] == 0).nonzero().flatten().tolist()
            real = int((batch["attention_mask"][r, 0].sum(-1) > 1).sum()) + 1
            ends = starts[1:] + [real]
            for s, e in zip(starts, ends, strict=True):
                if e - s < 2:
                    continue
                alone = model(input_ids=batch["input_ids"][r, s:e][None]).logits[0]
                assert (packed[r, s:e] - alone).abs().max() < 1e-5


def test_block_causal_mask_shape_and_content():
    seq = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = block_causal_mask(seq)[0, 0]
    assert m.shape == (6, 6)
    assert m[1, 0] and not m[0, 1]  # causal inside a sequence
    assert not m[2, 1] and m[4, 2]  # no attention across the boundary
    assert m[5, 5] and m[5].sum() == 1  # padding attends only to itself


def test_pack_rejects_an_example_longer_than_the_row(loaded):
    _, tokenizer = loaded
    p = ArithmeticTask().test(5, 1)[0]
    ex = encode_example(tokenizer, p, p.solution("steps"))
    with pytest.raises(ValueError, match="row_tokens"):
        pack_examples([ex], 8, tokenizer.pad_token_id)


def test_short_warm_start_lowers_the_loss_and_is_cached(tmp_path):
    small = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    cfg = WarmStartConfig(steps=30, batch_size=16, warmup_steps=5)
    path = warm_start(cfg, small, tmp_path, progress=False)
    log = json.loads((path / "warm_start_log.json").read_text())
    losses = log["loss"]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert warm_start(cfg, small, tmp_path, progress=False) == path  # cached
    model = AutoModelForCausalLM.from_pretrained(path)
    batch = pack_examples([encode_example(AutoTokenizer.from_pretrained(path), p, p.solution("steps"))
                           for p in ArithmeticTask().test_set(2)], 256, 0)
    assert torch.isfinite(packed_lm_loss(model, batch))


# --------------------------------------------------------------------------------------------------
# The warm start shipped with the package
# --------------------------------------------------------------------------------------------------

#: the Makefile's kernel pins under which the shipped warm start was built
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_the_default_warm_start_is_the_shipped_copy(tmp_path):
    from safetensors.torch import load_file

    from dppo_core.models import SHIPPED_WARM_START, shipped_warm_start_name, warm_start_name

    assert shipped_warm_start_name() is not None, "the package has no shipped warm start"
    path = warm_start(cache_dir=tmp_path, progress=False)
    assert path.name == shipped_warm_start_name()
    assert not (tmp_path / f"tiny-{TinyModelConfig().key()}").exists()  # nothing was built or trained
    assert json.loads((path / "warm_start_log.json").read_text())["source"] == "shipped"
    ours, shipped = load_file(path / "model.safetensors"), load_file(SHIPPED_WARM_START / "model.safetensors")
    assert ours.keys() == shipped.keys() and all(torch.equal(ours[k], shipped[k]) for k in ours)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert count_parameters(model) > 2_000_000 and tokenizer.eos_token == "<|im_end|>"
    # another configuration is not the shipped one: its name differs, so it would be trained
    assert warm_start_name(WarmStartConfig(steps=10)) != path.name == warm_start_name()


@pytest.mark.slow
def test_building_from_scratch_reproduces_the_shipped_warm_start(tmp_path):
    """The shipped weights are what `warm_start(force=True)` trains (a few minutes on 2 CPU cores): bit for
    bit under the Makefile's kernel pins; elsewhere the kernels round differently and the test says by how much."""
    import os

    from safetensors.torch import load_file

    from dppo_core.models import SHIPPED_WARM_START

    path = warm_start(cache_dir=tmp_path, force=True, progress=False)
    assert "source" not in json.loads((path / "warm_start_log.json").read_text())  # trained, not copied
    ours, shipped = load_file(path / "model.safetensors"), load_file(SHIPPED_WARM_START / "model.safetensors")
    assert ours.keys() == shipped.keys()
    diff = max((ours[k] - shipped[k]).abs().max().item() for k in ours)
    scale = max(shipped[k].abs().max().item() for k in shipped)
    pinned = all(os.environ.get(k) == v for k, v in PINNED.items())
    if not pinned:
        pytest.skip(f"kernels not pinned ({PINNED} not all set): the rebuilt weights differ from the shipped ones "
                    f"by at most {diff:.3g} (largest weight {scale:.3g})")
    assert diff == 0, f"rebuilt under the pinned kernels, the weights differ by up to {diff:.3g}"
    assert (path / "tokenizer.json").read_text() == (SHIPPED_WARM_START / "tokenizer.json").read_text()


@pytest.mark.slow
def test_the_wheel_carries_the_shipped_warm_start(tmp_path):
    """What `pip install` (or Colab's install from git) gets: the package data of a built wheel."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from conftest import REPO_ROOT

    from dppo_core.models import SHIPPED_FILES

    src = tmp_path / "src"  # a copy, so the build writes nothing into the checkout
    shutil.copytree(REPO_ROOT / "dppo_core", src / "dppo_core", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("dppo_core-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"dppo_core/assets/warm-start/{f}" for f in SHIPPED_FILES} <= names
