"""dppo_core.integrations.verl_trainer: DPPO's prompt draw on verl's v1 synchronous trainer, on CPU.

verl's real code runs where it can without Ray, TransferQueue servers or GPUs: its trainer registry and
constructor, its ``PPOTrainer._next_train_batch`` (the dataloader fetch, the uids, the TensorDict), its dataset
collate, its v1 advantage path (``compute_advantage_for_multi_trajectories`` and the registry), its policy loss.
Most tests build the trainer without ``__init__`` and give it the attributes those methods read (``init()``, which
starts the Ray workers and rollout servers, is never called).
"""

from __future__ import annotations

import copy
import functools
import json
import os

import numpy as np
import pytest
import torch

if os.environ.get("DPPO_REQUIRE_VERL_TRAINER"):  # make test-verl: a missing TransferQueue fails, never skips
    import transfer_queue  # noqa: F401
else:
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue: `make test-verl` has it")

from test_verl_integration import (  # noqa: E402
    DRAWS,
    REWARDS,
    T2_LIMIT,
    G,
    P,
    T,
    actor_config,
    base_estimator,
    fixed_rollouts,
    full_step,
    recipe_config,
)
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories  # noqa: E402
from verl.utils.dataset.rl_dataset import collate_fn  # noqa: E402

from dppo_core.config import DPPOConfig  # noqa: E402
from dppo_core.estimator import DPPOEstimator, make_estimator  # noqa: E402
from dppo_core.integrations import verl as dv  # noqa: E402
from dppo_core.integrations import verl_trainer as vt  # noqa: E402


@pytest.fixture(autouse=True)
def _no_installed_estimator():
    yield
    dv._INSTALLED.estimator = None
    dv._INSTALLED.selected = {}
    dv._INSTALLED.failed_groups = dv._INSTALLED.lost_groups = 0


def dataset(n: int = P) -> list[dict]:
    """Rows as verl's RLHFDataset returns them (agent-loop mode: the raw chat prompt, its index, reward info)."""
    return [{"raw_prompt": [{"role": "user", "content": f"question {q}"}], "index": q, "data_source": "toy",
             "reward_model": {"ground_truth": str(q)}, "extra_info": {"index": q}, "prompt": torch.tensor([q])}
            for q in range(n)]


@functools.cache
def small_config(*overrides: str):
    return recipe_config(f"data.train_batch_size={P}", f"actor_rollout_ref.rollout.n={G}", *overrides)


def trainer(step: int = 1, tmp_path=None, *overrides: str) -> vt.DPPOSyncTrainer:
    """The registered trainer class with what ``_next_train_batch`` and the checkpoint hooks read."""
    t = vt.DPPOSyncTrainer.__new__(vt.DPPOSyncTrainer)
    extra = (f"trainer.default_local_dir={tmp_path}",) if tmp_path is not None else ()
    t.config = small_config(*extra, *overrides)
    t.train_dataloader = StatefulDataLoader(dataset=dataset(), batch_size=P, collate_fn=collate_fn)
    t.train_dataloader_it = None
    t.global_steps = step
    return t


