"""`bench clip` and `bench curriculum` aggregate their arms into bench/results/NAME.json: the training
runs are replaced by recorded arms here (the arms themselves are the production `run_training`)."""

from __future__ import annotations

import json

import pytest

import asyncwebrl.results as results_module
from asyncwebrl.bench.arms import ArmResult, EvalRow, StepRow


def _arm(name: str, seed: int, clip: float, coupled: float, eval_last: float, ok: float,
         shortcut: float | None = None, heldout_last: float | None = None) -> ArmResult:
    step = StepRow(step=1, version=1, time=5.0, success_rate=ok, n_trajectories=4, n_successes=4 * ok,
                   clip_rate=clip, clip_rate_coupled=coupled, n_tokens=50.0, n_groups=2, zero_adv_groups=1,
                   staleness_hist={"0": 1, "1": 1})
    return ArmResult(name=name, seed=seed, overrides=[], run_dir="", wall_s=10.0, setup_s=1.0, steps=[step],
                     evals=[EvalRow(version=0, success_rate=0.5, per_task={"t": 0.5},
                                    heldout_success_rate=None if heldout_last is None else 0.2),
                            EvalRow(version=1, success_rate=eval_last, per_task={"t": eval_last},
                                    heldout_success_rate=heldout_last)],
                     shortcut_baseline=shortcut, shortcut_policy=None if shortcut is None else "click [1]",
                     groups_by_task={"t": 2 * seed})


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(results_module, "RESULTS_DIR", tmp_path)
    return tmp_path


def test_clip_records_both_rates_per_eta_and_success_per_second(results, monkeypatch):
    from asyncwebrl.bench import clip

    calls = []

    def fake(name, overrides, fileroot, seed=1):
        calls.append((name, overrides))
        eta = next(int(o.split("=")[1]) for o in overrides if o.startswith("rollout.max_head_offpolicyness="))
        coupled = "actor.use_decoupled_loss=false" in overrides
        return _arm(name, seed, 0.1 * eta, 0.2 * eta, 0.6, 0.25 if coupled else 0.5)

    monkeypatch.setattr(clip, "run_arm", fake)
    assert clip.main([]) == 0
    doc = json.loads((results / "clip.json").read_text())
    f = doc["figures"]
    assert set(f["clip_by_eta"]) == {"1", "2", "4"} and "partial" not in f
    assert f["clip_by_eta"]["2"]["clip_rate_decoupled"] == pytest.approx(0.2)
    assert f["clip_by_eta"]["2"]["coupled_over_decoupled"] == pytest.approx(2.0)
    assert f["success_per_s_ratio_decoupled_over_coupled"] == pytest.approx(2.0)
    assert len(calls) == 4 and all("actor.ppo_n_minibatches=2" in o for _, o in calls)


