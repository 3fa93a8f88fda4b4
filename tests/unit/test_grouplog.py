"""The persistence of all-equal groups (dppo_core.grouplog.persistence), on synthetic group logs whose answer is
counted by hand, and on a log written and read back."""

import random

import pytest
import torch

from dppo_core.grouplog import Persistence, group_record, persistence, read_groups
from dppo_core.run.disk import append_jsonl


def _line(step, groups):
    """A groups.jsonl line from {prompt id: rewards}."""
    ids = list(groups)
    rewards = torch.tensor([groups[i] for i in ids], dtype=torch.float32)
    return group_record(step, len(ids), ids, torch.ones(len(ids)), rewards, torch.ones_like(rewards, dtype=torch.long))


# three prompts over four steps (S all-solved, U all-unsolved, M mixed):
#   a: S S S M      b: U U U U      c: M S M (not rolled out at step 3)
LOG = [_line(1, {"a": [1, 1], "b": [0, 0], "c": [1, 0]}),
       _line(2, {"a": [1, 1], "b": [0, 0], "c": [1, 1]}),
       _line(3, {"a": [1, 1], "b": [0, 0]}),
       _line(4, {"a": [0, 1], "b": [0, 0], "c": [0, 1]})]


def test_persistence_of_a_hand_counted_log():
    p = persistence(LOG)
    assert isinstance(p, Persistence)
    assert (p.groups, p.prompts) == (11, 3)
    assert (p.all_solved, p.all_unsolved, p.all_equal_other, p.mixed) == (4, 4, 0, 3)
    # transitions (8): a S->S, S->S, S->M; b U->U x3; c M->S, S->M
    assert (p.after_equal, p.equal_after_equal) == (7, 5)
    assert (p.after_mixed, p.equal_after_mixed) == (1, 1)
    assert p.p_equal_after_equal == pytest.approx(5 / 7)
    assert p.p_equal_after_mixed == 1.0
    assert p.share_equal_with_equal_previous == pytest.approx(5 / 6)
    assert p.share_all_equal == pytest.approx(8 / 11)
    assert (p.prompts_always_solved, p.prompts_never_solved, p.prompts_between) == (0, 1, 2)
    d = p.to_dict()
    assert d["p_equal_after_equal"] == round(5 / 7, 4) and d["groups"] == 11 and d["prompts_between"] == 2


def test_a_filter_a_reward_scale_and_empty_denominators():
    only_b = persistence(LOG, keep=lambda i: i == "b")
    assert (only_b.groups, only_b.prompts_never_solved, only_b.after_mixed) == (4, 1, 0)
    assert only_b.p_equal_after_equal == 1.0 and only_b.p_equal_after_mixed is None
    # rewards of 2 (right) and 0.5 (wrong): what is all-solved follows the values given
    scaled = [_line(1, {"x": [2, 2], "y": [0.5, 0.5], "z": [1, 1]})]
    p = persistence(scaled, solved=2, unsolved=0.5)
    assert (p.all_solved, p.all_unsolved, p.all_equal_other, p.prompts_between) == (1, 1, 1, 1)
    assert persistence(scaled).all_solved == 1  # z, at the default 1
    empty = persistence([])
    assert (empty.groups, empty.share_all_equal, empty.share_equal_with_equal_previous) == (0, None, None)


def test_persistence_recovers_a_known_markov_chain(tmp_path):
    """Each prompt's groups follow a two-state chain: all-equal after all-equal with probability 0.9, after mixed 0.2;
    written as a groups.jsonl and read back, the estimates land within sampling error of the truth."""
    rng = random.Random(0)
    state = {f"q{i}": rng.random() < 0.5 for i in range(200)}
    path = tmp_path / "groups.jsonl"
    for step in range(1, 41):
        groups = {}
        for q, equal in state.items():
            groups[q] = [1, 1, 1, 1] if equal else [1, 0, 1, 0]
            state[q] = rng.random() < (0.9 if equal else 0.2)
        append_jsonl(path, _line(step, groups))
    p = persistence(read_groups(tmp_path))
    assert p.groups == 8000 and p.after_equal + p.after_mixed == 7800
    assert p.p_equal_after_equal == pytest.approx(0.9, abs=0.02)
    assert p.p_equal_after_mixed == pytest.approx(0.2, abs=0.02)
    # stationary share all-equal: 0.2 / (0.1 + 0.2) = 2/3; of the all-equal groups, 0.9 * 2/3 / (2/3) = 0.9 come after
    # an all-equal one
    assert p.share_all_equal == pytest.approx(2 / 3, abs=0.03)
    assert p.share_equal_with_equal_previous == pytest.approx(0.9 * (2 / 3) / (2 / 3), abs=0.02)
