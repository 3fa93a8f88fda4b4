"""The prompts a real model needs: a system prompt, solved examples, chat rows from a task file, and one answer rule
shared by the reward and the evaluation."""

import json

import pytest

from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.data import build_prompt_source, few_shot_turns, prompt_renderer, read_chat_rows
from dppo_core.evaluate import evaluate_policy, evaluate_task
from dppo_core.rewards import math_rewards
from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup
from dppo_core.tasks import ArithmeticTask, Problem


class EchoEngine:
    """A rollout engine that answers every prompt with one fixed text, and keeps the prompts it was sent."""

    def __init__(self, text_for):
        self.text_for, self.prompts = text_for, []

    def generate(self, prompts, num_generations, sampling):
        self.prompts.extend(prompts)
        return RolloutBatch([RolloutGroup(m, [], [Completion([], self.text_for(m), [], "stop")] * num_generations)
                             for m in prompts])


def test_few_shot_turns_are_fixed_solved_training_problems():
    turns = few_shot_turns(3, [3])
    assert turns == few_shot_turns(3, [3]) and len(turns) == 6
    assert [t["role"] for t in turns] == ["user", "assistant"] * 3
    task = ArithmeticTask([3])
    train = {p.prompt: p for p in task.train(3)}
    for user, assistant in zip(turns[::2], turns[1::2], strict=True):
        p = train[user["content"]]  # from the training split, never a held-out problem
        assert assistant["content"] == f"{p.question}={p.answer}. \\boxed{{{p.answer}}}" == p.solution("equation")
        assert math_rewards([assistant["content"]], [str(p.answer)]) == [1.0]
    assert few_shot_turns(1, [3]) == turns[:2]  # a shorter prompt is a prefix of a longer one


def test_the_renderer_puts_the_system_prompt_then_the_examples_before_the_row():
    question = [{"role": "user", "content": "What is 1+2?"}]
    assert prompt_renderer(DPPOConfig())(question) == question
    shots = few_shot_turns(1, [3])
    render = prompt_renderer(DPPOConfig(system_prompt="Be brief.", few_shot=1, train_levels=(3,)))
    assert render(question) == [{"role": "system", "content": "Be brief."}, *shots, *question]
    own = [{"role": "system", "content": "Mine."}, *question]
    assert render(own) == [own[0], *shots, *question]  # a row's own system message wins


def test_training_rows_and_evaluation_prompts_are_rendered_alike():
    config = DPPOConfig(system_prompt="Answer in a box.", few_shot=1, train_levels=(3,), eval_problems_per_level=4,
                        eval_samples=1)
    rows = build_prompt_source(config).rows
    head = prompt_renderer(config)([])
    assert all(r["prompt"][:-1] == head and r["prompt"][-1]["role"] == "user" for r in rows)
    assert rows[0]["id"].startswith("L3:")  # ids (the prompt history's keys) do not change
    engine = EchoEngine(lambda m: "\\boxed{0}")
    evaluate_policy(config, engine, step=0)
    assert engine.prompts and all(p[:-1] == head for p in engine.prompts)


@pytest.mark.parametrize("text,correct", [
    ("75+72=147. \\boxed{147}", 1.0),
    ("75 + 72 = 147\n#### 147", 1.0),  # GSM8K's form: the reward accepts it, so the evaluation does
    ("so the answer is 147.", 1.0),
    ("\\boxed{146}", 0.0),
    ("147", 0.0),  # a bare number is no answer, for the reward and the evaluation alike
])
def test_the_evaluation_reads_answers_by_the_rewards_rule(text, correct):
    p = Problem(3, "75+72", 147)
    ev = evaluate_task(EchoEngine(lambda m: text), [p])
    assert ev.levels[3].accuracy == correct == math_rewards([text], [str(p.answer)])[0]


def test_chat_rows_are_read_from_a_task_file(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
             "answer": "4", "id": "a"},
            {"prompt": [{"role": "user", "content": "3*3?"}, {"role": "assistant", "content": "\\boxed{9}"},
                        {"role": "user", "content": "4*4?"}], "answer": 16}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    read = read_chat_rows(path)
    assert [r["id"] for r in read] == ["a", "chat-1"] and [r["answer"] for r in read] == ["4", "16"]
    source = build_prompt_source(DPPOConfig(task=str(path), system_prompt="Default."))
    assert source.rows[0]["prompt"] == rows[0]["prompt"]  # its own system message kept
    assert source.rows[1]["prompt"][0] == {"role": "system", "content": "Default."}
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    assert read_chat_rows(plain) is None  # problem/answer rows: the benchmark reader's


@pytest.mark.parametrize("bad", [
    {"prompt": [], "answer": "1"},
    {"prompt": [{"role": "user", "content": "q"}]},
    {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"},
    {"prompt": [{"role": "bot", "content": "q"}], "answer": "1"},
    {"prompt": [{"role": "user", "content": 3}], "answer": "1"},
])
def test_a_bad_chat_row_names_the_file_and_line(tmp_path, bad):
    path = tmp_path / "chat.jsonl"
    good = {"prompt": [{"role": "user", "content": "q"}], "answer": "1"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ConfigError, match=r"chat\.jsonl:2: a chat row needs"):
        read_chat_rows(path)


@pytest.mark.parametrize("overrides,field", [
    ({"few_shot": -1}, "few_shot"),
    ({"few_shot": 1, "task": "gsm8k"}, "few_shot"),
    ({"system_prompt": "  "}, "system_prompt"),
    ({"cpu_threads": 0}, "cpu_threads"),
])
def test_prompt_and_thread_settings_are_checked(overrides, field):
    with pytest.raises(ConfigError, match=field):
        DPPOConfig(**overrides).validate()
