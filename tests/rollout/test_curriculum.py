"""Adaptive task sampling: the tracker's shares, the weighted sampler, and the closed loop through the
real executor / rollout controller (groups consumed by the caller flow back as sampling weights)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from asyncwebrl.configtree import ConfigError
from asyncwebrl.records import RolloutGroup, StepSample, Trajectory, new_id
from asyncwebrl.rollout.config import RolloutConfig
from asyncwebrl.rollout.controller import RolloutController
from asyncwebrl.rollout.curriculum import TaskCurriculum, task_family, zero_advantage
from asyncwebrl.rollout.hosts import RolloutSpec
from asyncwebrl.web.config import EnvConfig, TaskSamplingConfig
from asyncwebrl.web.tasks import TaskSampler, make_task_sampler

TRUE_P = {"synthetic/always": 1.0, "synthetic/never": 0.0, "synthetic/half": 0.5, "synthetic/mostly": 0.8}


def _group(task_id: str, successes: list[bool]) -> RolloutGroup:
    trajs = [Trajectory(traj_id=new_id("t-"), task_id=task_id,
                        steps=[StepSample(prompt_ids=[1], output_ids=[2], behave_logprobs=[-0.1], versions=[0])],
                        reward=1.0 if s else 0.0, success=s) for s in successes]
    return RolloutGroup(group_id=new_id("g-"), task_id=task_id, trajectories=trajs)


def _adaptive(**kw) -> TaskSamplingConfig:
    return TaskSamplingConfig(mode="adaptive", **kw)


def test_productive_tasks_get_more_and_no_task_starves():
    cur = TaskCurriculum(TRUE_P, _adaptive(floor=0.2))
    rng = random.Random(0)
    for _ in range(30):
        cur.observe([_group(f"{t}#{rng.randrange(99)}", [rng.random() < p for _ in range(4)]) for t, p in TRUE_P.items()])
    share = cur.shares()
    assert sum(share.values()) == pytest.approx(1.0)
    # the task GRPO learns from (p = 0.5) gets the most, the solved and the hopeless ones the least
    assert share["synthetic/half"] > share["synthetic/mostly"] > share["synthetic/always"]
    assert share["synthetic/half"] > share["synthetic/never"]
    # ... but every task keeps at least the exploration floor
    assert min(share.values()) >= 0.2 / len(TRUE_P) - 1e-12
    # and a sampler driven by these weights still draws every task
    sampler = TaskSampler(list(TRUE_P), seed=5)
    sampler.set_weights(share)
    drawn = Counter(sampler.next().task_id for _ in range(4000))
    assert set(drawn) == set(TRUE_P)
    assert drawn["synthetic/half"] > 2 * drawn["synthetic/always"]
    assert drawn["synthetic/always"] / 4000 == pytest.approx(share["synthetic/always"], abs=0.03)


def test_a_new_task_gets_visits_before_known_ones():
    cur = TaskCurriculum(["a/x", "a/y"], _adaptive(min_groups=2))
    cur.observe([_group("a/x#1", [True, False])])
    # x has been seen once (below min_groups): still top priority, like the unseen y
    assert cur.shares()["a/x"] == pytest.approx(cur.shares()["a/y"])
    cur.observe([_group("a/x#2", [True, True, True, True])] * 3)
    assert cur.shares()["a/y"] > cur.shares()["a/x"]


def test_one_all_fail_group_does_not_send_a_task_to_the_floor():
    """A 0-of-4 group is common at true success 1/4; three in a row are not. The task stays in the zone
    after the first, and leaves it only after a streak (the hopeless task) -- likewise for all-success."""
    tasks = ["m/learnable", "m/half"]
    cur = TaskCurriculum(tasks, _adaptive(floor=0.2, prior_episodes=1.0))
    cur.observe([_group("m/learnable#1", [False] * 4), _group("m/half#1", [True, False, True, False])])
    share = cur.shares()
    assert share["m/learnable"] > 0.3  # the bare EMA (prior_episodes=0) gave 0.2 / 2 = 0.1
    bare = TaskCurriculum(tasks, _adaptive(floor=0.2, prior_episodes=0.0))
    bare.observe([_group("m/learnable#1", [False] * 4), _group("m/half#1", [True, False, True, False])])
    assert bare.shares()["m/learnable"] == pytest.approx(0.1)
    for i in range(2, 5):
        cur.observe([_group(f"m/learnable#{i}", [False] * 4)])
    assert cur.shares()["m/learnable"] == pytest.approx(0.1)  # a streak of failures: the floor
    assert cur.record().success["m/learnable"] < 0.05
    cur.observe([_group("m/learnable#9", [True, False, False, False])])
    assert cur.shares()["m/learnable"] > 0.1  # one success brings it back into the zone
    with pytest.raises(ValueError, match="prior_episodes"):
        TaskCurriculum(tasks, _adaptive(prior_episodes=-1.0))


def test_a_forgotten_task_is_relearnt_not_dropped_and_a_hopeless_one_never_is():
    """A task the policy had learnt and then un-learns gets the top priority while it is down; a task
    that never succeeded sits at the same low estimate yet keeps only the floor; and the boost ends
    after a bounded number of failing groups if the task does not come back."""
    tasks = ["m/forgotten", "m/hopeless", "m/half"]
    cur = TaskCurriculum(tasks, _adaptive(floor=0.2))
    off = TaskCurriculum(tasks, _adaptive(floor=0.2, relearn_drop=0.0))
    for c in (cur, off):
        for i in range(8):
            c.observe([_group(f"m/forgotten#{i}", [True, True, True, i % 2 == 0]),
                       _group(f"m/half#{i}", [True, False, True, False])])
    assert cur.record().relearning == 0  # learnt, not forgotten
    fails, boosted = 0, 0
    while cur.record().success["m/forgotten"] > 0.08:  # the policy un-learns it
        for c in (cur, off):
            c.observe([_group(f"m/forgotten#f{fails}", [False] * 4)])
        fails += 1
        assert fails < 20
    for i in range(fails + 8):
        for c in (cur, off):
            c.observe([_group(f"m/hopeless#{i}", [False] * 4)])
    p_forgotten, p_hopeless = (cur.record().success[t] for t in ("m/forgotten", "m/hopeless"))
    assert p_hopeless < p_forgotten < 0.08  # both low; only their histories differ
    assert cur.relearning("m/forgotten") and not cur.relearning("m/hopeless")
    assert cur.record().relearning == 1 and cur.record().flat()["relearning"] == 1.0
    share, plain = cur.shares(), off.shares()
    # the top priority, as much as a task at success 1/2; the hopeless one keeps the floor
    assert share["m/forgotten"] == pytest.approx(share["m/half"]) and share["m/half"] > 0.4
    assert share["m/hopeless"] == pytest.approx(0.2 / 3)
    assert share["m/forgotten"] > 1.5 * plain["m/forgotten"]  # without the rule it sinks to the floor
    back = TaskCurriculum(tasks, _adaptive(floor=0.2))  # the best estimate survives a checkpoint
    back.load_state_dict(cur.state_dict())
    assert back.shares() == share
    while cur.relearning("m/forgotten"):  # it does not come back: the boost runs out
        cur.observe([_group(f"m/forgotten#g{boosted}", [False] * 4)])
        boosted += 1
        assert boosted <= 10
    assert cur.shares()["m/forgotten"] < share["m/half"]
    cur.observe([_group("m/forgotten#back", [True, True, False, False])])
    assert not cur.relearning("m/forgotten")  # back in the zone: the ordinary p(1 - p) rule
    with pytest.raises(ValueError, match="relearn_drop"):
        TaskCurriculum(tasks, _adaptive(relearn_drop=1.5))


def test_progress_priority_follows_a_rising_task_not_one_at_chance():
    """Under priority=progress a task whose success climbs gets the groups, and one the policy solves
    at chance (a constant 1/4) gets less, where learnability ranks the two about alike. A task
    seen once has no trend yet: it gets as much as the task moving fastest."""
    tasks = ["m/rising", "m/chance", "m/never"]
    prog = TaskCurriculum(tasks + ["m/new"], _adaptive(floor=0.2, priority="progress"))
    learn = TaskCurriculum(tasks + ["m/new"], _adaptive(floor=0.2))
    rng = random.Random(3)
    for i in range(8):
        rising = min(1.0, 0.1 + 0.1 * i)  # 0.1 -> 0.8: the policy is learning it
        batch = [_group(f"m/rising#{i}", [rng.random() < rising for _ in range(4)]),
                 _group(f"m/chance#{i}", [rng.random() < 0.25 for _ in range(4)]),
                 _group(f"m/never#{i}", [False] * 4)]
        for c in (prog, learn):
            c.observe(batch)
    for c in (prog, learn):
        c.observe([_group("m/new#0", [True, False, False, False])])
    lp = prog.record().progress
    assert lp["m/rising"] > 2 * lp["m/chance"] and lp["m/never"] == 0.0
    share = prog.shares()
    assert sum(share.values()) == pytest.approx(1.0)
    # the unknown task as much as the mover, both well above the one at chance
    assert share["m/new"] == pytest.approx(share["m/rising"]) and share["m/rising"] > 1.5 * share["m/chance"]
    assert share["m/never"] == pytest.approx(0.2 / 4)  # no progress: the floor
    # learnability instead gives the task at chance nearly as much as the one being learnt
    assert learn.shares()["m/chance"] > 0.8 * learn.shares()["m/rising"]
    assert prog.record().flat()["progress.m/rising"] == pytest.approx(lp["m/rising"])
    back = TaskCurriculum(tasks + ["m/new"], _adaptive(floor=0.2, priority="progress"))
    back.load_state_dict(prog.state_dict())  # the slow rate survives a checkpoint
    assert back.shares() == share
    # once solved (about ten all-success groups) it leaves the zone and keeps the floor, though its
    # slow rate has not caught up yet
    solved = 0
    while prog.record().success["m/rising"] <= 0.95:
        prog.observe([_group(f"m/rising#p{solved}", [True] * 4)])
        solved += 1
    assert solved <= 12 and prog.record().progress["m/rising"] > lp["m/rising"]
    assert prog.shares()["m/rising"] == pytest.approx(0.2 / 4)
    with pytest.raises(ValueError, match="priority"):
        TaskCurriculum(tasks, _adaptive(priority="regret"))


def test_zone_priority_shares_evenly_inside_the_zone_and_cuts_the_rest():
    """Under priority=zone every task inside the productive zone gets the same share, whatever its
    success there (a task at 0.1 as much as one at 1/2, where learnability gives it about a third);
    a hopeless task and a solved one keep the floor; an unseen task counts as inside."""
    truth = {"z/low": 0.1, "z/half": 0.5, "z/never": 0.0, "z/always": 1.0}
    zone = TaskCurriculum([*truth, "z/new"], _adaptive(floor=0.2, priority="zone"))
    learn = TaskCurriculum([*truth, "z/new"], _adaptive(floor=0.2))
    for i in range(12):  # exact group counts: low succeeds once every two groups, half in two of four
        batch = [_group(f"z/low#{i}", [i % 2 == 0, False, False, False]),
                 _group(f"z/half#{i}", [True, True, False, False]),
                 _group(f"z/never#{i}", [False] * 4), _group(f"z/always#{i}", [True] * 4)]
        for c in (zone, learn):
            c.observe(batch)
    share = zone.shares()
    assert sum(share.values()) == pytest.approx(1.0)
    assert share["z/low"] == pytest.approx(share["z/half"]) == pytest.approx(share["z/new"])
    assert share["z/low"] == pytest.approx(0.2 / 5 + 0.8 / 3)
    assert share["z/never"] == pytest.approx(0.2 / 5) == pytest.approx(share["z/always"])
    assert learn.shares()["z/low"] < 0.75 * learn.shares()["z/half"]
    assert zone.record().in_zone == 2  # low and half (new has no estimate yet)


def test_uniform_mode_only_tracks():
    cur = TaskCurriculum(TRUE_P, TaskSamplingConfig())
    cur.observe([_group("synthetic/half#1", [True, False]), _group("synthetic/always#1", [True, True])])
    assert cur.weights() is None
    assert set(cur.shares().values()) == {0.25}
    rec = cur.record()
    assert rec.success["synthetic/half"] == 0.5 and rec.success["synthetic/never"] is None
    assert rec.groups["synthetic/always"] == 1
    # undiscounted successes per task, for "how long until the first success" in a run's metrics
    cur.observe([_group("synthetic/half#2", [True, True, False])])
    rec = cur.record()
    assert rec.wins == {"synthetic/always": 2, "synthetic/never": 0, "synthetic/half": 3, "synthetic/mostly": 0}
    assert rec.flat()["wins.synthetic/half"] == 3.0


def test_zero_advantage_groups_are_counted():
    cur = TaskCurriculum(TRUE_P, _adaptive())
    n = cur.observe([_group("synthetic/always#1", [True] * 4), _group("synthetic/half#1", [True, False, True, False]),
                     _group("synthetic/never#1", [False] * 4)])
    assert n == 2
    assert zero_advantage(_group("x#1", [False, False])) and not zero_advantage(_group("x#1", [True, False]))


def test_an_evaluation_prior_steers_the_first_choice_and_seeds_the_ema():
    tasks = ["miniwob/solved", "miniwob/half", "miniwob/never"]
    cur = TaskCurriculum(tasks, _adaptive(floor=0.2, ema_alpha=0.3, prior="eval"))
    assert len(set(cur.shares().values())) == 1  # nothing known: uniform
    assert cur.observe_eval({"miniwob/solved": 1.0, "miniwob/half": 0.5, "miniwob/never": 0.0, "miniwob/other": 0.5}) == 3
    share = cur.shares()
    # before any group is consumed the productive task already gets nearly everything
    assert share["miniwob/half"] == pytest.approx(0.2 / 3 + 0.8)
    assert share["miniwob/solved"] == pytest.approx(0.2 / 3) == share["miniwob/never"]
    assert cur.record().prior == {"miniwob/solved": 1.0, "miniwob/half": 0.5, "miniwob/never": 0.0}
    # the EMA starts from the prior, not from the first group alone
    cur.observe([_group("miniwob/never#3", [True, False, False, False])])
    assert cur.stats["miniwob/never"].success_ema == pytest.approx(0.7 * 0.0 + 0.3 * 0.25)
    # a later evaluation (of an older checkpoint than the trainer's groups) does not override them
    cur.observe_eval({"miniwob/never": 1.0, "miniwob/solved": 0.5})
    assert cur.stats["miniwob/never"].success_ema == pytest.approx(0.075)
    assert cur.stats["miniwob/solved"].prior == 0.5
    # the prior survives a checkpoint
    back = TaskCurriculum(tasks, _adaptive(floor=0.2, ema_alpha=0.3, prior="eval"))
    back.load_state_dict(cur.state_dict())
    assert back.shares() == cur.shares()
    # prior=none: the evaluation is ignored, unseen tasks keep top priority
    blind = TaskCurriculum(tasks, _adaptive(prior="none"))
    assert blind.observe_eval({"miniwob/solved": 1.0}) == 0 and len(set(blind.shares().values())) == 1


def test_state_round_trips_through_a_checkpoint_dict():
    import json

    cur = TaskCurriculum(TRUE_P, _adaptive())
    for t, p in TRUE_P.items():
        cur.observe([_group(t + "#0", [p >= 0.5, p > 0.9, p > 0.0, False])])
    state = json.loads(json.dumps(cur.state_dict()))  # what extra_state.json holds
    back = TaskCurriculum(TRUE_P, _adaptive())
    back.load_state_dict(state)
    assert back.shares() == cur.shares()
    assert back.record().groups == cur.record().groups
    with pytest.raises(ValueError, match="tasks"):
        back.load_state_dict({"mode": "adaptive"})


def test_sampler_rejects_bad_weights_and_is_deterministic():
    s = TaskSampler(["click-test", "click-button"], seed=1)
    with pytest.raises(ValueError, match="does not have"):
        s.set_weights({"miniwob/nope": 1.0})
    with pytest.raises(ValueError, match="positive"):
        s.set_weights({"miniwob/click-test": 0.0})
    w = {"miniwob/click-test": 0.9, "miniwob/click-button": 0.1}
    a, b = TaskSampler(["click-test", "click-button"], seed=1), TaskSampler(["click-test", "click-button"], seed=1)
    a.set_weights(w)
    b.set_weights(w)
    assert [a.next().group_key for _ in range(20)] == [b.next().group_key for _ in range(20)]
    a.set_weights(None)  # back to shuffled passes: every task once per pass
    assert {a.next().task_id for _ in range(2)} == {"miniwob/click-test", "miniwob/click-button"}


def test_weighted_draws_track_the_shares_as_closely_as_shuffled_passes():
    """What a run consumes per task is what the tracker asked for, not a lottery around it: independent
    weighted draws gave one task 1 group and another 12 of 48 at shares of 0.06-0.19 (2026-12-01)."""
    tasks = ["click-test", "click-test-2", "click-button", "click-link", "click-dialog", "click-dialog-2",
             "focus-text", "focus-text-2", "click-tab"]
    shares = [0.14, 0.19, 0.08, 0.08, 0.10, 0.09, 0.06, 0.12, 0.14]
    weights = {f"miniwob/{t}": w for t, w in zip(tasks, shares, strict=True)}
    for seed in range(20):
        hosts = [TaskSampler(tasks, seed=seed * 1_000_003 + h * 7919) for h in range(2)]
        for s in hosts:
            s.set_weights(weights)
        drawn: Counter = Counter()
        for n in (12, 12, 76):  # draws per host, cumulative 24, 48, 200 in all (the union is consumed)
            drawn.update(s.next().task_id for s in hosts for _ in range(n))
            total = sum(drawn.values())
            # independent draws: off by 3.9 (48 draws) and 8.3 (200) on average, by up to 7 and 19
            for t, w in zip(tasks, shares, strict=True):
                assert abs(drawn[f"miniwob/{t}"] - total * w) <= 4, (seed, total, t, drawn)
    # a task with weight 0 is never drawn, the others still in proportion
    s = TaskSampler(["click-test", "click-button", "click-link"], seed=3)
    s.set_weights({"miniwob/click-test": 0.75, "miniwob/click-button": 0.25, "miniwob/click-link": 0.0})
    drawn = Counter(s.next().task_id for _ in range(100))
    assert drawn["miniwob/click-link"] == 0 and abs(drawn["miniwob/click-test"] - 75) <= 2
    # resuming from the sampler state continues the same sequence
    a = TaskSampler(tasks, seed=9)
    a.set_weights(weights)
    [a.next() for _ in range(17)]
    b = TaskSampler(tasks, seed=0)
    b.load_state_dict(a.state_dict())
    b.set_weights(weights)
    assert [a.next().group_key for _ in range(10)] == [b.next().group_key for _ in range(10)]


def test_bad_config_is_rejected_at_load():
    from asyncwebrl.config import load_run_config

    with pytest.raises(ConfigError, match="floor"):
        load_run_config(None, ["env.task_sampling.floor=0"])
    with pytest.raises(ConfigError, match="mode"):
        load_run_config(None, ["env.task_sampling.mode=greedy"])
    cfg = load_run_config(None, ["env.task_sampling.mode=adaptive"])
    assert cfg.env.task_sampling.mode == "adaptive"


# ---- closed loop through the real executor and rollout controller ------------------------------------
class _BernoulliWorkflow:
    """A group of n episodes of `task`, each a success with the task's true probability (the episode
    itself is simulated; task choice, admission, executor, controller and feedback are the real code)."""

    def __init__(self, index: int, n: int):
        self.rng, self.n = random.Random(index), n

    async def __call__(self, task, version) -> RolloutGroup:
        await asyncio.sleep(0.002)
        g = _group(task.group_key, [self.rng.random() < TRUE_P[task.task_id] for _ in range(self.n)])
        for t in g.trajectories:
            t.steps[0].versions = [version()]
        return g


class _Spec:
    def __init__(self, env_cfg: EnvConfig):
        self.env_cfg = env_cfg

    def make_workflow(self, index, gate):
        return _BernoulliWorkflow(index, 4)

    def make_tasks(self, index):
        return make_task_sampler(self.env_cfg, seed=index)  # the production sampler of env.tasks


def _closed_loop(mode: str, steps: int = 40, batch: int = 4) -> tuple[Counter, int, TaskCurriculum]:
    env_cfg = EnvConfig(type="synthetic", tasks=",".join(t.split("/")[1] for t in TRUE_P),
                        task_sampling=TaskSamplingConfig(mode=mode, floor=0.2))
    cur = TaskCurriculum(make_task_sampler(env_cfg).task_ids, env_cfg.task_sampling)
    spec = _Spec(env_cfg)
    ctl = RolloutController.local(RolloutSpec(spec.make_workflow, spec.make_tasks),
                                  RolloutConfig(consumer_batch_size=batch, max_head_offpolicyness=1, workers=2),
                                  batch_timeout_s=30)
    ctl.start()
    consumed: Counter = Counter()
    zero = 0
    try:
        for _ in range(steps):
            groups = ctl.prepare_batch()
            zero += cur.observe(groups)
            if cur.adaptive:
                ctl.set_task_weights(cur.weights())
            consumed.update(task_family(g.task_id) for g in groups[: batch])
            ctl.update_weights(lambda: None)
    finally:
        ctl.shutdown()
    return consumed, zero, cur


def test_adaptive_sampling_through_the_rollout_controller_spends_groups_where_advantages_are_nonzero():
    uni, uni_zero, _ = _closed_loop("uniform")
    ada, ada_zero, cur = _closed_loop("adaptive")
    n = sum(ada.values())
    assert n == sum(uni.values()) == 160
    # every task was still visited; the p = 0.5 task got the largest share of consumed groups
    assert set(ada) == set(TRUE_P)
    assert ada.most_common(1)[0][0] == "synthetic/half"
    assert ada["synthetic/half"] > uni["synthetic/half"]
    # fewer wasted groups (all advantages zero) than uniform sampling on the same budget
    assert ada_zero < uni_zero
    assert cur.record().groups["synthetic/half"] == ada["synthetic/half"]


def test_a_failed_weight_push_is_counted_and_the_worker_keeps_rolling():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from rollout_sim import Tracker, sim_spec  # its task source takes no weights

    ctl = RolloutController.local(sim_spec(Tracker()), RolloutConfig(consumer_batch_size=1), batch_timeout_s=30)
    ctl.start()
    try:
        ctl.set_task_weights({"sim/w0": 1.0})
        assert ctl.task_weight_push_failures == 1
        assert len(ctl.prepare_batch()) == 1  # not marked dead: still delivers
    finally:
        ctl.shutdown()
