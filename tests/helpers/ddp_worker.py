"""A training run for tests/system/test_distributed.py, in one process or as one rank of a torchrun job.

    python tests/helpers/ddp_worker.py --config CFG.json --rollouts R.pkl --record --out DIR   (one process)
    torchrun --nproc_per_node 2 tests/helpers/ddp_worker.py --config CFG.json --rollouts R.pkl --out DIR

With ``--record`` the completions are generated for real and saved, keyed by (step, call, position in the step's
kept list): with a pilot a step makes two calls, k completions for every kept prompt, then G - k for the continued
ones (call 1); without it they are replayed from that file, so a data-parallel job trains on exactly the global
batch the single process trained on (its ranks would otherwise sample other completions). Each rank writes its
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
from dppo_core.plans.pilot import Pilot
from dppo_core.rollout import RolloutBatch
from dppo_core.trainer import DPPOTrainer


def positions(engine, prompts) -> list[tuple[int, int, int]]:
    """The keys of a call's groups on this rank: (step, call, position in the step's kept list). The rank's share
    of the kept list is contiguous; a call after the pilot asks for the continued positions of that share, which
    ``spy_on_the_continue_draw`` noted."""
    trainer = engine.trainer
    call = 1 if engine.last_step == trainer.step else 0
    if call == 0:  # the step's selection, as train_step drew it (rank 0's: after the pilot the history has the
        engine.rows = trainer.last_selection.rows  # stopped groups, so a redraw would differ)
    engine.last_step, rows = trainer.step, engine.rows
    mine = shard(len(rows), trainer.dist)
    where = list(mine) if call == 0 else [j for j in engine.continued if j in mine]
    if [rows[j]["prompt"] for j in where] != list(prompts):
        raise RuntimeError("the prompts asked for are not this rank's share of the step's selection")
    return [(trainer.step, call, j) for j in where]


def spy_on_the_continue_draw(trainer, engine) -> None:
    """Notes the continued groups' positions of each step on ``engine`` (the call after the pilot asks for them)."""
    if not isinstance(trainer.plan, Pilot):  # no pilot: no continue draw to note
        return
    draw = trainer.plan.continue_groups

    def spied(run, selection, pilot_rewards, step, observe=True):
        continued, cont = draw(run, selection, pilot_rewards, step, observe)
        engine.continued = cont.positions
        return continued, cont

    trainer.plan.continue_groups = spied


class RecordingEngine:
    """The real engine, keeping every group it generates under (step, call, position)."""

    name = "recording"

    def __init__(self, engine, trainer):
        self.engine, self.trainer, self.groups, self.last_step, self.continued = engine, trainer, {}, None, []

    def generate(self, prompts, num_generations=1, sampling=None):
        keys = positions(self, prompts)
        batch = self.engine.generate(prompts, num_generations, sampling)
        self.groups.update(zip(keys, batch.groups, strict=True))
        return batch

    def sync(self, model):
        self.engine.sync(model)


class ReplayEngine:
    """Returns the recorded groups of the prompts asked for."""

    name = "replay"

    def __init__(self, groups, trainer):
        self.groups, self.trainer, self.last_step, self.continued = groups, trainer, None, []

    def generate(self, prompts, num_generations=1, sampling=None):
        return RolloutBatch([self.groups[key] for key in positions(self, prompts)])

    def sync(self, model):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--rollouts", type=Path, required=True)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--other-draws-on-rank-1", action="store_true",
                    help="rank 1's estimator draws from other random streams (seed + 1): only rank 0's draws, "
                         "broadcast, keep the job equal to one process")
    args = ap.parse_args()
    config = DPPOConfig(**json.loads(args.config.read_text()))
    trainer = DPPOTrainer(config, reward_funcs=[parity_reward], progress=False)
    if args.record:
        trainer.engine = RecordingEngine(trainer.make_engine(), trainer)
    else:
        trainer.engine = ReplayEngine(pickle.loads(args.rollouts.read_bytes()), trainer)
    spy_on_the_continue_draw(trainer, trainer.engine)
    if args.other_draws_on_rank_1 and trainer.dist.rank == 1:
        trainer.estimator.seed += 1
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
