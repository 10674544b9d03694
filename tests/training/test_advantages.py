"""GRPO advantages, per-step normalizers, failed trajectories, and sample building."""

from __future__ import annotations

import pytest

from asyncwebrl.pixelstore.store import InProcessPixelStore
from asyncwebrl.records import RolloutGroup, StepSample, Trajectory
from asyncwebrl.training.advantages import group_advantages, trajectory_advantages
from asyncwebrl.training.samples import fetch_pixels, micro_batches, samples_from_groups, shard_for_rank


def step(n_out=3, keys=()):
    return StepSample(prompt_ids=[1, 2, 3], output_ids=[7] * n_out, behave_logprobs=[-1.0] * n_out,
                      versions=[0] * n_out, pixel_keys=list(keys))


def traj(reward, n_steps=1, failed=False, tid="t"):
    return Trajectory(traj_id=f"{tid}-{reward}-{n_steps}-{failed}", task_id="task", steps=[step() for _ in range(n_steps)],
                      reward=reward, failed=failed)


def test_group_normalization_is_mean_zero_unit_std():
    a = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0])
    assert sum(a) == pytest.approx(0.0, abs=1e-9)
    assert (sum(x * x for x in a) / len(a)) ** 0.5 == pytest.approx(1.0, rel=1e-4)
    assert a[0] > 0 > a[1]


def test_equal_rewards_and_single_member_groups_give_zero_not_nan():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7]) == [0.0]
    assert group_advantages([]) == []


def test_no_std_norm_and_no_group_norm():
    assert group_advantages([1.0, 0.0], std_norm=False) == [0.5, -0.5]
    assert group_advantages([1.0, 0.0], group_norm=False) == [1.0, 0.0]


def test_failed_trajectories_are_excluded_from_samples_and_statistics():
    g = RolloutGroup("g", "task", [traj(1.0), traj(0.0), traj(1.0, failed=True)])
    out = trajectory_advantages(g)
    assert len(out) == 2
    assert [a for _, a in out] == pytest.approx([1.0, -1.0], rel=1e-4)  # the failed 1.0 does not shift the mean


@pytest.mark.parametrize("mode,expect", [("none", [1.0, -1.0]), ("episode_length", [1.0 / 4, -1.0 / 2]),
                                         ("constant", [1.0 / 10, -1.0 / 10])])
def test_every_step_carries_the_episode_advantage_times_the_normalizer(mode, expect):
    g = RolloutGroup("g", "task", [traj(1.0, n_steps=4), traj(0.0, n_steps=2)])
    samples = samples_from_groups([g], step_normalizer=mode, step_normalizer_k=10)
    assert len(samples) == 6
    assert [s.advantage for s in samples[:4]] == pytest.approx([expect[0]] * 4, rel=1e-4)
    assert [s.advantage for s in samples[4:]] == pytest.approx([expect[1]] * 2, rel=1e-4)


def test_malformed_step_is_a_clear_error():
    bad = traj(1.0)
    bad.steps[0].behave_logprobs = [-1.0]
    with pytest.raises(ValueError, match="behaviour logprobs"):
        samples_from_groups([RolloutGroup("g", "task", [bad, traj(0.0)])])


def test_wasted_steps_are_never_reinforced_by_a_lucky_episode():
    """A chance success after junk actions: with actor.wasted_steps_never_reinforced the invalid and
    the no-effect step carry at most 0, the click that ran keeps the episode's advantage; in the failed
    episode every step keeps its (negative) advantage. Off, every step carries the episode's."""
    lucky = Trajectory(traj_id="lucky", task_id="task", reward=0.8, steps=[step(), step(), step()])
    lucky.steps[0].invalid = True  # type into a button
    lucky.steps[1].no_effect = True  # typed what was already there
    failed = Trajectory(traj_id="failed", task_id="task", reward=-0.1, steps=[step(), step()])
    failed.steps[0].invalid = True
    g = RolloutGroup("g", "task", [lucky, failed])
    on = [s.advantage for s in samples_from_groups([g], wasted_steps_never_reinforced=True)]
    off = [s.advantage for s in samples_from_groups([g])]
    assert off == pytest.approx([1.0, 1.0, 1.0, -1.0, -1.0], rel=1e-4)
    assert on == pytest.approx([0.0, 0.0, 1.0, -1.0, -1.0], rel=1e-4)


def test_missing_pixels_are_dropped_and_counted_not_waited_for():
    store = InProcessPixelStore()
    k1, k2 = store.put_batch([b"png-a", b"png-b"])
    t = Trajectory(traj_id="x", task_id="task", reward=1.0, steps=[step(keys=[k1]), step(keys=[k1, k2])])
    samples = samples_from_groups([RolloutGroup("g", "task", [t, traj(0.0)])])
    store.free([k2])
    kept, pixels, dropped = fetch_pixels(samples, store)
    assert dropped == 1 and len(kept) == 2
    assert pixels[0] == [b"png-a"]


def test_shards_cover_every_sample_once_and_micro_batches_respect_the_budget():
    g = RolloutGroup("g", "task", [traj(float(i % 2), n_steps=i + 1) for i in range(5)])
    samples = samples_from_groups([g])
    for s, n in zip(samples, range(len(samples)), strict=False):
        s.output_ids = [7] * (1 + n % 4)
        s.behave_logprobs = [-1.0] * len(s.output_ids)
        s.versions = [0] * len(s.output_ids)
    shards = [shard_for_rank(samples, r, 3) for r in range(3)]
    assert sorted(id(s) for sh in shards for s in sh) == sorted(id(s) for s in samples)
    mbs = micro_batches(samples, max_tokens=16)
    assert sum(len(m) for m in mbs) == len(samples)
    for m in mbs:
        assert len(m) == 1 or max(s.n_tokens for s in m) * len(m) <= 16
