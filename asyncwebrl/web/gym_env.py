"""Gymnasium wrapper: the browser environments as ordinary synchronous `gymnasium.Env`s.

Importing this module registers `asyncwebrl/miniwob-<task>-v0` for every bundled MiniWoB task
and `asyncwebrl/webgym-v0` (kwargs: task_file, task_id). Observations are dicts
{screenshot: HxWx3 uint8, instruction: str, elements: str}; actions are action TEXT in the agent
grammar (e.g. "click [3]", "type [2] [Bob]", "select [4] [Blue]", BrowserGym's "select_option('4',
'Blue')") or an already parsed action dict. `info` carries `no_effect` (the action changed nothing)
and `blocked` (connections the network fence refused, as dicts).

Gymnasium is an optional extra (`pip install 'asyncwebrl[gym]'`); without it importing this module
raises ImportError saying so.

Invariant: each wrapper owns one private event loop on a daemon thread (Playwright objects are
bound to the loop that made them); every call into it has a timeout, and `close()` stops the loop
and the browser it started.
"""

from __future__ import annotations

import dataclasses
import io
import string
from typing import Any

try:
    import gymnasium as gym
    from gymnasium import spaces
except ImportError as e:  # the optional extra
    raise ImportError("asyncwebrl.web.gym_env needs Gymnasium, an optional extra: "
                      "pip install 'asyncwebrl[gym]' (or pip install gymnasium)") from e
import numpy as np
from PIL import Image

from asyncwebrl.loop_thread import LoopThread
from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.base import Task
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.observe import elements_text

CALL_TIMEOUT_S = 120.0
_TEXT_CHARSET = string.printable


class BrowserGymEnv(gym.Env):
    """One browser session as a synchronous Gymnasium env."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, env_type: str = "miniwob", task: str = "click-button", task_file: str | None = None,
                 max_steps: int | None = None, render_mode: str | None = None, **env_overrides: Any):
        self.cfg = EnvConfig(type=env_type, task_file=task_file, **env_overrides)
        self.cfg.validate()
        self.max_steps = max_steps or self.cfg.max_steps
        self.render_mode = render_mode
        if env_type == "webgym":
            from asyncwebrl.web.webgym import load_task_file

            tasks = {t.task_id: t for t in load_task_file(task_file)}
            if task not in tasks:
                raise ValueError(f"task '{task}' is not in {task_file}; tasks: {', '.join(tasks)}")
            self._template = tasks[task]
        else:
            from asyncwebrl.web.tasks import resolve_task_names

            (name,) = resolve_task_names([task])
            self._template = Task(task_id=f"miniwob/{name}", max_steps=self.max_steps)
        h, w = self.cfg.viewport_height, self.cfg.viewport_width
        self.observation_space = spaces.Dict({
            "screenshot": spaces.Box(0, 255, (h, w, 3), np.uint8),
            "instruction": spaces.Text(max_length=4096, charset=_TEXT_CHARSET),
            "elements": spaces.Text(max_length=16384, min_length=0, charset=_TEXT_CHARSET),
        })
        self.action_space = spaces.Text(max_length=4096, charset=_TEXT_CHARSET)
        self._loop = LoopThread("asyncwebrl-gym-loop")
        self._pool = BrowserPool(self.cfg)
        from asyncwebrl.web.env_factory import make_env

        self._env = make_env(self.cfg, pool=self._pool)
        self._steps = 0
        self._last_png = b""
        self._closed = False

    def _obs(self, o) -> dict[str, Any]:
        self._last_png = o.screenshot
        img = np.asarray(Image.open(io.BytesIO(o.screenshot)).convert("RGB"), dtype=np.uint8)
        return {"screenshot": img, "instruction": o.instruction, "elements": elements_text(o.elements)}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        ep_seed = int(seed) if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        t = self._template
        task = Task(task_id=t.task_id, seed=ep_seed, max_steps=self.max_steps, instruction=t.instruction, spec=t.spec)
        o = self._loop.run(self._env.reset(task), CALL_TIMEOUT_S)
        self._steps = 0
        return self._obs(o), {"task_id": task.task_id, "seed": ep_seed, "url": o.url}

    def step(self, action: str | dict[str, Any]):
        parsed = parse_action(action) if isinstance(action, str) else action
        o, res = self._loop.run(self._env.step(parsed), CALL_TIMEOUT_S)
        self._steps += 1
        truncated = not res.done and self._steps >= self.max_steps
        info = {"success": res.success, "raw_reward": res.raw_reward, "invalid": res.invalid,
                "screenshot_unchanged": res.screenshot_unchanged, "no_effect": res.no_effect,
                "blocked": [dataclasses.asdict(b) for b in res.blocked], **res.info}
        return self._obs(o), float(res.reward), bool(res.done), truncated, info

    def render(self):
        if not self._last_png:
            return None
        return np.asarray(Image.open(io.BytesIO(self._last_png)).convert("RGB"), dtype=np.uint8)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._env.close(), 30)
            self._loop.run(self._pool.close(), 30)
        finally:
            self._loop.stop()


def _register() -> None:
    from asyncwebrl.web.tasks import miniwob_all

    entry = "asyncwebrl.web.gym_env:BrowserGymEnv"
    for name in miniwob_all():
        env_id = f"asyncwebrl/miniwob-{name}-v0"
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry, kwargs={"env_type": "miniwob", "task": name})
    if "asyncwebrl/webgym-v0" not in gym.registry:
        gym.register(id="asyncwebrl/webgym-v0", entry_point=entry, kwargs={"env_type": "webgym"})


_register()
