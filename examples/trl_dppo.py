"""DPPO inside Hugging Face TRL: ``DPPOGRPOTrainer`` is TRL's ``GRPOTrainer`` with an ``estimator=`` argument.

Each generation batch the estimator picks the prompts TRL rolls out (prompt pruning), then drops completions
and weights the kept ones 1/(pi_q p_qi) over the normaliser |B|·G of the whole candidate batch (completion
pruning); TRL does the rest. Embedded warm-started tiny model and arithmetic task, on CPU, a few steps
(importing TRL takes 10-15 s; then a few seconds a step). Needs TRL: ``pip install 'dppo-core[bench]'``.

    .venv/bin/python examples/trl_dppo.py [--steps N] [--output-dir DIR]

TRL's output directory is a temporary one unless ``--output-dir`` is given (nothing is checkpointed here).
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import warnings

# Two messages that say nothing about this example, filtered once here, before the imports that print them:
# TRL 1.16 warns that vLLM 0.32 is newer than the versions it tests, once per TRL module that checks (five times),
# though this example never uses vLLM (TRL generates with transformers here); and bitsandbytes' CPU backend logs
# that an optional 4-bit kernel package is missing, which only QLoRA would use. Other warnings still show.
warnings.filterwarnings("ignore", message=r"TRL currently supports vLLM versions", category=UserWarning)
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda record: "gemm_4bit_forward" not in record.msg)

from datasets import Dataset  # noqa: E402 - after the filters above
from transformers import AutoTokenizer  # noqa: E402
from transformers.trainer_callback import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from dppo_core.config import DPPOConfig  # noqa: E402
from dppo_core.estimator import make_estimator  # noqa: E402
from dppo_core.integrations.trl import DPPOGRPOTrainer  # noqa: E402
from dppo_core.rewards import accuracy_reward  # noqa: E402
from dppo_core.tasks import ArithmeticTask  # noqa: E402
from dppo_core.warm_start import warm_start  # noqa: E402

P, G = 4, 8  # prompts per generation batch, completions per prompt
CONFIG = DPPOConfig(pruning="dppo", prompt_prune_rate=0.5, completion_prune_rate=0.5, beta=0.0,
                    num_generations=G, prompts_per_step=P, seed=0)


class PrintSteps(TrainerCallback):
    """One line per optimizer step from TRL's logs (the ``dppo/*`` values are shares kept of those drawn)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step}  reward {logs.get('reward', float('nan')):.3f}  "
                  f"prompts kept {logs.get('dppo/prompts_kept', float('nan')):.2f}  "
                  f"completions kept {logs.get('dppo/completions_kept', float('nan')):.2f}  loss {logs['loss']:+.5f}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", default=None, help="TRL's output directory (default: a temporary one)")
    args = parser.parse_args()
    model_dir = str(warm_start(progress=False))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    # a small pool of problems, so prompts recur within a few steps and their history prunes them
    pool = ArithmeticTask(levels=(2, 3, 4)).sample_train(random.Random(CONFIG.seed), 2 * P)
    with tempfile.TemporaryDirectory(prefix="dppo-trl-") as tmp:
        grpo = GRPOConfig(output_dir=args.output_dir or tmp, seed=CONFIG.seed, max_steps=args.steps,
                          per_device_train_batch_size=G, gradient_accumulation_steps=P, num_generations=G,
                          max_completion_length=48, temperature=1.0, top_k=0, learning_rate=CONFIG.learning_rate,
                          loss_type="grpo", beta=CONFIG.beta, use_cpu=True, bf16=False,
                          model_init_kwargs={"dtype": "float32"}, report_to="none", save_strategy="no",
                          logging_steps=1, disable_tqdm=True, dataloader_pin_memory=False)
        trainer = DPPOGRPOTrainer(model=model_dir, reward_funcs=[accuracy_reward], args=grpo,
                                  train_dataset=Dataset.from_list([p.to_record() for p in pool]),
                                  processing_class=tokenizer, estimator=make_estimator(CONFIG))
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(PrintSteps())
        trainer.train()
    print(f"done: {trainer.state.global_step} steps, {trainer.estimator_step} generation batches, "
          f"{len(trainer.estimator.history)} prompts in the estimator's history")


if __name__ == "__main__":
    main()
