"""`dppo doctor --gpu` in its CPU mode: every check it can run here runs and passes, what needs CUDA says
SKIP and why, a broken path makes its check FAIL and the command exit 1. And the systems bench that shares
its step code (`dppo bench --preset gpu-systems`), run here on a tiny custom preset."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.shapes import SHAPES, build_shaped_model
from dppo_core.tools import cli, gpu_check, gpu_check_layouts
from dppo_core.tools.bench import BENCH_PRESETS, BenchError, BenchPreset, run_bench
from dppo_core.tools.bench.systems import synthetic_reward
from dppo_core.tools.doctor import Check
from dppo_core.tools.gpu_check import STEP_METHODS
from dppo_core.tools.gpu_check_layouts import FP32, packing_case

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode; on CUDA run `dppo doctor --gpu`")

LINE = re.compile(r"^\[(OK|INFO|WARN|FAIL|SKIP)\]\s+([^:]+): ")


@pytest.fixture(scope="module")
def shaped_dir(cache_dir):
    return build_shaped_model("tiny", cache_dir, dtype="float32")


def test_the_cpu_mode_runs_every_check_it_can_and_each_passes(cache_dir):
    env = {**os.environ, "DPPO_CACHE_DIR": str(cache_dir), "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, "-m", "dppo_core.tools.cli", "doctor", "--gpu", "--shape", "tiny"],
                          capture_output=True, text=True, timeout=900, env=env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "Traceback" not in out
    status = {m.group(2): m.group(1) for m in map(LINE.match, out.splitlines()) if m}
    # one line per check, OK or (CUDA only) SKIP; nothing else
    expected_ok = ["model", "packing (mask, sdpa)", "shared prefix (segment attention)", "lean decode step",
                   "rollout correction (hf)", "qlora",
                   *(f"step {m}" for m in STEP_METHODS)]
    expected_skip = ["cuda", "packing (varlen, flash_attention_2)", "packing (varlen, torch_varlen)"]
    try:
        import vllm  # noqa: F401

        expected_ok += ["vllm rollout correction", "vllm weight sync", "vllm adapter sync"]
        expected_skip += ["vllm sleep/wake"]
    except ImportError:
        expected_skip += ["vllm"]
    assert {k: status.get(k) for k in expected_ok} == dict.fromkeys(expected_ok, "OK"), out
    assert {k: status.get(k) for k in expected_skip} == dict.fromkeys(expected_skip, "SKIP"), out
    assert set(status) == set(expected_ok) | set(expected_skip), out
    # the numbers it promises are printed
    packing = next(x for x in out.splitlines() if x.startswith("[OK]   packing"))
    assert "boundary-crossing control" in packing and "gradient rel. diff" in packing
    assert all("peak resident memory" in x for x in out.splitlines() if x.startswith("[OK]   step "))
    correction = next(x for x in out.splitlines() if x.startswith("[OK]   rollout correction (hf)"))
    assert "max |log π − log μ|" in correction and "token weights mean" in correction and "truncated" in correction


def test_packing_check_passes_and_its_control_is_far_off(shaped_dir):
    c = gpu_check_layouts.check_packing(shaped_dir, torch.device("cpu"), attention="sdpa")
    assert c.status == "OK", c
    ratio = float(re.search(r"\(([0-9.e+]+)x\)", c.detail).group(1))
    assert ratio >= FP32.control_ratio


def test_lean_decode_check_passes_and_fails_on_a_wrong_step(shaped_dir, monkeypatch):
    from dppo_core.engines.lean_decode import LeanDecoder

    c = gpu_check_layouts.check_lean_decode(shaped_dir, torch.device("cpu"))
    assert c.status == "OK" and "bit for bit" in c.detail, c
    step = LeanDecoder.step
    monkeypatch.setattr(LeanDecoder, "step", lambda self, ids, pos: step(self, ids, pos) * (1 + 1e-6))
    c = gpu_check_layouts.check_lean_decode(shaped_dir, torch.device("cpu"))
    assert c.status == "FAIL" and "max |Δ logit|" in c.detail and "lean=False" in c.fix, c


def test_shared_prefix_check_passes_and_fails_when_completions_see_each_other(shaped_dir, monkeypatch):
    from dppo_core import shared_prefix

    c = gpu_check_layouts.check_shared_prefix(shaped_dir, torch.device("cpu"))
    assert c.status == "OK" and "other-prompt control" in c.detail, c
    real = shared_prefix.segment_plan

    def leaky(*a, **k):  # each completion's prompt part opened up to the whole segment: a broken plan
        plan = real(*a, **k)
        for blk in plan.blocks:
            blk.mask[..., plan.prompt_index.shape[1]:] = blk.valid[:, None, None, :]
        return plan

    monkeypatch.setattr(shared_prefix, "segment_plan", leaky)
    c = gpu_check_layouts.check_shared_prefix(shaped_dir, torch.device("cpu"))
    assert c.status == "FAIL" and "outside the tolerance" in c.detail, c


def test_packing_check_fails_when_packed_attention_crosses_boundaries(shaped_dir, monkeypatch):
    """A packer whose rows let tokens see the previous sequence: the check must say FAIL."""
    from dppo_core import packing

    real = packing.packed_completion_logprobs
    monkeypatch.setattr(packing, "packed_completion_logprobs",
                        lambda model, batch, **kw: real(model, gpu_check_layouts.boundary_crossing(batch), **kw))
    c = gpu_check_layouts.check_packing(shaped_dir, torch.device("cpu"), attention="sdpa")
    assert c.status == "FAIL" and "tolerance" in c.detail and c.fix, c


def test_packing_check_fails_without_a_control_that_differs(shaped_dir):
    """The control is part of the check: a control equal to the packed result (no boundary to cross) fails."""
    from dppo_core.models import load_model

    model, tok = load_model(shaped_dir)
    ok, numbers = packing_case(model, "mask", FP32, n=4, prompt=(3, 5), completion=(2, 4), pad_id=tok.pad_token_id)
    assert ok, numbers
    ok, numbers = packing_case(model, "mask", FP32, n=1, prompt=(3, 5), completion=(2, 4), pad_id=tok.pad_token_id)
    # one sequence per row: crossing changes nothing, so the check cannot tell, and says FAIL
    assert not ok and float(re.search(r"\(([0-9.e+]+)x\)", numbers).group(1)) < FP32.control_ratio, numbers


def test_a_failing_check_fails_the_command(monkeypatch, capsys):
    def fake(on_result=None, **kw):
        checks = [Check("qlora", "FAIL", "crashed (RuntimeError: no kernel)", "python -m bitsandbytes"),
                  Check("cuda", "SKIP", "no CUDA device")]
        for c in checks:
            on_result(c)
        return checks

    monkeypatch.setattr(gpu_check, "run_gpu_checks", fake)
    assert cli.main(["doctor", "--gpu"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] qlora: crashed" in out and "fix: python -m bitsandbytes" in out and "1 FAIL" in out


def test_a_crashing_step_is_a_fail_line_not_a_traceback(shaped_dir, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu_check, "train_steps", boom)
    (c,) = gpu_check.check_steps(shaped_dir, torch.device("cpu"), methods=("dppo",))
    assert (c.name, c.status) == ("step dppo", "FAIL") and "CUDA out of memory" in c.detail


def test_the_shaped_model_has_qwen3_layers_and_the_embedded_tokenizer(cache_dir):
    path = build_shaped_model("tiny", cache_dir, dtype="float32")
    assert build_shaped_model("tiny", cache_dir, dtype="float32") == path  # built once
    cfg = json.loads((path / "config.json").read_text())
    shape = SHAPES["tiny"]
    assert cfg["model_type"] == "qwen3" and cfg["hidden_size"] == shape.hidden_size
    assert cfg["num_hidden_layers"] == shape.num_hidden_layers and cfg["tie_word_embeddings"] is True
    big = SHAPES["qwen3-1.7b"]  # Qwen/Qwen3-1.7B's config.json
    assert (big.hidden_size, big.intermediate_size, big.num_hidden_layers, big.num_attention_heads,
            big.num_key_value_heads, big.head_dim) == (2048, 6144, 28, 16, 8, 128)
    with pytest.raises(ValueError, match="unknown model shape 'qwen9'.*qwen3-1.7b"):
        build_shaped_model("qwen9", cache_dir)


def test_the_synthetic_reward_gives_groups_with_signal_at_realistic_rates():
    prompts = [f"prompt {i}" for i in range(400)]
    rewards = torch.tensor([synthetic_reward([p] * 8, [f"completion {j}" for j in range(8)]) for p in prompts])
    assert rewards.tolist() == [synthetic_reward([p] * 8, [f"completion {j}" for j in range(8)]) for p in prompts]
    degenerate = (rewards.std(dim=1) == 0).float().mean().item()
    assert 0.15 < degenerate < 0.30, degenerate  # 2/9 in expectation for p uniform on [0, 1)
    assert 0.4 < rewards.mean().item() < 0.6


def test_attn_implementation_is_validated_and_auto_means_sdpa_on_cpu():
    from dppo_core.policy import attention_kernel

    assert attention_kernel("auto", torch.device("cpu")) == "sdpa"
    with pytest.raises(ConfigError, match="flash_attention_2 runs on CUDA only"):
        DPPOConfig(attn_implementation="flash_attention_2", device="cpu")
    with pytest.raises(ConfigError, match="attn_implementation='flash'.*choose one of auto, sdpa"):
        DPPOConfig(attn_implementation="flash")
    with pytest.raises(ConfigError, match="needs a CUDA device and the flash-attn package"):
        attention_kernel("flash_attention_2", torch.device("cpu"))


def test_the_gpu_systems_preset_refuses_a_cpu():
    with pytest.raises(BenchError, match="gpu-systems.*needs a CUDA GPU"):
        run_bench("gpu-systems", "unused")
    assert BENCH_PRESETS["gpu-systems"].kind == "systems"


def test_the_systems_bench_times_every_method_in_every_layout(tmp_path, cache_dir, monkeypatch):
    """The gpu-systems code path, on the CPU at tiny shapes: every run, its medians, the speedups, the table."""
    gpu = BENCH_PRESETS["gpu-systems"]
    tiny = BenchPreset("tiny-systems", "gpu-systems at tiny shapes", base=gpu.base, methods=gpu.methods,
                       overrides={**gpu.overrides, **gpu_check.step_overrides(torch.device("cpu"), "random:tiny"),
                                  "max_steps": 3},
                       method_overrides={m: {"max_tokens_per_row": 64} for m in gpu.methods}, kind="systems")
    monkeypatch.setenv("DPPO_CACHE_DIR", str(cache_dir))
    result = run_bench(tiny, tmp_path, command="test", log=lambda s: None)
    assert set(result["runs"]) == {f"{m}-{p}" for m in gpu.methods for p in ("padded", "packed", "shared")}
    for label, run in result["runs"].items():
        assert run["timed_steps"] == 1 and run["step_time_median"] > 0, label
        assert run["packing"] == (not label.endswith("padded")) and run["shared_prefix"] == label.endswith("shared")
        lines = (tmp_path / "runs" / label / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3
    assert result["speedup_vs"]["grpo-padded"]["grpo-padded"] == 1.0
    runs = result["runs"]
    assert all(0 < r["update_density_median"] <= 1 for r in runs.values())
    # grpo trains every completion; grpo_skip and dppo train fewer
    assert result["runs"]["grpo-padded"]["sequences_trained_median"] == 4 * 4
    assert result["runs"]["dppo-packed"]["sequences_trained_median"] < 16
    assert json.loads((tmp_path / "bench.json").read_text())["kind"] == "systems"
    assert "| dppo-packed |" in (tmp_path / "bench.md").read_text()
