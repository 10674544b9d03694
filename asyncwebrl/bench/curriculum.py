"""`asyncwebrl bench curriculum`: uniform vs adaptive task sampling on the same budget (issue 19).

Each arm (env.task_sampling.mode = uniform | adaptive) is trained once per seed with the same config,
steps, batch and learning rate, through the production `asyncwebrl train` path; the test-rollout group
evaluates the checkpoints on the fixed evaluation set of the training tasks, greedily unless
`eval_temperature` > 0 (pass
`extra=env.task_sampling.prior=eval` to start the adaptive tracker from that evaluation). Recorded per arm
and seed: first and final eval success, the share of consumed groups whose advantages were all zero
(wasted rollout), and the final per-task sampling shares, and the shortcut baseline (the best constant answer on the same
evaluation episodes) with each arm's gain over it. Headline: `adaptive_over_uniform` = mean
final greedy eval success of the adaptive arm over that of the uniform arm. Beside it, the same ratio on
the held-out tasks that neither arm trains on (`heldout_adaptive_over_uniform`) and the seeds in which
each arm ended ahead there.

The default form is the multi-step recipe (`make train-multistep`) on a pool that mixes what it learns
with what it cannot: both arms start from the recipe's light behaviour-cloning warm start
(`warm_start_demos` oracle demonstrations per task of `warm_start_tasks`, two passes, seeded alike in
both arms; the other tasks get none), then train with the recipe's RL knobs (`extra`) except dynamic
sampling. `warm_start_demos=0` starts both arms from the base model instead.

Knobs (key=value): steps, batch, n_samples, max_steps, tasks, seeds (comma list), lr, eval_episodes, eval_temperature,
priority, warm_start_demos, warm_start_tasks, scheduler, extra (';'-separated config overrides; default the
recipe's RL knobs, so an `extra` given replaces them), fileroot, reuse.

`reuse` (comma list of earlier curriculum results files, finished or partial) adds seeds to a measurement
or resumes one that stopped: a (mode, seed) run recorded there is taken as it was measured instead of
trained again, provided every knob but seeds, reuse and fileroot matches (else a clear error). A file
that differs only in a knob of the adaptive arm (`priority`) lends its uniform runs alone: comparing
two adaptive priorities trains the uniform arm once. The
result names each reused run, its file and that file's date (`figures.reused`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from asyncwebrl.bench.arms import ArmResult, EvalRow, run_arm
from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result

DEFAULTS = {
    # 30 steps x 2 groups x 4 episodes, the multi-step recipe's budget (Makefile MULTISTEP_ARGS). Earlier
    # forms (docs/results-log.md, "Adaptive task sampling"): 24 steps of single-step tasks with the
    # default temperature 0.7 moved neither arm above its start (0.81x from a light warm start, 0.79x from
    # the base model, 0.91x and 1.03x on miniwob-easy); 1.80x under document-order ids
    "steps": 30,
    "batch": 2,
    "n_samples": 4,
    "max_steps": 4,
    # Four multi-step tasks that the recipe's RL takes from a light warm start to most of the way
    # (bench/results/multistep.json: enter-text 0 -> 1, enter-password 0 -> 0.83, login-user 0 -> 0.67,
    # click-button-sequence 0.5 -> 1) and four tasks the policy does not solve and gets no demonstrations
    # of (click-option stayed at 0 there even with them; click-color, click-shape, grid-coordinate 1 of 24
    # sampled from the base model). A researcher's own pool holds such tasks; uniform sampling spends
    # half its groups on them, and every such group has all-zero advantages
    "tasks": "enter-text,enter-password,login-user,click-button-sequence,"
             "click-option,click-color,click-shape,grid-coordinate",
    "seeds": "1,2",
    "lr": None,
    # the recipe's light warm start (4 demonstrations, two passes) on the four learnable tasks only
    "warm_start_demos": 4,
    "warm_start_tasks": "enter-text,enter-password,login-user,click-button-sequence",
    # 6 per task: one episode moves the figure by 1/48
    "eval_episodes": 48,
    # 0 = greedy (what a user deploys). At this budget the greedy answer on a half-learnt task sits on a
    # knife edge: enter-text at sampled success 0.6 stayed at 0 greedy in two adaptive runs, so the greedy
    # figure records which side each run landed on. 1.0 = the training temperature: the evaluation then
    # measures the policy RL optimises, per episode, without the flip
    "eval_temperature": 0.0,
    "scheduler": "ray",
    # The recipe's RL knobs (docs/training.md, "Multi-step tasks") without its dynamic sampling: that
    # drops the zero-signal groups after paying for their rollouts, which would hide from the evaluation
    # what adaptive sampling saves by not drawing them
    "extra": "gconfig.max_new_tokens=16;gconfig.temperature=1.0;actor.temperature=1.0;actor.lr_decay_steps=30;"
             "actor.eps_clip_higher=0.28;actor.step_normalizer=episode_length;rollout.dynamic_sampling=false",
    "fileroot": "/tmp/asyncwebrl-bench",
    "reuse": "",
    # what the adaptive arm favours (env.task_sampling.priority): learnability = p(1-p), progress =
    # |fast - slow| success rate, zone = one share for every task inside the zone. The uniform arm
    # never reads it
    "priority": "learnability",
}
# knobs that may differ between a measurement and the files whose runs it reuses
_FREE_KNOBS = ("seeds", "reuse", "fileroot")
# knobs only the adaptive arm passes: a file measured with others still holds this measurement's uniform runs
_ADAPTIVE_KNOBS = ("priority",)
# what a knob was in files measured before it existed (not its default now, which may move)
_BEFORE_KNOB = {"eval_temperature": 0.0, "priority": "learnability"}
MODES = ("uniform", "adaptive")


def _overrides(knobs: dict[str, Any], mode: str) -> list[str]:
    ovs = [f"total_train_steps={knobs['steps']}", f"rollout.consumer_batch_size={knobs['batch']}",
           f"gconfig.n_samples={knobs['n_samples']}", f"env.max_steps={knobs['max_steps']}",
           f"env.task_sampling.mode={mode}", f"scheduler.type={knobs['scheduler']}", "test_rollout.enabled=true",
           f"test_rollout.n_episodes={knobs['eval_episodes']}",
           f"test_rollout.temperature={knobs['eval_temperature']}", "checkpoint.every_n_steps=0",
           "stats.tensorboard=false"]
    if mode == "adaptive":
        ovs.append(f"env.task_sampling.priority={knobs['priority']}")
    if knobs["tasks"]:
        ovs.append(f"env.tasks={knobs['tasks']}")
    if knobs["lr"] is not None:
        ovs.append(f"actor.lr={knobs['lr']}")
    if int(knobs["warm_start_demos"]) > 0:
        ovs += ["warm_start.enabled=true", "warm_start.source=oracle", f"warm_start.n_demos={knobs['warm_start_demos']}",
                "warm_start.epochs=2", f"warm_start.tasks={knobs['warm_start_tasks']}"]
    return ovs + [o for o in str(knobs["extra"]).split(";") if o.strip()]


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def _se(xs: list[float | None]) -> float | None:
    """Standard error of the mean over seeds (sample standard deviation / sqrt(n)); None below 2 seeds."""
    vals = [x for x in xs if x is not None]
    return statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) >= 2 else None


def _per_task_mean(evals: list[EvalRow]) -> dict[str, float]:
    tasks = sorted({t for e in evals for t in e.per_task})
    return {t: statistics.fmean([e.per_task[t] for e in evals if t in e.per_task]) for t in tasks}


def _groups_by_task(rs: list[ArmResult]) -> dict[str, float]:
    """Consumed groups per task, mean over the seeds (from each run's task sampling record)."""
    tasks = sorted({t for a in rs for t in a.groups_by_task})
    return {t: statistics.fmean([a.groups_by_task.get(t, 0) for a in rs]) for t in tasks}


def _reused_runs(knobs: dict[str, Any]) -> dict[tuple[str, int], tuple[ArmResult, dict[str, str]]]:
    """(mode, seed) -> the run recorded in one of the `reuse` files, with where it came from."""
    out: dict[tuple[str, int], tuple[ArmResult, dict[str, str]]] = {}
    for path in (p.strip() for p in str(knobs["reuse"] or "").split(",")):
        if not path:
            continue
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"bench curriculum: reuse={path}: cannot read it as a results file ({e})") from None
        if doc.get("name") != "curriculum":
            raise SystemExit(f"bench curriculum: reuse={path} is a {doc.get('name')!r} result, not a curriculum one")
        # a knob the file predates held its value from before the knob existed
        there = {**DEFAULTS, **_BEFORE_KNOB, **doc["config"]}
        differ = sorted(k for k in knobs if k not in _FREE_KNOBS and there[k] != knobs[k])
        if [k for k in differ if k not in _ADAPTIVE_KNOBS]:
            raise SystemExit(f"bench curriculum: reuse={path} was measured with other knobs: "
                             + ", ".join(f"{k}={there[k]!r} there, {knobs[k]!r} here" for k in differ))
        for mode, arm in doc["figures"]["arms"].items():
            if mode != "uniform" and differ:  # its adaptive arm sampled otherwise: trained again
                continue
            for brief in arm["runs"] if isinstance(arm, dict) else arm:  # finished file / partial file
                a = ArmResult.from_brief(brief)
                out.setdefault((mode, a.seed), (a, {"mode": mode, "seed": str(a.seed), "file": path,
                                                    "measured": str(doc["date"])}))
    return out


