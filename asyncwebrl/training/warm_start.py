"""The warm start: behaviour cloning on demonstrations before the first RL step (issue 19).

Demonstrations are played by the rollout's own episode loop (`rollout.episode.run_episode`) on the
env the rollout workers build (`web.env_factory.make_env`), with a scripted policy standing where the
inference client stands: a MiniWoB oracle (`web.oracles`) reading the observation the env just
returned, or the replay of a recorded episode's action texts (a run's `episodes/` folder, replayed on
its task and seed). So each step's prompt ids are built exactly as rollout builds them
(`web.prompt.build_messages`, the chat template, `VLMAdapter.encode` with the screenshot), and the
target ids are what the policy would emit for the demonstrated action: `VLMAdapter.assistant_turn_ids`,
the action text through the end-of-turn token generation stops on.

Invariants:
- only successful episodes become demonstrations; every step of one is a `TrainSample` carrying its
  screenshots inline (object_store transport: nothing enters a PixelStore);
- a step whose target is longer than gconfig.max_new_tokens is dropped and counted (rollout would cut
  it before its end-of-turn token: the policy could never emit it whole);
- the update is `FSDPActor.bc_step` (token-mean NLL over the global batch, every rank the same batch),
  with its own AdamW; it never changes the weight version: its result is version 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.training.config import WarmStartConfig
from asyncwebrl.training.samples import TrainSample
from asyncwebrl.web.base import Observation, Task

log = logging.getLogger(__name__)
DEMO_SEED_BASE = 2_000_000
"""demonstration episode seeds start here: disjoint from evaluation (1_000_000 + i) and training seeds"""
MAX_ATTEMPTS_PER_DEMO = 3


@dataclass
class WarmStartEpoch:
    """One pass over the demonstrations (logged as metrics kind "warm_start", step = epoch)."""

    epoch: int
    nll: float
    """token-mean NLL of the demonstrated tokens over the epoch (each minibatch measured before its update)"""
    n_updates: int
    n_tokens: int
    grad_norm: float
    """mean over the epoch's updates"""
    time_s: float

    def as_log(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class Demonstrations:
    """Successful demonstration episodes, as training samples (one per step)."""

    samples: list[TrainSample]
    episodes: int
    """successful episodes kept"""
    attempts: int
    """episodes played"""
    per_task: dict[str, int] = field(default_factory=dict)
    """successful episodes per task name"""
    dropped_steps: int = 0
    """steps of successful episodes whose target exceeded gconfig.max_new_tokens"""
    collect_s: float = 0.0
    episode_of: dict[str, str] = field(default_factory=dict)
    """traj_id of each kept demonstration -> the task instance it played ('miniwob/NAME#SEED')"""


@dataclass
class WarmStartReport:
    """What the warm start did (the controller logs it; the summary and `bench warmstart` read it)."""

    source: str
    demos: int
    """successful demonstration episodes used"""
    samples: int
    """demonstration steps (training samples)"""
    attempts: int
    dropped_steps: int
    per_task: dict[str, int]
    epochs: list[WarmStartEpoch]
    collect_s: float
    train_s: float

    @property
    def nll_first(self) -> float:
        return self.epochs[0].nll

    @property
    def nll_last(self) -> float:
        return self.epochs[-1].nll


# ---- demonstrations ------------------------------------------------------------------------------
class _Watched:
    """The env, remembering the observation it last returned (what the oracle reads)."""

    def __init__(self, env: Any):
        self.env = env
        self.obs: Observation | None = None

    async def reset(self, task: Task) -> Observation:
        self.obs = await self.env.reset(task)
        return self.obs

    async def step(self, action):
        self.obs, res = await self.env.step(action)
        return self.obs, res

    async def close(self) -> None:
        await self.env.close()


class ScriptedPolicy:
    """Stands where the InferenceClient stands in `run_episode` (same `agenerate`): answers with the
    text `choose()` gives, as the token ids the policy would emit for it."""

    def __init__(self, adapter: Any, choose: Callable[[], str], version: int = 0):
        self.adapter, self.choose, self.version = adapter, choose, version

    async def agenerate(self, input_ids, image_data=None, sampling=None, sticky_key=None, rid=None):
        from asyncwebrl.protocol import GenerationOutput

        text = self.choose()
        ids = self.adapter.assistant_turn_ids(text)
        return GenerationOutput(output_ids=ids, output_logprobs=[0.0] * len(ids),
                                output_versions=[self.version] * len(ids), text=text, finish_reason="stop",
                                prompt_tokens=len(input_ids), server="demonstration", latency_s=0.0)


def _samples_of(traj, max_new_tokens: int) -> tuple[list[TrainSample], int]:
    out, dropped = [], 0
    for s in traj.steps:
        if len(s.output_ids) > max_new_tokens:
            dropped += 1
            continue
        ts = TrainSample(prompt_ids=list(s.prompt_ids), output_ids=list(s.output_ids),
                         behave_logprobs=list(s.behave_logprobs), versions=list(s.versions), advantage=1.0,
                         pixels=list(s.pixels or []), traj_id=traj.traj_id)
        ts.validate()
        out.append(ts)
    return out, dropped


async def _play(jobs: list[tuple[Task, Callable[[_Watched], Callable[[], str]]]], env_cfg, adapter,
                max_new_tokens: int, concurrency: int, per_task: int,
                make_env: Callable[..., Any] | None) -> Demonstrations:
    """Play `jobs` (task, policy maker) through `run_episode` with `concurrency` envs of one browser pool;
    a task's remaining jobs are skipped once it has `per_task` successful demonstrations."""
    from asyncwebrl.rollout.episode import run_episode
    from asyncwebrl.web.browser import BrowserPool

    if make_env is None:
        from asyncwebrl.web.env_factory import make_env
    pool = BrowserPool(env_cfg)
    queue: asyncio.Queue = asyncio.Queue()
    for j in enumerate(jobs):
        queue.put_nowait(j)
    demos = Demonstrations(samples=[], episodes=0, attempts=0)
    found: list[tuple[int, list[TrainSample]]] = []

    def want(task: Task) -> bool:
        return demos.per_task.get(task.task_id.split("/", 1)[-1], 0) < per_task

    sampling = {"max_new_tokens": max_new_tokens}

    async def worker() -> None:
        env = _Watched(make_env(env_cfg, pool=pool))
        try:
            while not queue.empty():
                index, (task, policy_for) = queue.get_nowait()
                if not want(task):
                    continue
                policy = ScriptedPolicy(adapter, policy_for(env))
                traj = await run_episode(env, task, policy, adapter, None, sampling, env_cfg, 0,
                                         pixel_transport="object_store")
                demos.attempts += 1
                if traj.failed:  # a broken env: replace it, as the rollout workflow does
                    log.warning("demonstration episode %s failed: %s", task.group_key, traj.info.get("error"))
                    await env.close()
                    env = _Watched(make_env(env_cfg, pool=pool))
                    continue
                if not traj.success or not want(task):
                    continue
                samples, dropped = _samples_of(traj, max_new_tokens)
                demos.dropped_steps += dropped
                if samples:
                    found.append((index, samples))
                    demos.episode_of[traj.traj_id] = task.group_key
                    demos.episodes += 1
                    name = task.task_id.split("/", 1)[-1]
                    demos.per_task[name] = demos.per_task.get(name, 0) + 1
        finally:
            await env.close()

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(jobs))))))
    finally:
        await pool.close()
    demos.samples = [s for _, ss in sorted(found, key=lambda f: f[0]) for s in ss]  # job order, not finish order
    return demos


