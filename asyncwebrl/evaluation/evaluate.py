"""Evaluation episodes: a fixed, paired set of (task, seed) pairs run greedily through the same
episode loop as training, so success rates of different versions are comparable.

Used by the TestRolloutManager (on every new checkpoint) and by `asyncwebrl eval`.
Invariant: the evaluation set depends only on (task names, n_episodes, seed base), never on time or
on which version is evaluated.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.web.base import Task

log = logging.getLogger(__name__)
EVAL_SEED_BASE = 1_000_000  # disjoint from training seeds


def eval_tasks(task_names: list[str], n_episodes: int, max_steps: int) -> list[Task]:
    """n_episodes tasks spread round-robin over the task names, with fixed seeds."""
    return [
        Task(task_id=task_names[i % len(task_names)], seed=EVAL_SEED_BASE + i, max_steps=max_steps)
        for i in range(n_episodes)
    ]


def eval_task_sets(cfg) -> tuple[list[Task], list[Task]]:
    """(training-task set, held-out set) the test rollout evaluates, from the run config.

    test_rollout.tasks '' = the training tasks. MiniWoB: subset or task names; WebGym: ids from the task
    file ('' = every task of it); synthetic: names. Held-out tasks are MiniWoB tasks, disjoint from
    env.tasks (RunConfig.validate checks it); other env types ignore them.
    """
    import dataclasses

    from asyncwebrl.web.tasks import resolve_task_names

    n, max_steps = cfg.test_rollout.n_episodes, cfg.env.max_steps
    if cfg.test_rollout.heldout_tasks.strip() and cfg.env.type != "miniwob":
        log.info("test_rollout.heldout_tasks names MiniWoB tasks; ignored for env.type=%s", cfg.env.type)
    if cfg.env.type == "webgym":
        from asyncwebrl.web.webgym import load_task_file

        templates = {t.task_id: t for t in load_task_file(cfg.env.task_file)}
        want = [x.strip() for x in cfg.test_rollout.tasks.split(",") if x.strip()] or list(templates)
        unknown = [w for w in want if w not in templates]
        if unknown:
            raise ValueError(f"test_rollout.tasks names ids not in {cfg.env.task_file}: {unknown}")
        tasks = [dataclasses.replace(templates[want[i % len(want)]], seed=EVAL_SEED_BASE + i) for i in range(n)]
        return tasks, []
    spec = cfg.test_rollout.tasks or cfg.env.tasks
    if cfg.env.type == "miniwob":
        tasks = eval_tasks(resolve_task_names(spec), n, max_steps)
    else:
        tasks = eval_tasks([x.strip() for x in spec.split(",") if x.strip()], n, max_steps)
    heldout: list[Task] = []
    if cfg.test_rollout.heldout_tasks.strip() and cfg.env.type == "miniwob":
        heldout = eval_tasks(resolve_task_names(cfg.test_rollout.heldout_tasks),
                             cfg.test_rollout.heldout_n_episodes or n, max_steps)
    if cfg.env.type == "miniwob":
        for t in tasks + heldout:
            if not t.task_id.startswith("miniwob/"):
                t.task_id = "miniwob/" + t.task_id
    return tasks, heldout


async def run_eval_episodes(tasks: list[Task], env_factory, client, adapter, store: PixelStore | None, env_cfg,
                            sampling: dict[str, Any], version: int, concurrency: int = 4) -> dict[str, Any]:
    """Run the tasks with `concurrency` environments; returns success/reward figures and per-task rates."""
    from asyncwebrl.rollout.episode import run_episode

    queue: asyncio.Queue[Task] = asyncio.Queue()
    for t in tasks:
        queue.put_nowait(t)
    results: list[tuple[Task, Any]] = []
    failures = 0

    async def worker() -> None:
        nonlocal failures
        env = await _make(env_factory)
        try:
            while True:
                try:
                    task = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    traj = await run_episode(env, task, client, adapter, store, sampling, env_cfg, version,
                                             pixel_transport="store")
                    results.append((task, traj))
                    if store is not None:
                        store.free(traj.all_pixel_keys())
                except Exception as e:  # counted, never fatal to the evaluation
                    failures += 1
                    log.warning("eval episode %s failed: %s", task.group_key, e)
                    await env.close()
                    env = await _make(env_factory)
        finally:
            await env.close()

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(tasks))))))
    per_task: dict[str, list[float]] = defaultdict(list)
    for task, traj in results:
        per_task[task.task_id].append(1.0 if traj.success else 0.0)
    n = len(results)
    return {
        "version": version,
        "n_episodes": n,
        "failed_episodes": failures,
        "success_rate": sum(1.0 for _, t in results if t.success) / n if n else 0.0,
        "reward_mean": sum(t.reward for _, t in results) / n if n else 0.0,
        "invalid_rate": (sum(t.n_invalid for _, t in results) / max(1, sum(len(t.steps) for _, t in results))),
        "per_task": {k: sum(v) / len(v) for k, v in sorted(per_task.items())},
    }


async def _make(env_factory):
    env = env_factory()
    if asyncio.iscoroutine(env) or isinstance(env, asyncio.Future):
        env = await env
    return env


def evaluate_model(cfg, model: str, version: int = -1) -> dict[str, Any]:
    """Start one embedded server on `model` (a model folder or a checkpoint), run the evaluation set of
    the run config (`eval_task_sets`: test_rollout.tasks, n_episodes, greedy at test_rollout.temperature)
    and, if any, the held-out set (under "heldout"); stop the server. The figures of `run_eval_episodes`,
    each set with its shortcut baseline (`evaluation.shortcut`) unless test_rollout.shortcut_baseline
    is off."""
    from asyncwebrl.evaluation.shortcut import shortcut_baseline, shortcut_figures
    from asyncwebrl.inference.client import InferenceClient
    from asyncwebrl.models.vlm import VLMAdapter
    from asyncwebrl.pixelstore.store import InProcessPixelStore
    from asyncwebrl.scheduling.servers import launch_server
    from asyncwebrl.web.tasks import make_env

    server = launch_server(model=model, dtype=cfg.inference.dtype, api_key=cfg.inference.api_key,
                           max_context_len=cfg.inference.max_context_len,
                           startup_timeout=cfg.inference.startup_timeout_s)
    try:
        adapter = VLMAdapter(model)
        client = InferenceClient([server.address], api_key=server.api_key)
        tasks, held = eval_task_sets(cfg)
        sampling = eval_sampling(cfg, adapter)

        async def run_sets() -> dict[str, Any]:
            from asyncwebrl.web.browser import BrowserPool

            pool = BrowserPool(cfg.env)  # one browser for both sets, closed with this loop
            try:
                figures = await run_eval_episodes(tasks, lambda: make_env(cfg.env, pool=pool), client, adapter,
                                                  InProcessPixelStore("eval"), cfg.env, sampling, version=version)
                if held:
                    figures["heldout"] = await run_eval_episodes(held, lambda: make_env(cfg.env, pool=pool), client,
                                                                 adapter, InProcessPixelStore("eval"), cfg.env,
                                                                 sampling, version=version)
                if cfg.test_rollout.shortcut_baseline:
                    for part, part_tasks in ((figures, tasks), (figures.get("heldout"), held)):
                        if part is not None:
                            base = await shortcut_baseline(part_tasks, cfg.env)
                            part.update(shortcut_figures(part["success_rate"], base))
                return figures
            finally:
                await client.aclose()  # its HTTP session lives in this loop
                await pool.close()

        figures = asyncio.run(run_sets())
    finally:
        server.stop()
    return figures


def eval_main(cfg, checkpoint: str | None) -> int:
    """`asyncwebrl eval`: the evaluation set of test_rollout.tasks on the checkpoint (or actor.path),
    printed as JSON."""
    import json

    from asyncwebrl.models.prepare import resolve_model_path

    print(json.dumps(evaluate_model(cfg, checkpoint or resolve_model_path(cfg.actor.path)), indent=2))
    return 0


def eval_sampling(cfg, adapter) -> dict[str, Any]:
    return {
        "max_new_tokens": cfg.gconfig.max_new_tokens,
        "temperature": cfg.test_rollout.temperature,
        "top_p": 1.0,
        "stop_token_ids": adapter.eos_token_ids,
    }
