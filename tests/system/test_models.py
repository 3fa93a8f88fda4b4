"""The embedded tiny model and tokenizer: build, determinism, loading, packing, warm start."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dppo_core.models import TinyModelConfig, build_tiny_model, count_parameters, encode_prompt, load_model
from dppo_core.packing import block_causal_mask
from dppo_core.tasks import ArithmeticTask
from dppo_core.warm_start import WarmStartConfig, encode_example, pack_examples, packed_lm_loss, warm_start


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
    # the start of the same run, stopped early: the whole run's first steps (its schedule spans all 30)
    from dppo_core.warm_start import train_warm_start

    model, tokenizer = load_model(build_tiny_model(small, tmp_path))
    assert train_warm_start(model, tokenizer, cfg, progress=False, until=10) == losses[:10]
    for bad in (0, 31):
        with pytest.raises(ValueError, match="until"):
            train_warm_start(model, tokenizer, cfg, progress=False, until=bad)
    model = AutoModelForCausalLM.from_pretrained(path)
    batch = pack_examples([encode_example(AutoTokenizer.from_pretrained(path), p, p.solution("steps"))
                           for p in ArithmeticTask().test_set(2)], 256, 0)
    assert torch.isfinite(packed_lm_loss(model, batch))


def test_a_warm_start_is_the_same_bit_for_bit_when_built_twice_on_one_machine(tmp_path):
    """Chaotic across CPUs (below), but reproducible on one: two builds here give the same weights."""
    from safetensors.torch import load_file

    small = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    cfg = WarmStartConfig(steps=20, batch_size=16, warmup_steps=5)
    first = load_file(warm_start(cfg, small, tmp_path / "a", progress=False) / "model.safetensors")
    second = load_file(warm_start(cfg, small, tmp_path / "b", progress=False) / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


# --------------------------------------------------------------------------------------------------
# The warm start shipped with the package
# --------------------------------------------------------------------------------------------------

#: A rebuilt warm start against the shipped one, on a CPU whose kernels differ from the recording one's. Measured
#: on an Intel CPU with AVX-512, rebuilt / shipped, under the Makefile's pins and unpinned: 50-step loss means within
#: 5% and 7% through step 450, then up to 1.25x and 1.20x; the last 100 steps' 1.21x and 1.16x; greedy accuracy
#: per level (200 problems, 21 on level 1) 0.86 and 0.95 / 0.86, 0.68 and 0.85 / 0.97, 0.54 and 0.59 / 0.77,
#: 0.29 and 0.35 / 0.40, 0.21 and 0.36 / 0.52; means 0.51 and 0.62 / 0.70. Not within the standard errors: a
#: different model (benchmarks/warm_start_rebuild.py; its results in benchmarks/results/warm_start_rebuild/).
#: The bounds below leave room for other CPUs and still fail a warm start that did not learn.
REBUILD_TRACKED_STEPS = 400
REBUILD_LOSS_TRACKS = 0.15
REBUILD_FINAL_LOSS_RATIO = 1.6
REBUILD_ACCURACY_RATIO = 0.5


def test_the_default_warm_start_is_the_shipped_copy(tmp_path):
    from safetensors.torch import load_file

    from dppo_core.warm_start import SHIPPED_WARM_START, shipped_warm_start_name, warm_start_name

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


#: the steps of the shipped recipe `make test` retrains (about 30 s on 2 cores); all 600 are `make test-rebuild`
REBUILD_START_STEPS = 50


@pytest.mark.numerics
def test_the_start_of_a_rebuild_follows_the_shipped_loss_curve(cache_dir):
    """The shipped recipe's first REBUILD_START_STEPS steps, from the same untrained model: on the recording CPU's
    kernels the very losses the shipped run logged (a change to the recipe, data, model or schedule that acts this
    early shows here: `python benchmarks/suite_probes.py prefix`), and on any CPU a curve within REBUILD_LOSS_TRACKS
    of it. What a contributor's `make test` checks in seconds; the 600
    steps and the weights bit for bit are the `rebuild` tests below (`make test-rebuild`, which CI runs)."""
    from dppo_core.numerics import fingerprint_mismatch
    from dppo_core.warm_start import SHIPPED_WARM_START, shipped_warm_start_name, train_warm_start, warm_start_name

    shipped = json.loads((SHIPPED_WARM_START / "warm_start_log.json").read_text())
    config = WarmStartConfig()
    assert warm_start_name(config) == shipped_warm_start_name()  # the default recipe is the shipped one
    model, tokenizer = load_model(build_tiny_model(TinyModelConfig(), cache_dir))
    ours = train_warm_start(model, tokenizer, config, progress=False, until=REBUILD_START_STEPS)
    recorded = shipped["loss"][:REBUILD_START_STEPS]
    assert len(ours) == REBUILD_START_STEPS
    ratio = sum(ours) / sum(recorded)
    assert abs(ratio - 1) <= REBUILD_LOSS_TRACKS, f"first {len(ours)} steps: loss {ratio:.3f}x the shipped run's"
    if not fingerprint_mismatch(shipped["kernels"]):
        assert ours == recorded, "on the recording CPU's kernels the first steps' losses differ from the shipped run's"


@pytest.fixture(scope="module")
def rebuilt_warm_start(tmp_path_factory):
    """`warm_start(force=True)`: the shipped configuration trained here from scratch (a few minutes on 2 CPU
    cores), once for the two tests below."""
    return warm_start(cache_dir=tmp_path_factory.mktemp("rebuilt"), force=True, progress=False)


def _greedy_accuracy(path, n_per_level):
    from dppo_core.evaluate import evaluate_task
    from dppo_core.rollout import HFRollout

    model, tokenizer = load_model(path)
    return evaluate_task(HFRollout(model, tokenizer), n_per_level=n_per_level).levels


@pytest.mark.rebuild
@pytest.mark.slow
def test_building_from_scratch_gives_a_model_that_learned_as_the_shipped_one(rebuilt_warm_start):
    """On any CPU. The warm start's 600 AdamW steps are chaotic in the last bits: another CPU's kernels round
    differently, Adam turns that into different weights from step 10 on, and the end of the run is a different
    model (measured: see REBUILD_*). What holds everywhere: the same tokenizer; a loss curve that tracks the
    shipped one through the first REBUILD_TRACKED_STEPS steps and ends near it; a model that answers the task
    (greedy accuracy, the mean over levels, at least REBUILD_ACCURACY_RATIO of the shipped model's)."""
    from dppo_core.numerics import kernel_fingerprint
    from dppo_core.warm_start import SHIPPED_WARM_START

    log = json.loads((rebuilt_warm_start / "warm_start_log.json").read_text())
    assert "source" not in log and log["kernels"] == kernel_fingerprint()  # trained here, and says where
    assert (rebuilt_warm_start / "tokenizer.json").read_text() == (SHIPPED_WARM_START / "tokenizer.json").read_text()
    ours, shipped = log["loss"], json.loads((SHIPPED_WARM_START / "warm_start_log.json").read_text())["loss"]
    assert len(ours) == len(shipped) == 600

    def mean(xs):
        return sum(xs) / len(xs)

    for start in range(0, REBUILD_TRACKED_STEPS, 50):
        ratio = mean(ours[start:start + 50]) / mean(shipped[start:start + 50])
        assert abs(ratio - 1) <= REBUILD_LOSS_TRACKS, f"steps {start}-{start + 49}: loss {ratio:.3f}x the shipped run's"
    final = mean(ours[-100:]) / mean(shipped[-100:])
    assert 1 / REBUILD_FINAL_LOSS_RATIO <= final <= REBUILD_FINAL_LOSS_RATIO, f"last 100 steps: loss {final:.3f}x"
    a, b = _greedy_accuracy(rebuilt_warm_start, 200), _greedy_accuracy(SHIPPED_WARM_START, 200)
    ours_mean, shipped_mean = mean([r.accuracy for r in a.values()]), mean([r.accuracy for r in b.values()])
    per_level = ", ".join(f"L{lvl} {a[lvl].accuracy:.3f}/{b[lvl].accuracy:.3f}" for lvl in a)
    assert ours_mean >= REBUILD_ACCURACY_RATIO * shipped_mean, f"greedy accuracy rebuilt/shipped: {per_level}"


@pytest.mark.rebuild
@pytest.mark.slow
def test_building_from_scratch_reproduces_the_shipped_weights_on_the_recording_cpu(rebuilt_warm_start):
    """Bit for bit, only where the kernel fingerprint is the one recorded with the shipped model (its vendor,
    PyTorch, vector kernels and the Makefile's pins); elsewhere it skips and says what differs and by how much."""
    from safetensors.torch import load_file

    from dppo_core.numerics import fingerprint_mismatch
    from dppo_core.warm_start import SHIPPED_WARM_START

    ours = load_file(rebuilt_warm_start / "model.safetensors")
    shipped = load_file(SHIPPED_WARM_START / "model.safetensors")
    assert ours.keys() == shipped.keys()
    diff = max((ours[k] - shipped[k]).abs().max().item() for k in ours)
    recorded = json.loads((SHIPPED_WARM_START / "warm_start_log.json").read_text())["kernels"]
    mismatch = fingerprint_mismatch(recorded)
    if mismatch:
        scale = max(shipped[k].abs().max().item() for k in shipped)
        pytest.skip(f"the shipped warm start was built with other kernels ({mismatch}): rebuilt here, its weights "
                    f"differ by at most {diff:.3g} (largest weight {scale:.3g}); its behaviour is checked above")
    assert diff == 0, f"rebuilt on the recording CPU's kernels, the weights differ by up to {diff:.3g}"


@pytest.mark.slow
def test_the_wheel_carries_the_shipped_warm_start(tmp_path):
    """What `pip install` (or Colab's install from git) gets: the package data of a built wheel."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from conftest import REPO_ROOT

    from dppo_core.warm_start import SHIPPED_FILES

    src = tmp_path / "src"  # a copy, so the build writes nothing into the checkout
    shutil.copytree(REPO_ROOT / "dppo_core", src / "dppo_core", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("dppo_core-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"dppo_core/assets/warm-start/{f}" for f in SHIPPED_FILES} <= names
