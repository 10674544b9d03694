"""Adaptive task sampling (`env.task_sampling.mode=adaptive`): spend rollouts where GRPO learns.

A GRPO group whose episodes all succeed or all fail has all-zero advantages and teaches nothing. The
`TaskCurriculum` keeps, per task family, an exponential moving average of the group success rate,
updated when the TRAINER CONSUMES a group (the controller calls `observe(groups)` after
`prepare_batch`; rollout workers never see the tracker). From the tracker it derives sampling weights,
which the controller pushes down to the task samplers of the rollout workers
(`rollout.set_task_weights`), the same way it pushes the weight version.

The estimate p_i that decides is the same exponential average taken over episode counts, shrunk towards
a prior mean m (1/2, or the evaluation prior) by k = `prior_episodes` pseudo-episodes:

    S_i <- (1 - alpha) S_i + successes,   F_i <- (1 - alpha) F_i + failures      (per consumed group)
    p_i  = (S_i + k m) / (S_i + F_i + k)

A group is only 4 episodes: a task at true success 1/4 has a 0-of-4 group a third of the time, and
the bare EMA started from such a group is exactly 0, outside the zone, so the task fell to the floor
after one look and was hardly seen again (measured 2026-12-01: click-test-2 at share 0.06 of 7 tasks
in the 30-step default run, the task uniform sampling took from 0 to 0.75 greedy). With k = 1 a task
leaves the zone after about four all-fail (or all-success) groups in a row, not one.

    priority_i = p_i (1 - p_i)           if eps <= p_i <= 1 - eps    (the productive zone)
               = 0                       otherwise
               = the same of the prior   while task i has fewer than `min_groups` observed groups
               = 1/4 (the maximum)       ... and no prior either
    share_i    = floor / N + (1 - floor) * priority_i / sum_j priority_j
               = 1 / N                   when every priority is 0

Forgotten is not out of reach. A task that drops below the zone after the policy had learnt it (the
policy un-learns it while training on others) would fall to the floor exactly when it most needs
groups. So each task also keeps its best estimate b_i, which decays towards p_i at a third of the EMA rate
per consumed group of it; while b_i - p_i >= `relearn_drop` the task is relearning and gets the top
priority 1/4, like a task never seen:

    b_i <- p_i                                   if p_i >= b_i
         <- p_i + (1 - alpha / 3) (b_i - p_i)    otherwise        (per consumed group, own data only)

A task that never succeeded never relearns (b_i stays at its own low estimates); one at 0.8 that
fails every group from then on is relearning from its second failed group to its tenth (alpha = 0.3,
k = 1, relearn_drop = 0.3; its estimate is 0.06 by then), then keeps the floor. At half the EMA rate
the boost ended at an estimate of 0.1, before the task sank to the floor it was meant to keep it from.

Learnability is not learning. A task the policy solves at chance (click-shape at about 1/4, start to
end, in both arms of bench curriculum) sits in the middle of the zone, so p(1 - p) gave it 11 of 60
groups where uniform sampling gave 7, and it learnt nothing from them. `priority=progress` ranks by
absolute learning progress instead (Portelas et al. 2019; the fast-minus-slow form of Kanitscheider et
al. 2021): two bare discounted success rates of the same groups, a fast one at the EMA rate and a slow
one at a third of it,

    r_i^fast = S_i / (S_i + F_i),   r_i^slow = S'_i / (S'_i + F'_i)   (S', F' discounted by alpha / 3)
    priority_i = |r_i^fast - r_i^slow|     if eps <= p_i <= 1 - eps, once task i has max(2, min_groups)
                                            consumed groups
               = 0                          outside the zone: solved or hopeless for now
               = max_j priority_j           before (no trend can be seen in one group): as much as
                                            the fastest-moving task; 1 while no task has a trend

A task whose success rises (or falls: forgetting, so the relearning rule below is not needed here)
has the fast rate ahead of (behind) the slow one; a task at a constant success, at chance or at 0 or
1, has both equal up to the noise of 4-episode groups (about 0.02 at success 1/4 after 8 groups, against
0.05-0.1 for one climbing 0.1 a group). The rates are bare (no prior pseudo-episodes): shrinking the two
towards 1/2 by different amounts would itself open a gap at a constant success. The zone is the
learnability rule's (on the shrunk estimate p_i): the slow rate takes some 25 groups to catch up with a
task that jumped to 1, and a solved task should not keep its groups that long.

`priority=zone` keeps only the zone test: every task inside [eps, 1 - eps] (and every task not seen
enough, or relearning) gets priority 1, every other 0, so the shares inside the zone are equal. It is
online difficulty filtering at the task level: the hopeless and the solved tasks are cut, and nothing
else is ranked. Learnability concentrates on the tasks near 1/2, one of which may sit there at chance,
and starves a task at 0.1 that has just begun to succeed (p(1 - p) = 0.09 against 0.25); measured in
bench curriculum (2026-12-06), it gave the task at 1/3 (enter-text) up to a third of all groups for
most of a run, and under that share the task was learnt in fewer runs than under uniform sampling.
The zone rule reads nothing finer from a 4-episode group than "some but not all succeed".

The prior (`prior=eval`): the test-rollout group evaluates the starting checkpoint greedily on the
training tasks anyway; the controller hands each evaluation's per-task success to `observe_eval`. It
stands in for a task's estimate until the task has `min_groups` consumed groups, and the EMA starts
from it (p_1 = (1 - alpha) prior + alpha rate_1) instead of from the first group alone. Without it the
first visit to every task is spent measuring what the evaluation already knows: with 9 tasks and 2
groups a step, the first ~5 steps. Later evaluations (of older checkpoints than the groups the trainer
consumes) only replace the prior of tasks not yet observed.

Invariants: every task keeps a share of at least floor / N (no task starves, and a task whose
success drifts back into the zone is seen again); a task never observed has the highest priority
(new tasks get visits); the shares sum to 1; the tracker's state round-trips through
`state_dict` / `load_state_dict` (it is saved in checkpoints, so a resumed run samples as before).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from asyncwebrl.records import RolloutGroup
from asyncwebrl.web.config import TaskSamplingConfig


def task_family(group_task_id: str) -> str:
    """'miniwob/click-test#123' -> 'miniwob/click-test' (a group's key without its episode seed)."""
    return group_task_id.rsplit("#", 1)[0]


def group_counts(group: RolloutGroup) -> tuple[int, int]:
    """(successes, usable episodes) of a group; failed episodes (infrastructure errors) do not count."""
    alive = [t for t in group.trajectories if not t.failed]
    return sum(1 for t in alive if t.success), len(alive)


def zero_advantage(group: RolloutGroup) -> bool:
    """True when group-normalized (GRPO) advantages of the group are all zero: every usable episode got
    the same reward, so the group carries no learning signal."""
    rewards = [t.reward for t in group.trajectories if not t.failed and t.steps]
    return not rewards or max(rewards) - min(rewards) < 1e-9


@dataclass
class TaskStat:
    """What the tracker knows about one task family."""

    success_ema: float | None = None
    """EMA of the group success rate (None until the first consumed group)"""
    groups: int = 0
    """consumed groups of this task"""
    zero_adv_groups: int = 0
    """consumed groups whose advantages were all zero"""
    prior: float | None = None
    """success in the greedy evaluation (prior=eval); None: none arrived"""
    successes: float = 0.0
    """discounted successful episodes S (module docstring)"""
    failures: float = 0.0
    """discounted failed episodes F"""
    best: float | None = None
    """best own estimate so far, decaying towards the current one (module docstring: relearning)"""
    slow_successes: float = 0.0
    """successful episodes discounted at a third of the EMA rate (S'; module docstring: progress)"""
    slow_failures: float = 0.0
    """failed episodes discounted at a third of the EMA rate (F')"""
    wins: int = 0
    """successful episodes in all consumed groups, undiscounted"""

    def estimate(self, k: float) -> float | None:
        """p = (S + k m) / (S + F + k), m = the prior or 1/2; None when nothing at all is known."""
        n = self.successes + self.failures
        if n + k <= 0:
            return self.success_ema
        m = self.prior if self.prior is not None else 0.5
        return (self.successes + k * m) / (n + k)

    def progress(self) -> float | None:
        """|r_fast - r_slow| of the bare discounted success rates; None before any usable episode."""
        n, n_slow = self.successes + self.failures, self.slow_successes + self.slow_failures
        if n <= 0 or n_slow <= 0:
            return None
        return abs(self.successes / n - self.slow_successes / n_slow)


@dataclass
class CurriculumRecord:
    """Per-task success and sampling share at one training step (logged as metrics, shown in the report)."""

    mode: str
    success: dict[str, float | None] = field(default_factory=dict)
    """estimated success per task, the p that sets its priority (None: not observed yet)"""
    share: dict[str, float] = field(default_factory=dict)
    """sampling probability per task now in force"""
    groups: dict[str, int] = field(default_factory=dict)
    """consumed groups per task so far"""
    in_zone: int = 0
    """tasks whose EMA success lies in the productive zone [eps, 1 - eps]"""
    prior: dict[str, float] = field(default_factory=dict)
    """evaluation prior per task (prior=eval; only the tasks that got one)"""
    relearning: int = 0
    """tasks whose estimate fell relearn_drop or more below their best (given the top priority)"""
    progress: dict[str, float] = field(default_factory=dict)
    """absolute learning progress per observed task, |fast - slow| success rate (logged in either priority)"""
    wins: dict[str, int] = field(default_factory=dict)
    """successful episodes per task in its consumed groups so far (undiscounted)"""

    def flat(self) -> dict[str, float]:
        """Scalars for TensorBoard / metrics.jsonl: success.<task>, share.<task>, groups.<task>, wins.<task>,
        prior.<task>, progress.<task>."""
        out: dict[str, float] = {"in_zone": float(self.in_zone), "relearning": float(self.relearning)}
        for t, v in self.success.items():
            if v is not None:
                out[f"success.{t}"] = v
        out.update({f"prior.{t}": v for t, v in self.prior.items()})
        out.update({f"progress.{t}": v for t, v in self.progress.items()})
        out.update({f"share.{t}": v for t, v in self.share.items()})
        out.update({f"groups.{t}": float(v) for t, v in self.groups.items()})
        out.update({f"wins.{t}": float(v) for t, v in self.wins.items()})
        return out


class TaskCurriculum:
    """Per-task success tracker and the sampling shares derived from it (module docstring)."""

    def __init__(self, tasks: Iterable[str], cfg: TaskSamplingConfig):
        cfg.validate()
        self.cfg = cfg
        self.tasks = list(dict.fromkeys(tasks))
        if not self.tasks:
            raise ValueError("TaskCurriculum needs at least one task")
        self.stats: dict[str, TaskStat] = {t: TaskStat() for t in self.tasks}

    @property
    def adaptive(self) -> bool:
        return self.cfg.mode == "adaptive"

    # ---- feedback from the trainer --------------------------------------------------------------
    def observe(self, groups: Iterable[RolloutGroup]) -> int:
        """Fold the consumed groups into the tracker; returns how many had all-zero advantages."""
        zero = 0
        a = self.cfg.ema_alpha
        for g in groups:
            wins, n = group_counts(g)
            if n == 0:
                continue
            rate = wins / n
            st = self.stats.setdefault(task_family(g.task_id), TaskStat())
            start = st.success_ema if st.success_ema is not None else st.prior
            st.success_ema = rate if start is None else (1 - a) * start + a * rate
            st.successes = (1 - a) * st.successes + wins
            st.failures = (1 - a) * st.failures + (n - wins)
            st.slow_successes = (1 - a / 3) * st.slow_successes + wins
            st.slow_failures = (1 - a / 3) * st.slow_failures + (n - wins)
            st.groups += 1
            st.wins += wins
            if st.groups >= self.cfg.min_groups:
                p = st.estimate(self.cfg.prior_episodes)
                if p is not None:
                    st.best = p if st.best is None or p >= st.best else p + (1 - a / 3) * (st.best - p)
            if zero_advantage(g):
                st.zero_adv_groups += 1
                zero += 1
        return zero

    def observe_eval(self, per_task: dict[str, float]) -> int:
        """Fold one evaluation's per-task greedy success in as the prior of the tasks that have no
        consumed group yet (prior=eval; a no-op with prior=none). Returns how many priors were set."""
        if self.cfg.prior != "eval":
            return 0
        n = 0
        for task, rate in per_task.items():
            st = self.stats.get(task_family(task))
            if st is None or st.groups > 0 or rate is None:
                continue  # not a training task, or its own groups already speak for it
            st.prior = min(1.0, max(0.0, float(rate)))
            n += 1
        return n

    # ---- what the samplers get ------------------------------------------------------------------
    def priorities(self) -> dict[str, float]:
        """Priority per task under `cfg.priority` (module docstring), before the floor is mixed in."""
        if self.cfg.priority == "progress":
            return self._progress_priorities()
        learnability = self.cfg.priority == "learnability"
        out = {}
        for t in self.tasks:
            p = self._deciding_estimate(t)
            if p is None:  # not seen enough, or relearning: the top of the rule's range
                out[t] = 0.25 if learnability else 1.0
            elif not self._in_zone(p):
                out[t] = 0.0
            else:
                out[t] = p * (1 - p) if learnability else 1.0
        return out

    def _in_zone(self, p: float | None) -> bool:
        return p is not None and self.cfg.epsilon <= p <= 1 - self.cfg.epsilon

    def _deciding_estimate(self, task: str) -> float | None:
        """The p that sets the task's learnability / zone priority; None = the top priority (not seen
        enough and no prior, or relearning)."""
        st = self.stats.get(task) or TaskStat()
        k = self.cfg.prior_episodes
        if st.groups > 0 and st.groups >= self.cfg.min_groups:
            p = st.estimate(k)
        elif st.prior is not None:  # the estimate, if any, is shrunk towards the prior
            p = st.estimate(k) if st.groups > 0 else st.prior
        else:
            return None
        return None if p is None or self.relearning(task) else p

    def _progress_priorities(self) -> dict[str, float]:
        """|fast - slow| of each task with a trend to read (0 outside the zone); the largest of those (1 if
        none) for the others."""
        need = max(2, self.cfg.min_groups)
        known: dict[str, float] = {}
        for t in self.tasks:
            st = self.stats.get(t)
            lp = st.progress() if st is not None and st.groups >= need else None
            if st is not None and lp is not None:
                known[t] = lp if self._in_zone(st.estimate(self.cfg.prior_episodes)) else 0.0
        top = max(known.values(), default=0.0) or 1.0
        return {t: known.get(t, top) for t in self.tasks}

    def relearning(self, task: str) -> bool:
        """True while the task's estimate lies relearn_drop or more below its (decaying) best."""
        st = self.stats.get(task)
        drop = self.cfg.relearn_drop
        if not drop or st is None or st.best is None or st.groups < max(1, self.cfg.min_groups):
            return False
        p = st.estimate(self.cfg.prior_episodes)
        return p is not None and st.best - p >= drop

    def shares(self) -> dict[str, float]:
        """Sampling probability per task (uniform in mode=uniform)."""
        n = len(self.tasks)
        if not self.adaptive:
            return {t: 1.0 / n for t in self.tasks}
        pr = self.priorities()
        total = sum(pr.values())
        if total <= 0:
            return {t: 1.0 / n for t in self.tasks}
        f = self.cfg.floor
        return {t: f / n + (1 - f) * pr[t] / total for t in self.tasks}

    def weights(self) -> dict[str, float] | None:
        """What the controller pushes to the task samplers: the shares, or None (= uniform passes)."""
        return self.shares() if self.adaptive else None

    def record(self) -> CurriculumRecord:
        k = self.cfg.prior_episodes
        success = {t: self.stats[t].estimate(k) if t in self.stats and self.stats[t].groups else None
                   for t in self.tasks}
        return CurriculumRecord(
            mode=self.cfg.mode,
            success=success,
            share=self.shares(),
            groups={t: self.stats[t].groups if t in self.stats else 0 for t in self.tasks},
            in_zone=sum(1 for v in success.values() if self._in_zone(v)),
            prior={t: st.prior for t, st in self.stats.items() if st.prior is not None},
            relearning=sum(self.relearning(t) for t in self.tasks),
            progress={t: lp for t in self.tasks if t in self.stats and (lp := self.stats[t].progress()) is not None},
            wins={t: self.stats[t].wins if t in self.stats else 0 for t in self.tasks},
        )

    # ---- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.cfg.mode, "tasks": {t: asdict(s) for t, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tasks = state.get("tasks")
        if not isinstance(tasks, dict):
            raise ValueError(f"curriculum state has no 'tasks' mapping: {state!r:.200}")
        names = {f.name for f in fields(TaskStat)}
        for t, s in tasks.items():  # a field a checkpoint predates keeps its default
            self.stats[t] = TaskStat(**{k: v for k, v in s.items() if k in names})
