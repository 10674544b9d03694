"""The rollout workflow: one GRPO group = n_samples concurrent episodes of the same task.

`EpisodeGroupWorkflow` is the async callable the executor runs (`workflow(task, version_getter) ->
RolloutGroup`). It keeps a pool of environments: in the everlasting pool they are reused episode after
episode (no warm-up); the synchronous baseline builds a fresh workflow per round and closes it.

Invariant: a group always holds exactly n_samples trajectories; an episode that broke (environment
crash, server failure) is present as a `failed` trajectory, never silently missing, and its environment
is closed and replaced instead of being reused.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.records import RolloutGroup, Trajectory, new_id
from asyncwebrl.rollout.gate import GatedClient, ResumeGate
from asyncwebrl.web.base import Env, Task

log = logging.getLogger(__name__)

EnvFactory = Callable[[], Env | Awaitable[Env]]


class EpisodeGroupWorkflow:
    """Runs the shared episode loop (`asyncwebrl.rollout.episode.run_episode`) n_samples times at once."""

    def __init__(
        self,
        env_factory: EnvFactory,
        client: Any,
        adapter: Any,
        store: PixelStore | None,
        sampling: dict[str, Any],
        env_cfg: Any,
        n_samples: int,
        *,
        pixel_transport: str = "store",
        gate: ResumeGate | None = None,
        episode_fn: Callable[..., Awaitable[Trajectory]] | None = None,
        episode_timeout_s: float | None = None,
    ):
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if episode_fn is None:
            from asyncwebrl.rollout.episode import run_episode

            episode_fn = run_episode
        self.env_factory = env_factory
        self.client = GatedClient(client, gate) if gate is not None else client
        self.adapter = adapter
        self.store = store
        self.sampling = sampling
        self.env_cfg = env_cfg
        self.n_samples = n_samples
        self.pixel_transport = pixel_transport
        self.episode_fn = episode_fn
        self.episode_timeout_s = episode_timeout_s
        self._idle: list[Env] = []
        self._all: set[int] = set()
        self.envs_created = 0
        self.env_create_s = 0.0
        """time spent creating environments (the warm-up the everlasting pool avoids)"""

    async def _acquire(self) -> Env:
        if self._idle:
            return self._idle.pop()
        t0 = time.monotonic()
        env = self.env_factory()
        if inspect.isawaitable(env):
            env = await env
        self.env_create_s += time.monotonic() - t0
        self.envs_created += 1
        self._all.add(id(env))
        return env

    async def _discard(self, env: Env) -> None:
        self._all.discard(id(env))
        try:
            await asyncio.wait_for(env.close(), 30)
        except Exception as e:  # noqa: BLE001 - a broken env may fail to close; it is dropped anyway
            log.warning("closing a broken environment failed: %r", e)

    async def _episode(self, task: Task, version_getter: Callable[[], int]) -> Trajectory:
        env = await self._acquire()
        t0 = time.time()
        try:
            coro = self.episode_fn(
                env,
                task,
                self.client,
                self.adapter,
                self.store,
                self.sampling,
                self.env_cfg,
                version_getter,
                self.pixel_transport,
            )
            traj = await (asyncio.wait_for(coro, self.episode_timeout_s) if self.episode_timeout_s else coro)
        except asyncio.CancelledError:
            await self._discard(env)
            raise
        except Exception as e:  # noqa: BLE001 - the episode failed; report it, replace the env
            await self._discard(env)
            log.warning("episode of %s failed: %s: %s", task.group_key, type(e).__name__, e)
            return Trajectory(
                traj_id=new_id("t-"),
                task_id=task.group_key,
                steps=[],
                reward=0.0,
                failed=True,
                start_time=t0,
                end_time=time.time(),
                info={"error": f"{type(e).__name__}: {e}"},
            )
        if traj.failed:
            await self._discard(env)
        else:
            self._idle.append(env)
        return traj

    async def __call__(self, task: Task, version_getter: Callable[[], int]) -> RolloutGroup:
        trajs = await asyncio.gather(*(self._episode(task, version_getter) for _ in range(self.n_samples)))
        return RolloutGroup(group_id=new_id("g-"), task_id=task.group_key, trajectories=list(trajs))

    async def aclose(self) -> None:
        envs, self._idle = self._idle, []
        for env in envs:
            await self._discard(env)
        closer = getattr(self.client, "aclose", None)  # the client's HTTP sessions live in this loop
        if closer is not None:
            try:
                await asyncio.wait_for(closer(), 10)
            except Exception as e:  # noqa: BLE001
                log.warning("closing the inference client failed: %r", e)


_ADAPTERS: dict[str, Any] = {}


def cached_adapter(path: str) -> Any:
    """One VLMAdapter per model path per process (tokenizer + image processor load once)."""
    if path not in _ADAPTERS:
        from asyncwebrl.models.vlm import VLMAdapter

        _ADAPTERS[path] = VLMAdapter(path)
    return _ADAPTERS[path]


@dataclass
class EpisodeRolloutSpec:
    """A picklable recipe for rollout workers: the real episode loop over envs made from `env_cfg`.

    Passes as the `RolloutSpec` of hosts.py (it has make_workflow / make_tasks). `client_factory`
    builds the inference client inside the worker (e.g. `lambda: InferenceClient(addresses)`);
    `store` is a PixelStore client (picklable for Ray) or None in object_store transport.
    """

    env_cfg: Any
    model_path: str
    client_factory: Callable[[], Any]
    store: PixelStore | None
    sampling: dict[str, Any]
    n_samples: int
    task_factory: Callable[[int], Any]
    """worker index -> task stream"""
    pixel_transport: str = "store"
    env_factory: Callable[[Any], Any] | None = None
    """env_cfg -> Env; default asyncwebrl.web.env_factory.make_env"""
    episode_timeout_s: float | None = None

    def make_workflow(self, index: int, gate: ResumeGate) -> EpisodeGroupWorkflow:
        make = self.env_factory
        if make is None:
            from asyncwebrl.web.env_factory import make_env as make
        env_cfg = self.env_cfg
        return EpisodeGroupWorkflow(lambda: make(env_cfg), self.client_factory(), cached_adapter(self.model_path),
                                    self.store, self.sampling, env_cfg, self.n_samples,
                                    pixel_transport=self.pixel_transport, gate=gate,
                                    episode_timeout_s=self.episode_timeout_s)

    def make_tasks(self, index: int) -> Any:
        return self.task_factory(index)
