"""DPPOGRPOTrainer runs for tests/test_trl_multiprocess.py, in one process or as one of several under accelerate.

    python tests/trl_worker.py --model DIR --out DIR
    accelerate launch --multi_gpu --num_processes 2 tests/trl_worker.py --model DIR --out DIR

(``--multi_gpu`` starts the processes through torchrun; the runs are on CPU all the same, ``use_cpu=True``, so
they talk through gloo. ``accelerate launch --cpu`` would start one process, or several only through MPI.)

Every case of CASES trains on the same global generation batches whatever the number of processes: each
process gets 1/N of the per-device batch, and completions are a function of (generation batch, prompt,
position in its group) instead of sampled (sampling differs with how rows are split over processes). Each
process writes, per case, its final trainable parameters, TRL's log, the estimator's history and how many
rows it trained on (padding rows, weight 0, counted apart) to DIR/<case>-rank<r>.pt.
"""

from __future__ import annotations

import argparse
import os
import zlib
from pathlib import Path
from typing import Any

import torch
from trl import import_utils

# the generation here needs no vLLM, and importing it costs each process seconds
import_utils.is_vllm_available = lambda *args, **kwargs: False

ROWS = [{"id": f"q{i}", "prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(3)]


def char_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A deterministic reward with spread within groups (so advantages, and gradients, are not zero)."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


class FixedSelect:
    """An estimator mix-in: every generation batch keeps only its second prompt, with probability 0.5."""

    def select(self, candidate_ids: list[str], step: int, size: int | None = None) -> Any:
        from dppo_core.estimator import Selection

        return Selection([1], torch.tensor([0.5], dtype=torch.float64), len(candidate_ids))


def estimator(name: str, beta: float) -> Any:
    from dppo_core.estimator import DPPOEstimator, Estimator

    if name == "dppo":  # prompt and completion pruning; the history says which prompts to prune from step 2 on
        return DPPOEstimator(prompt_prune_rate=0.5, completion_prune_rate=0.5, min_prompt_keep_prob=0.3,
                             min_completion_keep_prob=0.3, beta=beta, seed=1)
    return type("FixedSelectEstimator", (FixedSelect, Estimator), {})()


#: name: (num_generations, rows of a global generation batch, steps_per_generation, estimator, GRPOConfig overrides)
CASES = {
    # G=4 and 6 rows a process: groups span two processes; completion pruning leaves the processes different counts
    "dppo-kl": (4, 12, 2, "dppo", {"beta": 0.04, "loss_type": "grpo"}),
    # G=3 and one prompt of two kept: 3 rows do not split over 2 processes, so a copy of the group fills the second
    "odd-group-lora": (3, 6, 1, "fixed", {"loss_type": "dr_grpo", "lora": True}),
    # for FSDP on CPU: without a reference model (TRL's FSDP reference differs from the policy there, pruned or not)
    "dppo": (4, 12, 2, "dppo", {"loss_type": "grpo"}),
}


def full(param: torch.Tensor) -> torch.Tensor:
    """A parameter whole (FSDP2 shards it: a DTensor, gathered from every process)."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def run_case(name: str, model_dir: str, out: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from dppo_core.integrations.trl import DPPOGRPOTrainer

    g, global_rows, steps_per_generation, estimator_name, overrides = CASES[name]
    overrides = dict(overrides)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    peft_config = None
    if overrides.pop("lora", False):
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = GRPOConfig(
        output_dir=str(out / name), seed=0, max_steps=2, num_generations=g, max_completion_length=6,
        per_device_train_batch_size=global_rows // (processes * steps_per_generation),
        gradient_accumulation_steps=steps_per_generation,  # one optimizer step per generation batch
        optim="sgd", learning_rate=0.5, max_grad_norm=0.0,  # an update linear in the gradient: comparable to 1e-5
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_pin_memory=False, model_init_kwargs={"dtype": "float32"}, **overrides)

    class Deterministic(DPPOGRPOTrainer):
        trained = {"rows": 0, "padding": 0}

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            offset = self.accelerator.process_index * len(prompt_ids)  # this process's slice of the kept rows
            completions = []
            for i, ids in enumerate(prompt_ids):
                key = f"{self.estimator_step}/{list(ids)}/{(offset + i) % num_generations}"
                gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                text = "".join(chr(48 + int(c)) for c in torch.randint(0, 40, (8,), generator=gen))
                length = int(torch.randint(1, self.max_completion_length, (1,), generator=gen))  # then the EOS
                completions.append(tokenizer.encode(text, add_special_tokens=False)[:length] + [tokenizer.eos_token_id])
            return completions, None

        def _compute_loss(self, model, inputs):
            weights = inputs.get("dppo_weights")
            if weights is not None:
                self.trained["rows"] += int((weights > 0).sum())
                self.trained["padding"] += int((weights == 0).sum())
            return super()._compute_loss(model, inputs)

    trainer = Deterministic(model=model_dir, reward_funcs=[char_reward], args=args,
                            train_dataset=Dataset.from_list(ROWS), processing_class=tokenizer,
                            estimator=estimator(estimator_name, args.beta), peft_config=peft_config)
    start = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    trainer.train()
    params = {k: full(v).detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    torch.save({"start": start, "params": params, "log": trainer.state.log_history, "trained": trainer.trained,
                "history": trainer.estimator.history.state_dict(), "estimator_step": trainer.estimator_step},
               out / f"{name}-rank{trainer.accelerator.process_index}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    for name in ns.cases:
        run_case(name, ns.model, ns.out)


if __name__ == "__main__":
    main()
