"""DPPOGRPOTrainer runs for tests/system/test_trl_multiprocess.py, in one process or as one of several under accelerate.

    python tests/helpers/trl_worker.py --model DIR --out DIR
    accelerate launch --multi_gpu --num_processes 2 tests/helpers/trl_worker.py --model DIR --out DIR

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

def rows(n: int) -> list[dict[str, str]]:
    """``n`` prompts of a toy dataset."""
    return [{"id": f"q{i}", "prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(n)]


def char_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A deterministic reward with spread within groups (so advantages, and gradients, are not zero)."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


class FixedSelect:
    """An estimator mix-in: every generation batch keeps only its second prompt, with probability 0.5."""

    def select(self, candidate_ids: list[str], step: int, size: int | None = None) -> Any:
        from dppo_core.estimator import Selection

        return Selection([1], torch.tensor([0.5], dtype=torch.float64), len(candidate_ids))


#: The generation batches (counted over the run) that EmptyAt empties: with 3 to an accumulation window, the first of
#: the first window, the middle of the second and the last of the third.
EMPTY = (0, 4, 8)


class EmptyAt:
    """An estimator mix-in: the generation batches of EMPTY keep nothing, by pruning every prompt (``what`` =
    "prompts") or every completion ("completions"); the others are the base estimator's."""

    what = "prompts"
    empty = EMPTY

    def select(self, candidate_ids: list[str], step: int, size: int | None = None) -> Any:
        from dppo_core.estimator import Selection

        if self.what == "prompts" and step in self.empty:
            return Selection([], torch.zeros(0, dtype=torch.float64), len(candidate_ids))
        return super().select(candidate_ids, step, size)

    def weigh(self, advantages: torch.Tensor, selection: Any = None, step: int = 0, **kwargs: Any) -> Any:
        from dppo_core.estimator import Weighting

        w = super().weigh(advantages, selection, step, **kwargs)
        if self.what == "completions" and step in self.empty:
            return Weighting(torch.zeros_like(w.keep), torch.zeros_like(w.weights), w.num_sequences)
        return w


def estimator(name: str, beta: float) -> Any:
    from dppo_core.estimator import DPPOEstimator, Estimator

    def dppo() -> DPPOEstimator:  # prompt and completion pruning; the history prunes prompts from step 2 on
        return DPPOEstimator(prompt_prune_rate=0.5, completion_prune_rate=0.5, min_prompt_keep_prob=0.3,
                             min_completion_keep_prob=0.3, beta=beta, seed=1)

    if name == "dppo":
        return dppo()
    if name.endswith("-dppo"):  # completion pruning; empty: the last batch of the first window, the first of the third
        kind = type("EmptyAtEstimator", (EmptyAt, DPPOEstimator), {"what": "completions", "empty": (1, 4)})
        return kind(completion_prune_rate=0.5, min_completion_keep_prob=0.3, beta=beta, seed=1)
    if name.startswith("empty-"):  # empty-prompts, empty-completions: of a plain (every row, weight 1) estimator
        return type("EmptyAtEstimator", (EmptyAt, Estimator), {"what": name.split("-")[1]})()
    return type("FixedSelectEstimator", (FixedSelect, Estimator), {})()


#: name: (num_generations, rows of a global generation batch, steps_per_generation, estimator, GRPOConfig overrides)
CASES = {
    # G=4 and 6 rows a process: groups span two processes; completion pruning leaves the processes different counts
    "dppo-kl": (4, 12, 2, "dppo", {"beta": 0.04, "loss_type": "grpo"}),
    # G=3 and one prompt of two kept: 3 rows do not split over 2 processes, so a copy of the group fills the second
    "odd-group-lora": (3, 6, 1, "fixed", {"loss_type": "dr_grpo", "lora": True}),
    # for FSDP on CPU: without a reference model (TRL's FSDP reference differs from the policy there, pruned or not)
    "dppo": (4, 12, 2, "dppo", {"loss_type": "grpo"}),
    # steps_per_generation 1 < gradient accumulation 3: three generation batches to a window, and the first, middle
    # and last of them (EMPTY) keep no prompt on any process (the drift: without a row the window's last backward
    # never reduces the gradients across processes)
    "empty-prompts": (4, 8, 1, "empty-prompts", {"loss_type": "grpo", "gradient_accumulation_steps": 3,
                                                 "max_steps": 3, "prompts": 6}),
    # the same with every completion of those batches pruned after the rewards
    "empty-completions": (4, 8, 1, "empty-completions", {"loss_type": "dr_grpo", "gradient_accumulation_steps": 3,
                                                         "max_steps": 3, "prompts": 6}),
    # a negative control: empty-completions on a wrong trainer (tests/helpers/mutants.py), whose processes must
    # drift apart
    "mutant-no-filler-when-empty": (4, 8, 1, "empty-completions", {"loss_type": "dr_grpo",
                                                                   "gradient_accumulation_steps": 3, "max_steps": 3,
                                                                   "prompts": 6}),
    # steps_per_generation 2 < accumulation 4, completion pruning: micro-batches mixing kept and padding rows, and
    # whole generation batches empty among them
    "empty-completions-dppo": (4, 12, 2, "empty-completions-dppo", {"loss_type": "grpo", "beta": 0.04,
                                                                    "gradient_accumulation_steps": 4,
                                                                    "max_steps": 3, "prompts": 6}),
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
    # (a dataset with fewer prompts than an accumulation window draws makes TRL's Trainer step early, on what it has)
    overrides = {"max_steps": 2, "gradient_accumulation_steps": steps_per_generation, "prompts": 3, **overrides}
    prompts = overrides.pop("prompts")
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    peft_config = None
    if overrides.pop("lora", False):
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = GRPOConfig(
        output_dir=str(out / name), seed=0, num_generations=g, max_completion_length=6,
        per_device_train_batch_size=global_rows // (processes * steps_per_generation),
        steps_per_generation=steps_per_generation,  # (gradient_accumulation_steps: the case's, default the same)
        optim="sgd", learning_rate=0.5, max_grad_norm=0.0,  # an update linear in the gradient: comparable to 1e-5
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_pin_memory=False, model_init_kwargs={"dtype": "float32"}, **overrides)

    base = DPPOGRPOTrainer
    if name.startswith("mutant-"):
        from mutants import trl_mutants  # tests/helpers/mutants.py, beside this file

        base = trl_mutants()[name.removeprefix("mutant-")]

    class Deterministic(base):  # type: ignore[valid-type,misc]
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
                            train_dataset=Dataset.from_list(rows(prompts)), processing_class=tokenizer,
                            estimator=estimator(estimator_name, args.beta), peft_config=peft_config)
    start = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    trainer.train()
    params = {k: full(v).detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    torch.save({"start": start, "params": params, "log": trainer.state.log_history, "trained": trainer.trained,
                "history": trainer.estimator.history.state_dict(), "estimator_step": trainer.estimator_step,
                "steps": args.max_steps,
                "generation_batches": args.max_steps * args.gradient_accumulation_steps // steps_per_generation},
               out / f"{name}-rank{trainer.accelerator.process_index}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cases", nargs="*", default=[c for c in CASES if not c.startswith("mutant-")])
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    for name in ns.cases:
        run_case(name, ns.model, ns.out)
    # Leave the process group before the interpreter exits: with the gloo group still alive, its C++ threads can
    # outlive Python's teardown and abort the process (SIGABRT, "terminate called without an active exception")
    # after a finished run (seen now and then in the FSDP2 case; docs/scaling.md).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