def test_registered_and_built_as_verls_sync_trainer_under_its_own_mode():
    """verl's registry returns it; verl's constructor, run for real, builds the sync trainer's replay buffer."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    assert get_trainer_cls(dv.TRAINER_MODE) is vt.DPPOSyncTrainer
    assert issubclass(vt.DPPOSyncTrainer, PPOTrainerSync)
    config = small_config()
    assert config.trainer.v1.trainer_mode == dv.TRAINER_MODE
    with pytest.raises(ValueError, match="estimator installed"):
        vt.DPPOSyncTrainer(config)
    dv.install(base_estimator(), group_size=G)
    t = vt.DPPOSyncTrainer(config)
    assert t.trainer_mode == "sync" and t.parameter_sync_step == 1  # verl's branches on the mode take sync's path
    assert type(t.replay_buffer) is ReplayBuffer and t.replay_buffer.trainer_mode == "sync"
    with pytest.raises(ValueError, match="dppo_sync"):
        t.trainer_mode = "separate_async"


def test_the_config_is_checked_when_the_trainer_is_built():
    dv.install(base_estimator(), group_size=G)
    for override, message in [("actor_rollout_ref.actor.ppo_mini_batch_size=2", "ppo_mini_batch_size"),
                              ("trainer.v1.sampler.custom_sampler.path=x.py", "custom_sampler"),
                              ("skip.rollout_tq.enable=true", "rollout_tq")]:
        with pytest.raises(ValueError, match=message):
            vt.DPPOSyncTrainer(small_config(override))


def test_a_rollout_n_other_than_the_installed_group_size_stops_the_build():
    """issue #52: with rollout.n != install's G every drawn group came back "failed" (dropped, every advantage 0) and
    the run went on with warnings. Built as verl's main_ppo builds it (its registry, then ``trainer_cls(config=...)``,
    before ``init()`` and any rollout), the trainer now refuses it, in either direction of the mismatch."""
    build = get_trainer_cls(dv.TRAINER_MODE)
    dv.install(base_estimator(), group_size=2 * G)
    with pytest.raises(ValueError, match=rf"rollout.n={G}, but the estimator was installed with group_size={2 * G}"):
        build(config=small_config())
    dv.install(base_estimator(), group_size=G)
    with pytest.raises(ValueError, match=rf"rollout.n={2 * G}, but the estimator was installed with group_size={G}"):
        build(config=small_config(f"actor_rollout_ref.rollout.n={2 * G}"))
    assert type(build(config=small_config())) is vt.DPPOSyncTrainer  # the same G on both sides builds


def test_next_train_batch_rolls_out_the_drawn_prompts():
    """verl's fetch of data.train_batch_size candidates, then exactly the estimator's draw at verl's global step."""
    for step in range(1, 30):
        est = base_estimator()
        dv.install(est, group_size=G)
        t = trainer(step)
        kept = t._next_train_batch()
        want = copy.deepcopy(base_estimator()).select([str(q) for q in range(P)], step, size=P)
        assert [int(i) for i in kept["index"]] == want.indices
        assert kept["prompt"][:, 0].tolist() == want.indices  # tensors and non-tensors stay aligned
        assert (t._dppo_candidates, t._dppo_kept) == (P, len(want.indices))
        recorded = dv._INSTALLED.selected
        assert sorted(recorded) == sorted(str(u) for u in kept["uid"])
        assert [recorded[str(u)] for u in kept["uid"]] == [(str(j), p) for j, p in zip(want.indices,
                                                                                        want.probs.tolist(),
                                                                                        strict=True)]
        assert dv._INSTALLED.window == P and dv._INSTALLED.selected_step == step
        dv._INSTALLED.selected = {}


def test_a_refill_is_rolled_out_whole():
    dv.install(base_estimator(), group_size=G)
    t = trainer(3)
    batch = t._next_train_batch(P)  # verl's refill of failed groups asks for a number of prompts
    assert len(batch) == P and all(p == 1.0 for _, p in dv._INSTALLED.selected.values())


