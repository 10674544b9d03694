"""Demonstrations for the warm start: scripted episodes played by the rollout's own episode loop.

A scripted policy stands where the inference client stands in `run_episode` (same `agenerate`): a
MiniWoB oracle (`web.oracles`) reading the observation the env just returned, or the replay of a
recorded episode's action texts (a run's `episodes/` folder, replayed on its task and seed). So each
step's prompt ids are built exactly as rollout builds them (`web.prompt.build_messages`, the chat
template, `VLMAdapter.encode` with the screenshot), and the target ids are what the policy would emit for
the demonstrated action: `VLMAdapter.assistant_turn_ids`, the action text through the end-of-turn token
generation stops on. The trainer receives the result as `TrainSample`s (`training.warm_start` clones them).

Invariants:
- only successful episodes become demonstrations; every step of one is a `TrainSample` carrying its
  screenshots inline (object_store transport: nothing enters a PixelStore);
- a step whose target is longer than gconfig.max_new_tokens is dropped and counted (rollout would cut
  it before its end-of-turn token: the policy could never emit it whole).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.models.vlm import VLMAdapter
from asyncwebrl.protocol import GenerationOutput
from asyncwebrl.records import TrainSample
from asyncwebrl.rollout.episode import run_episode
from asyncwebrl.web.base import Observation, Task
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.env_factory import make_env as default_make_env
from asyncwebrl.web.oracles import EpisodeOracle

log = logging.getLogger(__name__)

DEMO_SEED_BASE = 2_000_000
"""demonstration episode seeds start here: disjoint from evaluation (1_000_000 + i) and training seeds"""
MAX_ATTEMPTS_PER_DEMO = 3


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

    async def agenerate(self, input_ids, image_data=None, sampling=None, sticky_key=None, rid=None, cache_key=None):
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
    make_env = make_env or default_make_env
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


def _oracle_jobs(tasks: list[str], n_demos: int, seed: int, max_steps: int):
    def policy_for(task_id: str):
        def one_episode(env: _Watched) -> Callable[[], str]:
            oracle = EpisodeOracle(task_id)  # a fresh memory per episode, as the policy's history is
            return lambda: oracle(env.obs)
        return one_episode

    jobs = []
    for k in range(n_demos * MAX_ATTEMPTS_PER_DEMO):  # round-robin over tasks: early stop per task
        for i, name in enumerate(tasks):
            episode_seed = DEMO_SEED_BASE + seed * 10_000 + k * len(tasks) + i
            jobs.append((Task(f"miniwob/{name}", seed=episode_seed, max_steps=max_steps), policy_for(name)))
    return jobs


def episodes_folder(path: str | Path) -> Path:
    """A run's episodes/ folder, given it or the run folder that holds it."""
    d = Path(path)
    return d / "episodes" if not (d / "index.jsonl").is_file() and (d / "episodes" / "index.jsonl").is_file() else d


def _recorded_jobs(tasks: list[str], episodes_dir: str | None, n_demos: int, max_steps: int):
    """Replays of the successful recorded episodes of `tasks` (index.jsonl order), at most n_demos*3 per task."""
    folder = episodes_folder(episodes_dir or "")
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
        if name not in tasks or per_task[name] >= n_demos * MAX_ATTEMPTS_PER_DEMO:
            continue
        per_task[name] += 1
        actions = [str(s.get("action_text") or "") for s in doc["steps"]]

        def policy_for(env, actions=actions):
            it = iter(actions)
            return lambda: next(it, "")  # an episode asking for more steps than recorded fails: dropped

        jobs.append((Task(f"miniwob/{name}", seed=int(seed), max_steps=max(max_steps, len(actions))), policy_for))
    return jobs


def collect_demonstrations(env_cfg: EnvConfig, adapter: VLMAdapter, tasks: list[str], max_new_tokens: int, *,
                           source: str = "oracle", n_demos: int = 10, seed: int = 7, concurrency: int = 2,
                           episodes_dir: str | None = None,
                           make_env: Callable[..., Any] | None = None) -> Demonstrations:
    """Successful demonstration episodes of `tasks` (MiniWoB names), up to n_demos per task, played on
    real browsers through the rollout episode loop. Runs its own event loop (call it from plain code)."""
    t0 = time.monotonic()
    if source == "oracle":
        jobs = _oracle_jobs(tasks, n_demos, seed, env_cfg.max_steps)
    elif source == "episodes":
        jobs = _recorded_jobs(tasks, episodes_dir, n_demos, env_cfg.max_steps)
    else:
        raise ValueError(f"demonstration source must be 'oracle' or 'episodes', not {source!r}")
    demos = asyncio.run(_play(jobs, env_cfg, adapter, max_new_tokens, concurrency, n_demos, make_env))
    demos.collect_s = time.monotonic() - t0
    short = {t: demos.per_task.get(t, 0) for t in tasks if demos.per_task.get(t, 0) < n_demos}
    if short:
        log.warning("warm start: fewer than %d successful demonstrations for %s", n_demos, short)
    if not demos.samples:
        raise RuntimeError(f"warm start: no successful demonstration among {demos.attempts} episodes of "
                           f"{', '.join(tasks)} (source={source})")
    return demos