def test_curriculum_records_seeds_arms_and_the_ratio(results, monkeypatch):
    from asyncwebrl.bench import curriculum

    calls = []

    def fake(name, overrides, fileroot, seed=1):
        calls.append(overrides)
        adaptive = "env.task_sampling.mode=adaptive" in overrides
        # held-out: adaptive ahead in seed 1, uniform in seed 2
        heldout = {(True, 1): 0.6, (False, 1): 0.3, (True, 2): 0.2, (False, 2): 0.4}[(adaptive, seed)]
        return _arm(name, seed, 0.0, 0.0, (0.8 if adaptive else 0.5) + 0.1 * seed, 0.5, shortcut=0.4,
                    heldout_last=heldout)

    monkeypatch.setattr(curriculum, "run_arm", fake)
    assert curriculum.main(["seeds=1,2", "steps=2"]) == 0
    # both arms start from the same warm start: the overrides differ only in the sampling mode
    warm = [sorted(o for o in ovs if o.startswith("warm_start.")) for ovs in calls]
    assert warm[0] and "warm_start.enabled=true" in warm[0] and all(w == warm[0] for w in warm)
    # ... and the sampling (the mode; the adaptive arm's priority)
    assert {tuple(o for o in ovs if not o.startswith("env.task_sampling.")) for ovs in calls} == \
        {tuple(o for o in calls[0] if not o.startswith("env.task_sampling."))}
    assert [o for o in calls[1] if o.startswith("env.task_sampling.")] == \
        ["env.task_sampling.mode=adaptive", "env.task_sampling.priority=learnability"]
    # the recipe's RL knobs in both arms, without dynamic sampling, which would drop the zero-signal groups
    # that adaptive sampling avoids drawing
    assert all("rollout.dynamic_sampling=false" in o and "gconfig.temperature=1.0" in o for o in calls)
    f = json.loads((results / "curriculum.json").read_text())["figures"]
    assert f["seeds"] == [1, 2]
    assert f["arms"]["uniform"]["eval_last_by_seed"] == {"1": pytest.approx(0.6), "2": pytest.approx(0.7)}
    assert f["adaptive_over_uniform"] == pytest.approx(((0.9 + 1.0) / 2) / ((0.6 + 0.7) / 2))
    assert f["eval_last_se_uniform"] == pytest.approx(0.05)  # stdev 0.0707 over two seeds / sqrt(2)
    # the shortcut baseline beside the ratio: an arm that only rose to `click [1]` has not learned to read
    assert f["shortcut_baseline"] == pytest.approx(0.4)
    assert f["gain_over_shortcut_uniform"] == pytest.approx((0.6 + 0.7) / 2 - 0.4)
    assert f["gain_over_shortcut_adaptive"] == pytest.approx((0.9 + 1.0) / 2 - 0.4)
    # per task, where the final figure comes from, and the groups each task got
    assert f["arms"]["uniform"]["per_task_last_mean"] == {"t": pytest.approx(0.65)}
    assert f["arms"]["uniform"]["per_task_first_mean"] == {"t": pytest.approx(0.5)}
    assert f["arms"]["adaptive"]["groups_by_task"] == {"t": pytest.approx(3.0)}
    assert f["arms"]["adaptive"]["runs"][0]["gain_over_shortcut"] == pytest.approx(0.9 - 0.4)
    # the held-out tasks beside the headline: the ratio of the means, and which arm led in each seed
    assert f["heldout_adaptive_over_uniform"] == pytest.approx(((0.6 + 0.2) / 2) / ((0.3 + 0.4) / 2))
    assert (f["heldout_seeds_adaptive_ahead"], f["heldout_seeds_uniform_ahead"]) == (1, 1)
    assert f["arms"]["uniform"]["heldout_first_mean"] == pytest.approx(0.2)
    assert f["arms"]["adaptive"]["heldout_last_by_seed"] == {"1": pytest.approx(0.6), "2": pytest.approx(0.2)}


def test_groups_to_first_success_reads_the_task_sampling_records():
    from asyncwebrl.bench.arms import groups_to_first_success

    def cur(step, groups, wins):
        return {"kind": "curriculum", "step": step, **{f"groups.{t}": float(g) for t, g in groups.items()},
                **{f"wins.{t}": float(w) for t, w in wins.items()}}

    recs = [cur(1, {"a": 1, "b": 1}, {"a": 0, "b": 0}), {"kind": "train", "step": 1},
            cur(2, {"a": 3, "b": 1}, {"a": 2, "b": 0}), cur(3, {"a": 4, "b": 2}, {"a": 2, "b": 0})]
    # a: its first success came in the step that brought it to 3 groups; b: none in the run
    assert groups_to_first_success(recs) == {"a": 3, "b": None}
    # runs recorded before the records counted wins: nothing, not a guess
    assert groups_to_first_success([{"kind": "curriculum", "groups.a": 2.0}]) == {}


