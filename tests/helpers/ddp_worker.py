"""A training run for tests/system/test_distributed.py, in one process or as one rank of a torchrun job.

    python tests/helpers/ddp_worker.py --config CFG.json --rollouts R.pkl --record --out DIR   (one process)
    torchrun --nproc_per_node 2 tests/helpers/ddp_worker.py --config CFG.json --rollouts R.pkl --out DIR

With ``--record`` the completions are generated for real and saved, keyed by (step, position in the step's kept
list); without it they are replayed from that file, so a data-parallel job trains on exactly the global batch the
single process trained on (its ranks would otherwise sample other completions). Each rank writes its
final trainable weights and the step metrics to DIR.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import torch
from run_helpers import parity_reward  # tests/helpers/run_helpers.py, beside this file

from dppo_core.config import DPPOConfig
from dppo_core.distributed import shard
from dppo_core.rollout import RolloutBatch
from dppo_core.trainer import DPPOTrainer


class RecordingEngine:
    """The real engine, keeping every group it generates under (step, prompt)."""

    name = "recording"

    def __init__(self, engine, trainer):
        self.engine, self.trainer, self.groups = engine, trainer, {}

    def generate(self, prompts, num_generations=1, sampling=None):
        batch = self.engine.generate(prompts, num_generations, sampling)
        for i, g in enumerate(batch.groups):  # one process: the call holds the step's whole kept list
            self.groups[(self.trainer.step, i)] = g
        return batch

    def sync(self, model):
        self.engine.sync(model)


class ReplayEngine:
    """Returns the recorded groups of the prompts asked for."""

    name = "replay"

    def __init__(self, groups, trainer):
        self.groups, self.trainer = groups, trainer

    def generate(self, prompts, num_generations=1, sampling=None):
        # this rank's prompts are a contiguous share of the step's kept list: find their global positions
        rows = self.trainer.select_prompts(self.trainer.step).rows
        mine = shard(len(rows), self.trainer.dist)
        if [r["prompt"] for r in rows[mine.start : mine.stop]] != list(prompts):
            raise RuntimeError("the prompts asked for are not this rank's share of the step's selection")
        return RolloutBatch([self.groups[(self.trainer.step, i)] for i in mine])

    def sync(self, model):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--rollouts", type=Path, required=True)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    config = DPPOConfig(**json.loads(args.config.read_text()))
    trainer = DPPOTrainer(config, reward_funcs=[parity_reward], progress=False)
    if args.record:
        trainer.engine = RecordingEngine(trainer.make_engine(), trainer)
    else:
        trainer.engine = ReplayEngine(pickle.loads(args.rollouts.read_bytes()), trainer)
    trainer.engine.sync(trainer.model)
    records = [trainer.train_step() for _ in range(config.max_steps)]
    rank = trainer.dist.rank
    args.out.mkdir(parents=True, exist_ok=True)
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    torch.save(trainable, args.out / f"weights-rank{rank}.pt")
    (args.out / f"metrics-rank{rank}.json").write_text(json.dumps(records))
    (args.out / f"history-rank{rank}.json").write_text(json.dumps(trainer.history.state_dict(), sort_keys=True))
    if args.record:
        args.rollouts.write_bytes(pickle.dumps(trainer.engine.groups))
    from dppo_core.distributed import shutdown

    shutdown()


if __name__ == "__main__":
    main()