def _oracle_jobs(tasks: list[str], ws: WarmStartConfig, max_steps: int):
    from asyncwebrl.web.oracles import oracle_action

    def policy_for(task_id: str):
        return lambda env: (lambda: oracle_action(task_id, env.obs))

    jobs = []
    for k in range(ws.n_demos * MAX_ATTEMPTS_PER_DEMO):  # round-robin over tasks: early stop per task
        for i, name in enumerate(tasks):
            seed = DEMO_SEED_BASE + ws.seed * 10_000 + k * len(tasks) + i
            jobs.append((Task(f"miniwob/{name}", seed=seed, max_steps=max_steps), policy_for(name)))
    return jobs


def episodes_folder(path: str | Path) -> Path:
    """A run's episodes/ folder, given it or the run folder that holds it."""
    d = Path(path)
    return d / "episodes" if not (d / "index.jsonl").is_file() and (d / "episodes" / "index.jsonl").is_file() else d


def _recorded_jobs(tasks: list[str], ws: WarmStartConfig, max_steps: int):
    """Replays of the successful recorded episodes of `tasks` (index.jsonl order), at most n_demos*3 per task."""
    folder = episodes_folder(ws.episodes_dir or "")
    jobs, per_task = [], Counter()
    index = folder / "index.jsonl"
    for n, line in enumerate(index.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"warm_start.episodes_dir: {index} line {n} is not JSON ({e})") from None
        if not row.get("success"):
            continue
        if "dir" not in row:
            raise ValueError(f"warm_start.episodes_dir: {index} line {n} has no 'dir' (not a run's episode index)")
        doc_path = folder.parent / row["dir"] / "episode.json" if (folder.parent / row["dir"]).is_dir() \
            else folder / Path(row["dir"]).name / "episode.json"
        if not doc_path.is_file():
            log.warning("recorded episode %s has no episode.json; skipped", row.get("traj_id"))
            continue
        doc = json.loads(doc_path.read_text())
        task_id, _, seed = str(doc.get("task_id", "")).rpartition("#")
        if not task_id or not seed.isdigit() or not isinstance(doc.get("steps"), list):
            raise ValueError(f"warm_start.episodes_dir: {doc_path} has no task_id 'TASK#SEED' and steps list: an "
                             "episode the controller did not write cannot be replayed")
        name = task_id.split("/", 1)[-1]
        if name not in tasks or per_task[name] >= ws.n_demos * MAX_ATTEMPTS_PER_DEMO:
            continue
        per_task[name] += 1
        actions = [str(s.get("action_text") or "") for s in doc["steps"]]

        def policy_for(env, actions=actions):
            it = iter(actions)
            return lambda: next(it, "")  # an episode asking for more steps than recorded fails: dropped

        jobs.append((Task(f"miniwob/{name}", seed=int(seed), max_steps=max(max_steps, len(actions))), policy_for))
    return jobs