def main(overrides: list[str] | None = None) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    seeds = [int(s) for s in str(knobs["seeds"]).split(",") if str(s).strip()]
    if len(seeds) < 1:
        raise SystemExit("bench curriculum: seeds must be a comma list of integers, e.g. seeds=1,2")
    earlier = _reused_runs(knobs)
    reused: list[dict[str, str]] = []
    runs: dict[str, list[ArmResult]] = {m: [] for m in MODES}
    for seed in seeds:  # interleaved, so load on the shared machine drifts evenly over both arms
        for mode in MODES:
            if (mode, seed) in earlier:
                arm, origin = earlier[(mode, seed)]
                runs[mode].append(arm)
                reused.append(origin)
                continue
            runs[mode].append(run_arm(f"curriculum-{mode}", _overrides(knobs, mode), knobs["fileroot"], seed=seed))
            write_result("curriculum", knobs, {"partial": True, "seeds": seeds, "reused": reused,
                                               "arms": {m: [a.brief() for a in rs] for m, rs in runs.items()}})
    arms = {}
    for mode, rs in runs.items():
        arms[mode] = {
            "eval_first_mean": _mean([a.eval_first for a in rs]),
            "eval_last_mean": _mean([a.eval_last for a in rs]),
            "eval_last_by_seed": {str(a.seed): a.eval_last for a in rs},
            "eval_last_se": _se([a.eval_last for a in rs]),
            "eval_first_by_seed": {str(a.seed): a.eval_first for a in rs},
            "eval_gain_mean": _mean([a.eval_last - a.eval_first for a in rs
                                     if a.eval_last is not None and a.eval_first is not None]),
            "gain_over_shortcut_mean": _mean([a.gain_over_shortcut for a in rs]),
            # tasks neither arm trains on (test_rollout.heldout_tasks): what the training carries over
            "heldout_first_mean": _mean([a.heldout_first for a in rs]),
            "heldout_last_mean": _mean([a.heldout_last for a in rs]),
            "heldout_last_by_seed": {str(a.seed): a.heldout_last for a in rs},
            "zero_adv_frac_mean": _mean([a.zero_adv_frac for a in rs]),
            "train_success_mean": _mean([statistics.fmean([s.success_rate for s in a.steps]) for a in rs if a.steps]),
            # where the final figure comes from: on a small budget one task learnt or not moves it most
            "per_task_first_mean": _per_task_mean([a.evals[0] for a in rs if a.evals]),
            "per_task_last_mean": _per_task_mean([a.evals[-1] for a in rs if a.evals]),
            "groups_by_task": _groups_by_task(rs),
            "wall_s_mean": _mean([a.wall_s for a in rs]),
            "runs": [a.brief() for a in rs],
        }
    uni, ada = arms["uniform"]["eval_last_mean"], arms["adaptive"]["eval_last_mean"]
    h_uni, h_ada = arms["uniform"]["heldout_last_mean"], arms["adaptive"]["heldout_last_mean"]
    paired = [(u.heldout_last, a.heldout_last) for u, a in zip(runs["uniform"], runs["adaptive"], strict=True)
              if u.heldout_last is not None and a.heldout_last is not None]
    figures = {
        "seeds": seeds,
        "steps_per_run": knobs["steps"],
        "adaptive_over_uniform": ada / uni if uni else None,
        "eval_last_uniform": uni,
        "eval_last_adaptive": ada,
        # the spread over seeds: on a small budget it is as large as the difference between the arms
        "eval_last_se_uniform": arms["uniform"]["eval_last_se"],
        "eval_last_se_adaptive": arms["adaptive"]["eval_last_se"],
        "eval_gain_uniform": arms["uniform"]["eval_gain_mean"],
        "eval_gain_adaptive": arms["adaptive"]["eval_gain_mean"],
        # the same evaluation episodes in every arm and seed, so one shortcut (the first arm's)
        "shortcut_baseline": next((a.shortcut_baseline for rs in runs.values() for a in rs
                                   if a.shortcut_baseline is not None), None),
        "gain_over_shortcut_uniform": arms["uniform"]["gain_over_shortcut_mean"],
        "gain_over_shortcut_adaptive": arms["adaptive"]["gain_over_shortcut_mean"],
        # the held-out tasks beside the headline: the same ratio on tasks neither arm trains on, and in
        # how many seeds each arm ended ahead there (None / 0 when the runs evaluated no held-out tasks)
        "heldout_adaptive_over_uniform": h_ada / h_uni if h_uni else None,
        "heldout_last_uniform": h_uni,
        "heldout_last_adaptive": h_ada,
        "heldout_seeds_adaptive_ahead": sum(a > u for u, a in paired),
        "heldout_seeds_uniform_ahead": sum(u > a for u, a in paired),
        "zero_adv_frac_uniform": arms["uniform"]["zero_adv_frac_mean"],
        "zero_adv_frac_adaptive": arms["adaptive"]["zero_adv_frac_mean"],
        "reused": reused,
        "arms": arms,
    }
    write_result("curriculum", knobs, figures)
    rows = [{"mode": m, "seed": a.seed, "eval_first": a.eval_first, "eval_last": a.eval_last,
             "shortcut": a.shortcut_baseline, "heldout_last": a.heldout_last, "zero_adv_frac": a.zero_adv_frac,
             "wall_s": a.wall_s}
            for m in MODES for a in runs[m]]
    ratio = figures["adaptive_over_uniform"]
    how = "greedy" if float(knobs["eval_temperature"]) <= 0 else f"temperature {knobs['eval_temperature']}"
    print_table(rows, f"adaptive/uniform final eval success ({how}): {ratio:.2f}x" if ratio is not None
                else "adaptive/uniform: uniform arm scored 0, ratio undefined")
    return 0