def test_step_once_waits_for_the_kept_prompts(monkeypatch):
    seen = {}

    def verls_step_once(self, metrics, timing_raw, sample_batch_size):
        seen["size"] = sample_batch_size
        return "batch"

    monkeypatch.setattr(trainer_base.PPOTrainer, "_step_once", verls_step_once)
    t = trainer()
    t._dppo_candidates, t._dppo_kept = P, 3
    metrics: dict = {}
    assert t._step_once(metrics, {}, P) == "batch" and seen["size"] == 3
    assert metrics["dppo/prompts_rolled_out"] == 3 and metrics["dppo/prompt_keep_fraction"] == 0.75
    with pytest.raises(ValueError, match="parameter_sync_step"):
        t._step_once({}, {}, P // 2)


def rollout(kept, fixed) -> tuple[DataProto, list[str]]:
    """What verl's v1 trainer holds at its advantage step: G rows per kept prompt (its uid), shuffled, plus a
    group of verl's padding rows (uid ``pad…``, empty response, reward 0), and the rows' TransferQueue keys."""
    _, _, mask, _ = fixed
    q = torch.tensor([int(i) for i in kept["index"]]).repeat_interleave(G)
    i = torch.arange(len(q)) % G
    uids = np.array([str(u) for u in kept["uid"]], dtype=object).repeat(G)
    n_pad = 3
    response_mask = torch.cat([mask[q, i], torch.zeros(n_pad, T, dtype=torch.long)])
    response_mask[len(q):, 0] = 0
    scores = torch.zeros(len(q) + n_pad, T)
    scores[torch.arange(len(q)), mask[q, i].sum(-1) - 1] = REWARDS[q, i]
    prompt = torch.cat([q, torch.full((n_pad,), -1)])
    completion = torch.cat([i, torch.zeros(n_pad, dtype=torch.long)])
    uid = np.concatenate([uids, np.array(["pad0"] * n_pad, dtype=object)])
    perm = torch.randperm(len(uid), generator=torch.Generator().manual_seed(len(q)))
    data = DataProto.from_dict({"token_level_rewards": scores[perm], "response_mask": response_mask[perm],
                                "prompt": prompt[perm], "completion": completion[perm]},
                               non_tensors={"uid": uid[perm.numpy()]})
    keys = [f"{u}_0_0" for u in data.non_tensor_batch["uid"]]
    return data, keys


def one_trainer_step(step: int, fixed, estimator: DPPOEstimator) -> tuple[float, torch.Tensor, DataProto]:
    """verl's v1 flow through the DPPO trainer: candidates, the draw, rollout, verl's v1 advantage path with the
    registered estimator, the registered loss with C = P·G; the loss and its gradient at θ = 0."""
    old, x, _, policy = fixed
    dv.install(estimator, group_size=G)
    kept = trainer(step)._next_train_batch()
    data, keys = rollout(kept, fixed)
    data = compute_advantage_for_multi_trajectories(data, keys, dv.ADV_ESTIMATOR, num_repeat=G,
                                                    config={"norm_adv_by_std_in_grpo": True})
    real = data.batch["prompt"] >= 0
    q, i = data.batch["prompt"][real], data.batch["completion"][real]
    adv = data.batch["advantages"][real].double()
    assert (data.batch["advantages"][~real] == 0).all()
    logp = policy(old[q, i], x[q, i])
    loss, _ = core_algos.get_policy_loss_fn(dv.POLICY_LOSS)(old[q, i], logp, adv, data.batch["response_mask"][real],
                                                            "seq-mean-token-mean", actor_config(P * G))
    (grad,) = torch.autograd.grad(loss, policy.linear.weight)
    return loss.item(), grad.flatten(), data


def test_the_advantage_step_weighs_the_drawn_groups_and_updates_the_history():
    fixed = fixed_rollouts(7)
    for step in range(1, 20):
        est = base_estimator()
        _, _, data = one_trainer_step(step, fixed, est)
        assert dv._INSTALLED.selected == {}  # every drawn group weighed once
        kept_prompts = {int(p) for p in data.batch["prompt"].tolist() if p >= 0}
        seen = {pid for pid, rec in est.history.records.items() if rec.step == step}
        assert seen == {str(p) for p in kept_prompts}, (seen, kept_prompts)


def trainer_monte_carlo(monkeypatch, prompt_weight_error: float = 1.0) -> float:
    """Hotelling's T² of the mean loss and gradient at θ = 0 over DRAWS trainer steps against full-batch GRPO.
    ``prompt_weight_error`` divides every recorded π_q < 1 (the companion check)."""
    if prompt_weight_error != 1.0:
        select = dv.select_prompt_rows

        def wrong_probs(batch, step, **kwargs):
            out = select(batch, step, **kwargs)
            for uid, (pid, p) in list(dv._INSTALLED.selected.items()):
                dv._INSTALLED.selected[uid] = (pid, p / prompt_weight_error if p < 1 else p)
            return out

        monkeypatch.setattr(dv, "select_prompt_rows", wrong_probs)
    fixed = fixed_rollouts(5)
    base = base_estimator()
    draws = [one_trainer_step(step, fixed, copy.deepcopy(base))[:2] for step in range(1, DRAWS + 1)]
    values = torch.tensor([[loss, *grad.tolist()] for loss, grad in draws], dtype=torch.float64)
    full_loss, full_grad = full_step(fixed)
    d = values.mean(0) - torch.tensor([full_loss, *full_grad.tolist()], dtype=torch.float64)
    return float(DRAWS * d @ torch.linalg.solve(torch.cov(values.T), d))


def test_pruned_loss_and_gradient_through_the_trainer_are_unbiased(monkeypatch):
    """Seeded Monte Carlo over 3000 draws through the trainer's methods (prompt and completion pruning, each draw a
    function of verl's global step): the mean of the loss and its gradient at θ = 0 matches full-batch GRPO with
    verl's GRPO advantage and vanilla loss, Hotelling's T² below chi-square(4)'s 0.999 quantile (measured: 4.8)."""
    fixed = fixed_rollouts(5)
    sizes = [len(one_trainer_step(s, fixed, base_estimator())[2]) for s in range(1, 50)]
    assert min(sizes) < P * G + 3, "no step pruned a prompt"
    assert trainer_monte_carlo(monkeypatch) < T2_LIMIT


def test_the_trainer_check_catches_a_ten_percent_error_in_the_prompt_weights(monkeypatch):
    """Companion: every π_q < 1 recorded 1.1 times too small (its weight 1/π_q 10% too large) puts T² above the
    same limit (measured: 32)."""
    assert trainer_monte_carlo(monkeypatch, prompt_weight_error=1.10) > T2_LIMIT


def test_the_prompt_history_is_checkpointed_beside_verls(monkeypatch, tmp_path):
    path = tmp_path / "global_step_12" / vt.HISTORY_FILE
    found_by_verls_save = []
    monkeypatch.setattr(trainer_base.PPOTrainer, "_save_checkpoint",
                        lambda self: found_by_verls_save.append(path.exists()))
    est = base_estimator()
    dv.install(est, group_size=G)
    t = trainer(12, tmp_path)
    t._save_checkpoint()
    assert found_by_verls_save == [True]  # written before verl marks the folder as its latest checkpoint
    assert json.loads(path.read_text()) == est.state_dict()
    assert not list(path.parent.glob("*.tmp"))

    fresh = DPPOEstimator(seed=0, prompt_prune_rate=0.5)
    dv.install(fresh, group_size=G)

    def verls_load(self):
        self.global_steps = 12  # what verl's _load_checkpoint sets from the folder's name

    monkeypatch.setattr(trainer_base.PPOTrainer, "_load_checkpoint", verls_load)
    t = trainer(0, tmp_path, "trainer.resume_mode=auto")
    t._load_checkpoint()
    assert fresh.history.state_dict() == est.history.state_dict()


def test_a_group_with_failed_sessions_is_dropped_and_counted():
    """verl keeps a group some of whose sessions failed: it is dropped whole (factor 0), warned about and counted;
    the other groups are weighed as usual, and the groups that never came back are counted at the next draw."""
    fixed = fixed_rollouts(9)
    est = base_estimator(completion_prune_rate=0.0)
    dv.install(est, group_size=G)
    kept = trainer(2)._next_train_batch()
    assert len(kept) >= 2, "the test needs two drawn prompts at this step"
    data, keys = rollout(kept, fixed)
    uids = data.non_tensor_batch["uid"]
    short, gone = str(kept["uid"][0]), str(kept["uid"][-1])
    first_short = int(np.flatnonzero(uids == short)[0])
    keep = [r for r in range(len(data)) if r != first_short and uids[r] != gone]
    data = data.select_idxs(torch.tensor(keep))
    with pytest.warns(UserWarning, match="came back with \\[3\\] completions"):
        data = compute_advantage_for_multi_trajectories(data, [keys[r] for r in keep], dv.ADV_ESTIMATOR, num_repeat=G,
                                                        config={"norm_adv_by_std_in_grpo": True})
    uids = data.non_tensor_batch["uid"]
    assert (data.batch["advantages"][uids == short] == 0).all()
    assert dv._INSTALLED.failed_groups == 1 and short not in dv._INSTALLED.selected
    assert str(kept["index"][0]) not in {p for p, r in est.history.records.items() if r.step == 2}
    assert list(dv._INSTALLED.selected) == [gone]
    with pytest.warns(UserWarning, match="1 prompt groups drawn before step 3 never came back"):
        trainer(3)._next_train_batch()
    assert dv._INSTALLED.lost_groups == 1 and gone not in dv._INSTALLED.selected


def test_stock_trainer_refuses_prompt_pruning():
    """With trainer_mode sync no prompt is drawn before rollout: check_config and the advantage step refuse."""
    est = base_estimator()
    with pytest.raises(ValueError, match="trainer_mode"):
        dv.check_config(recipe_config("trainer.v1.trainer_mode=sync"), est)
    assert dv.check_config(recipe_config(), est) == 256 * 8
    dv.install(est, group_size=G)
    uid = np.array([f"u{k // G}" for k in range(P * G)], dtype=object)
    scores = torch.zeros(P * G, T)
    scores[:, 0] = REWARDS.flatten()
    batch = DataProto.from_dict({"token_level_rewards": scores, "response_mask": torch.ones(P * G, T)},
                                non_tensors={"uid": uid})
    with pytest.raises(ValueError, match="dppo_sync"):
        compute_advantage_for_multi_trajectories(batch, [f"{u}_0_0" for u in uid], dv.ADV_ESTIMATOR, num_repeat=G)


def test_dense_prompts_a_pilot_and_an_empty_draw_are_refused():
    with pytest.raises(ValueError, match="dense_prompts"):
        dv.install(DPPOEstimator(prompt_prune_rate=0.5, dense_prompts=True), group_size=G)
    with pytest.raises(ValueError, match="rollout_plan pilot on verl"):  # verl generates a group in one call
        dv.install(make_estimator(DPPOConfig(pruning="dppo", pilot_size=2)), group_size=G)
    est = DPPOEstimator(seed=0, prompt_prune_rate=0.9, min_prompt_keep_prob=0.05, prompt_scheme="posterior")
    for seen in range(5):  # every group all right, five times: every π at the rate's floor (0.1)
        est.observe([str(q) for q in range(P)], torch.ones(P, G), torch.zeros(P, G), step=seen)
    dv.install(est, group_size=G)
    with pytest.raises(RuntimeError, match="drew none"):
        for step in range(5, 200):  # none of 4 drawn at π = 0.1: 66% of the steps
            trainer(step)._next_train_batch()
            dv._INSTALLED.selected = {}


def test_the_recipes_plugin_passes_its_own_preflight():
    """The launch recipe's pre-flight, as a user runs it: the plugin registers the loss, the estimator and the
    trainer, installs a prompt-pruning estimator, and validates the recipe's config with verl's and our rules."""
    import os
    import subprocess
    import sys

    from test_verl_integration import RECIPE

    env = {**os.environ, "DPPO_GROUP_SIZE": "8"}
    args = [sys.executable, str(RECIPE / "dppo_plugin.py"), "actor_rollout_ref.model.path=tiny-model",
            "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verl config ok for DPPO: C = train_batch_size x n = 2048" in proc.stdout
    refused = subprocess.run([*args, "trainer.v1.trainer_mode=sync"], capture_output=True, text=True, timeout=300,
                             env=env)
    assert refused.returncode != 0 and "dppo_sync" in refused.stderr, refused.stderr[-3000:]
    mismatch = subprocess.run([*args, "actor_rollout_ref.rollout.n=4"], capture_output=True, text=True, timeout=300,
                              env=env)  # DPPO_GROUP_SIZE=8 installed, 4 launched: refused by check_config
    assert mismatch.returncode != 0 and "installed with group_size=8" in mismatch.stderr, mismatch.stderr[-3000:]


def test_a_candidate_batch_without_distinct_prompt_ids_is_refused():
    """The same rule as select_prompts on a DataProto: the history needs a distinct id per prompt."""
    from verl.utils import tensordict_utils as tu

    dv.install(base_estimator(), group_size=G)
    rows = collate_fn(dataset())
    rows["uid"] = np.array([f"u{q}" for q in range(P)], dtype=object)
    with pytest.raises(ValueError, match="no column 'prompt_id'"):
        dv.select_prompt_rows(tu.get_tensordict(rows), step=1, id_key="prompt_id")
    rows["index"] = np.zeros(P, dtype=np.int64)
    with pytest.raises(ValueError, match="repeat within one batch"):
        dv.select_prompt_rows(tu.get_tensordict(rows), step=1)