def collect_demonstrations(ws: WarmStartConfig, env_cfg, adapter, tasks: list[str], max_new_tokens: int,
                           make_env: Callable[..., Any] | None = None) -> Demonstrations:
    """Successful demonstration episodes of `tasks` (MiniWoB names), up to ws.n_demos per task, played on
    real browsers through the rollout episode loop. Runs its own event loop (call it from plain code)."""
    t0 = time.monotonic()
    if ws.source == "oracle":
        jobs = _oracle_jobs(tasks, ws, env_cfg.max_steps)
    else:
        jobs = _recorded_jobs(tasks, ws, env_cfg.max_steps)
    demos = asyncio.run(_play(jobs, env_cfg, adapter, max_new_tokens, ws.concurrency, ws.n_demos, make_env))
    demos.collect_s = time.monotonic() - t0
    short = {t: demos.per_task.get(t, 0) for t in tasks if demos.per_task.get(t, 0) < ws.n_demos}
    if short:
        log.warning("warm start: fewer than %d successful demonstrations for %s", ws.n_demos, short)
    if not demos.samples:
        raise RuntimeError(f"warm start: no successful demonstration among {demos.attempts} episodes of "
                           f"{', '.join(tasks)} (source={ws.source})")
    return demos


# ---- the update ---------------------------------------------------------------------------------
def bc_epochs(actor: Any, samples: list[TrainSample], ws: WarmStartConfig) -> list[WarmStartEpoch]:
    """`ws.epochs` passes of `FSDPActor.bc_step` over `samples` in shuffled minibatches of ws.batch_size
    (the shuffle is seeded: every rank draws the same minibatches), with a fresh AdamW at ws.lr that is
    dropped afterwards. Collective: every rank calls it with the same samples."""
    opt = actor.new_bc_optimizer(ws.lr)
    rng = random.Random(ws.seed)
    order = list(range(len(samples)))
    out: list[WarmStartEpoch] = []
    for e in range(ws.epochs):
        t0 = time.perf_counter()
        rng.shuffle(order)
        stats = [actor.bc_step([samples[i] for i in order[j:j + ws.batch_size]], optimizer=opt)
                 for j in range(0, len(order), ws.batch_size)]
        tokens = sum(st.n_tokens for st in stats)
        out.append(WarmStartEpoch(epoch=e + 1, nll=sum(st.nll * st.n_tokens for st in stats) / max(1, tokens),
                                  n_updates=len(stats), n_tokens=tokens,
                                  grad_norm=sum(st.grad_norm for st in stats) / len(stats),
                                  time_s=time.perf_counter() - t0))
    del opt
    return out


def warm_start_tasks(cfg) -> list[str]:
    """The MiniWoB task names the warm start demonstrates: warm_start.tasks, '' = env.tasks."""
    from asyncwebrl.web.tasks import resolve_task_names

    return resolve_task_names(cfg.warm_start.tasks or cfg.env.tasks)


def run_warm_start(cfg, trainer, adapter) -> WarmStartReport:
    """Collect the demonstrations (here, on this process's browsers) and clone them on the trainer
    ranks (`trainer.warm_start`, a TrainerGroup). The caller publishes the weights as version 0."""
    ws = cfg.warm_start
    demos = collect_demonstrations(ws, cfg.env, adapter, warm_start_tasks(cfg), cfg.gconfig.max_new_tokens)
    log.info("warm start: %d demonstrations (%d steps) from %d episodes in %.1f s; %s", demos.episodes,
             len(demos.samples), demos.attempts, demos.collect_s, demos.per_task)
    t0 = time.monotonic()
    epochs = trainer.warm_start(demos.samples, ws)
    return WarmStartReport(source=ws.source, demos=demos.episodes, samples=len(demos.samples),
                           attempts=demos.attempts, dropped_steps=demos.dropped_steps, per_task=demos.per_task,
                           epochs=epochs, collect_s=demos.collect_s, train_s=time.monotonic() - t0)