def test_warmstart_keeps_the_shortcut_baseline_that_the_evaluation_measured():
    from asyncwebrl.bench.warmstart import EvalResult
    from asyncwebrl.evaluation.shortcut import ShortcutBaseline, shortcut_figures

    # the figures as evaluate_model returns them: each set with its shortcut entries
    figures = {"success_rate": 0.7, "n_episodes": 30, "invalid_rate": 0.0, "per_task": {"miniwob/click-tab": 0.7},
               **shortcut_figures(0.7, ShortcutBaseline(success_rate=0.4, policy="click [1]")),
               "heldout": {"success_rate": 0.6, "per_task": {},
                           **shortcut_figures(0.6, ShortcutBaseline(success_rate=0.5, policy="click [1]"))}}
    r = EvalResult.from_figures(figures, 1.0)
    assert (r.shortcut_baseline, r.shortcut_policy, r.heldout_shortcut_baseline) == (0.4, "click [1]", 0.5)
    bare = EvalResult.from_figures({k: v for k, v in figures.items() if "shortcut" not in k and k != "heldout"}, 1.0)
    assert bare.shortcut_baseline is None and bare.heldout_shortcut_baseline is None


def test_curriculum_reuse_adds_seeds_without_training_the_recorded_runs(results, monkeypatch, tmp_path):
    from asyncwebrl.bench import curriculum

    trained, seen = [], []

    def fake(name, overrides, fileroot, seed=1):
        trained.append((name, seed))
        seen.append(overrides)
        adaptive = "env.task_sampling.mode=adaptive" in overrides
        return _arm(name, seed, 0.0, 0.0, (0.8 if adaptive else 0.5) + 0.1 * seed, 0.5, shortcut=0.4)

    monkeypatch.setattr(curriculum, "run_arm", fake)
    assert curriculum.main(["seeds=1", "steps=2"]) == 0
    first = tmp_path / "first.json"
    first.write_text((results / "curriculum.json").read_text())
    trained.clear()
    assert curriculum.main(["seeds=1,2", "steps=2", f"reuse={first}"]) == 0
    assert trained == [("curriculum-uniform", 2), ("curriculum-adaptive", 2)]  # seed 1 came from the file
    f = json.loads((results / "curriculum.json").read_text())["figures"]
    assert f["seeds"] == [1, 2] and {(r["mode"], r["seed"]) for r in f["reused"]} == {("uniform", "1"), ("adaptive", "1")}
    assert f["arms"]["adaptive"]["eval_last_by_seed"] == {"1": pytest.approx(0.9), "2": pytest.approx(1.0)}
    assert f["adaptive_over_uniform"] == pytest.approx(((0.9 + 1.0) / 2) / ((0.6 + 0.7) / 2))
    # a file measured with other knobs is refused, naming the knob, and nothing is trained
    trained.clear()
    with pytest.raises(SystemExit, match="steps=2 there, 3 here"):
        curriculum.main(["seeds=1,2", "steps=3", f"reuse={first}"])
    assert trained == []
    # a file that predates the knob was evaluated greedily: greedy evaluation matches, sampled does not
    doc = json.loads(first.read_text())
    del doc["config"]["eval_temperature"]
    first.write_text(json.dumps(doc))
    assert curriculum.main(["seeds=1", "steps=2", "eval_temperature=0.0", f"reuse={first}"]) == 0 and trained == []
    with pytest.raises(SystemExit, match="eval_temperature=0.0 there, 1.0 here"):
        curriculum.main(["seeds=1", "steps=2", "eval_temperature=1.0", f"reuse={first}"])
    assert trained == []
    # another adaptive priority: the file's uniform run is reused, its adaptive one (sampled by
    # learnability, which the file predates) is trained again with the priority asked for
    assert curriculum.main(["seeds=1", "steps=2", "priority=progress", f"reuse={first}"]) == 0
    assert trained == [("curriculum-adaptive", 1)] and "env.task_sampling.priority=progress" in seen[-1]
    f = json.loads((results / "curriculum.json").read_text())
    assert f["config"]["priority"] == "progress"
    assert [(r["mode"], r["seed"]) for r in f["figures"]["reused"]] == [("uniform", "1")]
