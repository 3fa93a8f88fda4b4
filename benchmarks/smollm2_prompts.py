"""Which prompt SmolLM2-135M-Instruct answers level 3 of the embedded task under: greedy, 200 held-out problems.

    python benchmarks/smollm2_prompts.py [OUT]     (OUT: benchmarks/results/smollm2; about 5 minutes on 2 cores)

Three prompts, each the task's question ("What is 35+66? Put the final answer in \\boxed{}."): alone; after one
solved example in the tiny model's worked-steps form (``14+81: 14+80=94. 94+1=95. \\boxed{95}``); after the same
example as one equation (``14+81=95. \\boxed{95}``, what ``few_shot: 1`` gives). Scored by the training reward's
rule (dppo_core.rewards.math_rewards). Writes OUT/prompts.json: per prompt the accuracy, its standard error, the
share of answers with a \\boxed{} and three completions.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from dppo_core.data import few_shot_turns
from dppo_core.models import load_model
from dppo_core.pretrained import build_pretrained
from dppo_core.rewards import math_rewards
from dppo_core.rollout import HFRollout, SamplingConfig
from dppo_core.tasks import ArithmeticTask

PROBLEMS, MAX_TOKENS = 200, 32


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "benchmarks/results/smollm2")
    torch.set_num_threads(2)
    model, tokenizer = load_model(build_pretrained("smollm2-135m"))
    engine = HFRollout(model, tokenizer)
    problems = ArithmeticTask([3]).test(3, PROBLEMS)
    shot = few_shot_turns(1, [3])  # [user, assistant]: the example few_shot: 1 gives
    example = next(p for p in ArithmeticTask([3]).train(3) if p.prompt == shot[0]["content"])
    worked = [shot[0], {"role": "assistant", "content": example.solution("steps")}]  # the same, worked
    prompts = {"no example": [], "one worked-steps example": worked, "one equation example (few_shot: 1)": shot}
    results = {}
    for name, head in prompts.items():
        batch = engine.generate([head + p.messages() for p in problems], 1,
                                SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.0))
        texts = [g.completions[0].text for g in batch.groups]
        scores = math_rewards(texts, [str(p.answer) for p in problems])
        acc = sum(scores) / len(scores)
        results[name] = {"example": head[1]["content"] if head else None, "accuracy": acc,
                         "stderr": math.sqrt(acc * (1 - acc) / len(scores)),
                         "boxed_share": sum("\\boxed{" in t for t in texts) / len(texts),
                         "completions": [{"question": p.question, "answer": p.answer, "completion": t}
                                         for p, t in zip(problems[:3], texts, strict=False)]}
        print(f"{name:>36}: accuracy {acc:.3f} ± {results[name]['stderr']:.3f}, boxed "
              f"{results[name]['boxed_share']:.2f}", flush=True)
    (out / "prompts.json").write_text(json.dumps({"command": "python benchmarks/smollm2_prompts.py", "problems":
                                                  PROBLEMS, "max_tokens": MAX_TOKENS, "results": results},
                                                 indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
