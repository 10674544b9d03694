"""The shortcut baseline: the best constant-action policy's success on the evaluation episodes.

A policy that answers every page the same way does not read the page. Two families of such policies
are played on the evaluation set: `click [k]` for each id k the pages show, and "click the first
element of role R" (the first button, the first link, the first textbox ..., and the first listed
element of any role) for each role the pages show. Each repeats its action at every step of the
episode. The best of them is `shortcut_baseline`; an evaluation reports its own success beside it, and
`gain_over_shortcut` = success - shortcut_baseline is what reading the page adds.

Invariants: the baseline runs the very (task, seed) pairs of the evaluation set, through the same env
kind and config (the same element ids, drawn or in document order), so it is paired with the greedy
figure; it depends on no model and no version, so it is computed once per evaluation set; a
policy is scored over every episode (an episode it cannot act on, or that broke, counts as failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncwebrl.web.base import Task

log = logging.getLogger(__name__)

CONTEXT_EPISODES = 50
"""MiniWoB episodes one browser context serves while the baseline plays: a fresh context per episode
(the rollout default) costs 0.3-1 s, and a constant policy's short episodes store nothing a later one
reads (a MiniWoB task is one static page)"""
ANY_ROLE = "element"
"""the role name of the "first listed element" policy"""


@dataclass(kw_only=True)
class ShortcutBaseline:
    """Success of the constant-action policies on one evaluation set."""

    success_rate: float
    """success of the best constant policy (the shortcut baseline)"""
    policy: str
    """the best policy: 'click [k]' or 'first ROLE'"""
    per_policy: dict[str, float] = field(default_factory=dict)
    """success of every constant policy played"""
    n_episodes: int = 0
    """evaluation episodes each policy played"""
    failed_episodes: int = 0
    """episodes whose env broke (counted failed)"""
    seconds: float = 0.0
    """wall time of the baseline"""


def _first_of(role: str) -> Callable[[list[dict[str, Any]]], dict[str, Any] | None]:
    def act(elements: list[dict[str, Any]]) -> dict[str, Any] | None:
        for e in elements:  # the list is in document order, whatever the ids
            if role == ANY_ROLE or e.get("role") == role:
                return {"type": "click", "element": e["id"]}
        return None  # nothing of that role on the page: an invalid step, as for a model
    return act


def _click(k: int) -> Callable[[list[dict[str, Any]]], dict[str, Any] | None]:
    return lambda elements: {"type": "click", "element": k}


async def _play(env, task: Task, policy: Callable[[list[dict[str, Any]]], dict[str, Any] | None]) -> bool:
    obs = await env.reset(task)
    for _ in range(max(1, task.max_steps)):
        obs, res = await env.step(policy(obs.elements))
        if res.done:
            return bool(res.success)
    return False


async def shortcut_baseline(tasks: list[Task], env_cfg, env_factory: Callable[[], Any] | None = None, *,
                            concurrency: int = 2) -> ShortcutBaseline:
    """Play every constant policy on every task of `tasks` (an evaluation set) and return the best.

    env_factory: builds one environment (default: `make_env` of `env_cfg`, with MiniWoB contexts
    serving CONTEXT_EPISODES episodes). The policies are those the first observations admit: `click [k]`
    for k up to the most elements one of them lists, `first ROLE` for every role they list."""
    import time

    from asyncwebrl.web.env_factory import make_env

    if not tasks:
        raise ValueError("shortcut_baseline needs the evaluation tasks (got none)")
    if env_factory is None:
        cfg = env_cfg
        if env_cfg.type == "miniwob":
            cfg = dataclasses.replace(env_cfg, recycle_context_every=max(env_cfg.recycle_context_every,
                                                                         CONTEXT_EPISODES))
        env_factory = lambda: make_env(cfg)  # noqa: E731
    t0 = time.monotonic()
    firsts: dict[int, list[dict[str, Any]]] = {}
    # every (policy, episode) job; episode i's first reset also tells which policies exist
    jobs: asyncio.Queue = asyncio.Queue()
    for i in range(len(tasks)):
        jobs.put_nowait(("probe", i))
    wins: dict[str, list[bool]] = {}
    failed = 0

    async def worker() -> None:
        nonlocal failed
        env = env_factory()
        try:
            while True:
                try:
                    name, i = jobs.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    if name == "probe":
                        obs = await env.reset(tasks[i])
                        firsts[i] = [dict(e) for e in obs.elements]
                        continue
                    ok = await _play(env, tasks[i], _policy(name))
                except Exception as e:  # a broken env: the episode counts failed, the env is replaced
                    failed += 1
                    log.warning("shortcut baseline: %s on %s failed: %s", name, tasks[i].group_key, e)
                    ok = False
                    await env.close()
                    env = env_factory()
                if name != "probe":
                    wins.setdefault(name, []).append(ok)
        finally:
            await env.close()

    n_workers = max(1, min(concurrency, len(tasks)))
    await asyncio.gather(*(worker() for _ in range(n_workers)))
    max_k = max((len(els) for els in firsts.values()), default=0)
    roles = sorted({e.get("role") for els in firsts.values() for e in els if isinstance(e.get("role"), str)})
    names = [f"click [{k}]" for k in range(1, max_k + 1)] + [f"first {r}" for r in [ANY_ROLE, *roles]]
    for name in names:
        for i in range(len(tasks)):
            if name.startswith("click [") and int(name[7:-1]) > len(firsts.get(i, [])):
                wins.setdefault(name, []).append(False)  # no such element on the page: invalid every step
            else:
                jobs.put_nowait((name, i))
    await asyncio.gather(*(worker() for _ in range(n_workers)))
    per_policy = {name: sum(wins.get(name, [])) / len(tasks) for name in names}
    best = max(names, key=lambda n: per_policy[n], default="")
    return ShortcutBaseline(success_rate=per_policy.get(best, 0.0), policy=best, per_policy=per_policy,
                            n_episodes=len(tasks), failed_episodes=failed, seconds=time.monotonic() - t0)


def _policy(name: str) -> Callable[[list[dict[str, Any]]], dict[str, Any] | None]:
    if name.startswith("click ["):
        return _click(int(name[7:-1]))
    return _first_of(name.removeprefix("first "))


def shortcut_figures(success_rate: float, base: ShortcutBaseline | None, prefix: str = "") -> dict[str, Any]:
    """The baseline's entries of an evaluation record: `shortcut_baseline`, `shortcut_policy`,
    `gain_over_shortcut` (with `prefix`, e.g. 'heldout_'); none without a baseline."""
    if base is None:
        return {}
    return {f"{prefix}shortcut_baseline": base.success_rate, f"{prefix}shortcut_policy": base.policy,
            f"{prefix}gain_over_shortcut": success_rate - base.success_rate}
