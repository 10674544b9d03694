"""Config of the web environment (SPEC section 7)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


@dataclass(kw_only=True)
class TaskSamplingConfig:
    """How the rollout workers pick the next task (asyncwebrl.rollout.curriculum has the formulas)."""

    mode: Literal["uniform", "adaptive"] = "uniform"
    """uniform = shuffled passes over the tasks; adaptive = a priority per task from its success (`priority`)"""
    priority: Literal["learnability", "progress", "zone"] = "learnability"
    """what adaptive sampling favours (asyncwebrl.rollout.curriculum has the formulas): learnability =
    p(1-p) of the success estimate, largest at 1/2; progress = |fast - slow| success average, largest
    where success is moving; zone = the same share for every task inside the productive zone (online
    difficulty filtering: only the hopeless and the solved are cut). A task the policy solves at
    chance has a high learnability but no progress: in bench curriculum (2026-12-06, four seeds)
    learnability spent 11 of 60 groups on click-shape, at about 1/4 from start to end, against
    uniform's 7. Progress did worse there
    (0.61x uniform against learnability's 0.84x): from 4-episode groups, some 8 per task, the
    progress of every task in the zone read 0.02-0.13, mostly noise, and click-shape got 15 groups.
    Zone's first seed there (2026-12-07) ended at 0.104 against uniform's 0.167: the groups cut from
    the hopeless tasks went to click tasks that work against the one task being learnt"""
    epsilon: float = 0.05
    """productive zone [epsilon, 1-epsilon] of the success EMA; outside it a task keeps only the floor"""
    ema_alpha: float = 0.3
    """weight of the newest consumed group in a task's success EMA"""
    floor: float = 0.2
    """exploration share spread evenly over all tasks, so no task starves"""
    min_groups: int = 1
    """consumed groups a task needs before its own estimate counts (before: its prior, else top priority)"""
    prior_episodes: float = 1.0
    """pseudo-episodes of the prior mean (1/2, or the evaluation prior) in each task's estimate: one
    all-fail group of 4 no longer takes a task out of the zone; 0 = the bare discounted success rate"""
    prior: Literal["none", "eval"] = "none"
    """where a task's estimate starts: "none" = unknown, top priority until seen; "eval" = its greedy
    success in the test-rollout evaluation of the starting checkpoint (needs test_rollout.enabled; the
    task EMA starts there, and it stands in for the task's own estimate until min_groups groups are
    consumed). Not the default: greedy success is not sampled success. Measured 2026-12-01 (miniwob-easy,
    12 steps): click-test-2 scored 0 greedy, so the prior kept it at the floor, while uniform sampling
    took it from 0 to 0.75 in both seeds; adaptive with the prior ended at 0.472 against 0.639"""
    relearn_drop: float = 0.3
    """a task whose estimate fell this far below its best is being forgotten, not out of reach: it gets
    the top priority (1/4) until it recovers or its decaying best comes within this of the estimate
    (about nine consumed groups after a fall from 0.8). Measured 2026-12-01 (miniwob-easy, 24 steps, seed 2):
    click-dialog fell from 0.83 to 0 greedy under adaptive sampling, whose share then fell to the floor,
    while uniform kept it at 0.83 / 1.0. 0 = off"""
    prior_wait_s: float = 300.0
    """adaptive + prior=eval, fresh run: rollout starts after that first evaluation, or after this many
    seconds (0 = start at once and fold the prior in when it arrives)"""

    def validate(self) -> None:
        if not 0 <= self.epsilon < 0.5:
            raise ValueError("env.task_sampling.epsilon must be in [0, 0.5)")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError("env.task_sampling.ema_alpha must be in (0, 1]")
        if not 0 < self.floor <= 1:
            raise ValueError("env.task_sampling.floor must be in (0, 1] (0 would let a task starve)")
        if self.prior_episodes < 0:
            raise ValueError("env.task_sampling.prior_episodes must be >= 0")
        if self.min_groups < 0:
            raise ValueError("env.task_sampling.min_groups must be >= 0")
        if self.prior not in ("none", "eval"):
            raise ValueError(f"env.task_sampling.prior must be 'none' or 'eval', got {self.prior!r}")
        if self.prior_wait_s < 0:
            raise ValueError("env.task_sampling.prior_wait_s must be >= 0")
        if self.priority not in ("learnability", "progress", "zone"):
            raise ValueError("env.task_sampling.priority must be 'learnability', 'progress' or 'zone', "
                             f"got {self.priority!r}")
        if not 0 <= self.relearn_drop <= 1:
            raise ValueError("env.task_sampling.relearn_drop must be in [0, 1] (0 = off)")


@dataclass(kw_only=True)
class EnvConfig:
    type: Literal["miniwob", "webgym", "synthetic"] = "miniwob"
    """environment kind: real MiniWoB++ tasks, WebGym-style task file, or the synthetic web-like env"""
    tasks: str = "miniwob-easy"
    """task subset name (miniwob-easy, miniwob-all, ...) or a comma-separated list of task names"""
    task_file: str | None = None
    """WebGym-style JSONL task file (env.type=webgym)"""
    task_sampling: TaskSamplingConfig = field(default_factory=TaskSamplingConfig)
    """how the next training task is chosen (uniform or adaptive)"""
    max_steps: int = 4
    """step budget of one episode"""
    viewport_width: int = 160
    """browser viewport width in pixels (MiniWoB tasks occupy 160x210)"""
    viewport_height: int = 210
    """browser viewport height in pixels"""
    history_k: int = 1
    """sliding window: screenshots of the last k steps enter the prompt, older steps as text"""
    use_screenshot: bool = True
    """put the screenshot into the prompt"""
    element_list: bool = True
    """add a text list of interactive elements (id, role, name) to the prompt"""
    set_of_marks: bool = False
    """draw element ids onto the screenshot"""
    element_ids: Literal["drawn", "document"] = "drawn"
    """how listed elements are numbered: drawn = a permutation of 1..N drawn per observation from
    (task, episode seed, observation index), so an id carries no position and a constant answer such
    as `click [1]` scores at chance; document = 1..N in document order (for comparisons)"""
    coord_mode: Literal["pixel", "norm1000"] = "pixel"
    """coordinates in actions: pixels or normalized 0-1000"""
    invalid_action_penalty: float = 0.0
    """reward added for an unparsable or impossible action"""
    no_effect_penalty: float = 0.0
    """reward added for a valid action that changed nothing on the page (typing into a button,
    clicking empty space). Without it, a group mixing unparsable outputs with a valid do-nothing action
    rewards the do-nothing action over the invalid ones, and the policy settles on it everywhere"""
    recycle_context_every: int = 1
    """episodes one browser context serves. 1 (default): a fresh context every episode, so nothing a
    page stored (cookies, localStorage, IndexedDB, caches) reaches the next episode. >1 reuses the
    context and ITS STORAGE across episodes (faster resets, episodes not isolated)"""
    reset_timeout_s: float = 60.0
    """deadline of one env.reset (page load, and a browser launch on first use, included); a miss fails
    the episode (EnvDeadline)"""
    step_timeout_s: float = 10.0
    """deadline of one env.step (action, page settle, observation); a miss fails the episode. A MiniWoB
    step takes tens of milliseconds; a page that stalls longer than this is not a task"""
    episode_timeout_s: float = 120.0
    """env wall budget of one episode: the sum of its reset and step times (model time not counted).
    A page that stalls every step just under the step deadline fails the episode (EnvDeadline) once
    the sum reaches this, instead of holding a rollout slot for max_steps x step_timeout_s"""
    slow_step_s: float = 2.0
    """a step that takes at least this long is reported slow (StepResult.slow, the run's slow_steps)"""
    episode_time_limit_s: float = 600.0
    """MiniWoB real-time limit of an episode (the stock 10 s is far too short for slow policies)"""
    headless_shell: str = "/usr/lib/chromium/chromium-headless-shell"
    """path of the Chromium binary Playwright launches"""
    action_settle_ms: float = 0.0
    """fixed pause after each action before observing, on top of the settle wait below"""
    settle_quiet_ms: float = 50.0
    """the page counts as settled (and is observed) once no finite animation or transition runs and the
    DOM has not changed for this long, counted from the action too: a datepicker that slides in is
    observed open, not half-way"""
    settle_type_quiet_ms: float = 350.0
    """the quiet window after a typing action: a widget that answers typing after a debounce (jQuery
    UI's autocomplete waits 300 ms) shows its menu in the observation"""
    settle_max_ms: float = 1000.0
    """cap of the settle wait after an action or a reset, whatever the page does (0 = observe at once)"""
    wait_action_s: float = 0.2
    """how long a Wait action waits"""
    vlm_judge_url: str | None = None
    """OpenAI-compatible base URL (e.g. http://127.0.0.1:30000/v1) for vlm_judge evaluators; None = judge off"""
    vlm_judge_model: str = "default"
    """model name sent to the VLM judge endpoint"""
    vlm_judge_timeout_s: float = 60.0
    """timeout of one judge request"""
    synthetic_step_latency_ms: float = 20.0
    """synthetic env: mean latency of one environment step"""
    synthetic_replay_dir: str | None = None
    """synthetic env: folder of recorded *.png screenshots shown instead of drawn pages
    (record real MiniWoB++ pages with `asyncwebrl record-screens DIR`)"""
    synthetic_latency_file: str | None = None
    """synthetic env: latencies measured on real Chromium (`asyncwebrl record-latency FILE`); steps, resets
    and each fresh env's first-reset warm-up are drawn from its samples instead of the log-normal"""
    synthetic_length_median: float | None = None
    """synthetic env: heavy-tailed episode lengths, log-normal with this median (capped at env.max_steps);
    None = the success/failure profile"""
    synthetic_length_sigma: float = 1.0
    """synthetic env: log-normal sigma of the heavy-tailed episode lengths (1.0: p95 ~ 5x the median)"""

    def validate(self) -> None:
        if self.element_ids not in ("drawn", "document"):
            raise ValueError(f"env.element_ids must be 'drawn' or 'document', got {self.element_ids!r}")
        if self.max_steps < 1:
            raise ValueError("env.max_steps must be >= 1")
        if self.history_k < 0:
            raise ValueError("env.history_k must be >= 0")
        if self.viewport_width < 32 or self.viewport_height < 32:
            raise ValueError("env.viewport_width/height must be >= 32")
        if self.recycle_context_every < 1:
            raise ValueError("env.recycle_context_every must be >= 1")
        if not (0 < self.reset_timeout_s <= 3600 and 0 < self.step_timeout_s <= 3600):
            raise ValueError("env.reset_timeout_s and env.step_timeout_s must be in (0, 3600] seconds")
        if not 0 < self.episode_timeout_s <= 36000:
            raise ValueError("env.episode_timeout_s must be in (0, 36000] seconds")
        if not 0 < self.slow_step_s:
            raise ValueError("env.slow_step_s must be > 0")
        if self.episode_time_limit_s <= 0:
            raise ValueError("env.episode_time_limit_s must be > 0")
        if self.action_settle_ms < 0 or self.wait_action_s < 0:
            raise ValueError("env.action_settle_ms and env.wait_action_s must be >= 0")
        if min(self.settle_quiet_ms, self.settle_type_quiet_ms, self.settle_max_ms) < 0:
            raise ValueError("env.settle_quiet_ms, env.settle_type_quiet_ms and env.settle_max_ms must be >= 0")
        if self.settle_max_ms / 1000 >= self.step_timeout_s:
            raise ValueError(f"env.settle_max_ms ({self.settle_max_ms}) must be below env.step_timeout_s "
                             f"({self.step_timeout_s} s): a page that never settles would miss every step deadline")
        if self.synthetic_replay_dir is not None and self.type == "synthetic":
            folder = Path(self.synthetic_replay_dir)
            if not folder.is_dir() or not any(folder.glob("*.png")):
                raise ValueError(f"env.synthetic_replay_dir {folder} is not a folder of *.png screenshots")
        if self.synthetic_length_median is not None and self.synthetic_length_median < 1:
            raise ValueError("env.synthetic_length_median must be >= 1 (or null)")
        if self.synthetic_length_sigma < 0:
            raise ValueError("env.synthetic_length_sigma must be >= 0")
        if self.synthetic_latency_file is not None and self.type == "synthetic":
            from asyncwebrl.web.latency import LatencyTable

            LatencyTable.load(self.synthetic_latency_file)  # a clear error now, not in a rollout worker
        if self.type == "webgym" and not self.task_file:
            raise ValueError("env.type=webgym needs env.task_file")
