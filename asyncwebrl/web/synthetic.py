"""A synthetic, web-like environment for tests and benchmarks of the rollout pool (no browser).

`SyntheticWebEnv` implements the same `Env` protocol as the browser envs, so it runs through the same
episode loop (rollout/episode.py: prompt, generation, per-step samples, PixelStore puts). It imitates
what matters for scheduling a web-agent pool:
- per-step latency: log-normal around `env.synthetic_step_latency_ms` (page loads have a long tail);
- episode lengths: a task needs `need` correct clicks (mean about `success_steps`), and an episode
  that does not make it gives up after a horizon of mean about `failure_steps` steps; with
  probability `long_tail_prob` the horizon is `long_tail_factor` times longer (the rare very long
  episode that stalls a synchronous pool);
- screenshots: small PNGs drawn from the element list (varied per seed and step), or recorded
  screenshots replayed from a folder;
- the web-shaped workload (env.synthetic_latency_file, env.synthetic_length_median): step, reset and
  fresh-session warm-up latencies drawn from samples measured on real Chromium (web/latency.py), and
  heavy-tailed episode lengths (log-normal, capped at env.max_steps): an episode lasts exactly its
  drawn length and succeeds when every step made progress;
- success depends on the action: each step the instruction names one target element of the element
  list; clicking it (by id or by a point inside its box) is progress, so a policy can learn it.

Invariant: everything an episode shows and how long its horizon is follow from (task_id, seed) alone:
the n_samples episodes of a GRPO group see the same task, and reruns are reproducible. Latency is
the only random quantity drawn from a separate stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncwebrl.web.base import Observation, StepResult, Task

WORDS = ["Submit", "Cancel", "Next", "Back", "Search", "Login", "Home", "Cart", "Buy", "Help",
         "Settings", "Profile", "Save", "Open", "Close", "Reply", "Share", "Delete", "Edit", "More"]
ROLES = ["button", "link", "tab", "checkbox"]


@dataclass(kw_only=True)
class SyntheticProfile:
    """Shape of the synthetic workload (the env config holds only the step latency)."""

    success_steps: float = 5.0
    """mean number of correct clicks a task needs (successful episodes are about this long)"""
    failure_steps: float = 12.5
    """mean horizon after which an episode that did not make it gives up"""
    long_tail_prob: float = 0.05
    """probability that an episode's horizon is long_tail_factor times longer"""
    long_tail_factor: float = 4.0
    """horizon multiplier of the rare very long episodes"""
    latency_sigma: float = 0.6
    """log-normal sigma of per-step latency (0 = constant latency)"""
    min_elements: int = 2
    """fewest interactive elements on a page"""
    max_elements: int = 5
    """most interactive elements on a page"""
    replay_dir: str | None = None
    """folder of recorded PNG screenshots to replay instead of drawn ones"""
    reset_latency_ms: float | None = None
    """latency of reset (page load); None = the step latency"""
    warmup_ms: float = 0.0
    """extra latency of the first reset of a fresh env (browser/session launch, what sync rounds repay)"""

    def validate(self) -> None:
        if self.success_steps < 1 or self.failure_steps < 1:
            raise ValueError("synthetic success_steps and failure_steps must be >= 1")
        if not 0 <= self.long_tail_prob <= 1:
            raise ValueError("synthetic long_tail_prob must be in [0, 1]")
        if self.long_tail_factor < 1:
            raise ValueError("synthetic long_tail_factor must be >= 1")
        if not 1 <= self.min_elements <= self.max_elements:
            raise ValueError("synthetic element counts need 1 <= min_elements <= max_elements")
        if self.latency_sigma < 0:
            raise ValueError("synthetic latency_sigma must be >= 0")


def _seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def _draw_png(width: int, height: int, elements: list[dict[str, Any]], seed: int) -> bytes:
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    bg = tuple(rng.randrange(200, 256) for _ in range(3))
    img = Image.new("RGB", (width, height), bg)
    d = ImageDraw.Draw(img)
    for el in elements:
        x, y, w, h = el["box"]
        color = tuple(rng.randrange(40, 200) for _ in range(3))
        d.rectangle([x, y, x + w, y + h], fill=color, outline=(0, 0, 0))
        d.text((x + 3, y + 2), el["name"], fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=1)
    return buf.getvalue()


class SyntheticWebEnv:
    """The synthetic web-like `Env` (see module docstring)."""

    def __init__(self, env_cfg: Any, profile: SyntheticProfile | None = None, latency_seed: int | None = None):
        self.cfg = env_cfg
        self.profile = profile or SyntheticProfile()
        self.profile.validate()
        self.width = int(getattr(env_cfg, "viewport_width", 160))
        self.height = int(getattr(env_cfg, "viewport_height", 210))
        self.coord_mode = getattr(env_cfg, "coord_mode", "pixel")
        self.step_latency_s = float(getattr(env_cfg, "synthetic_step_latency_ms", 20.0)) / 1000.0
        self._latency_rng = random.Random(latency_seed)
        self._replay: list[bytes] = []
        replay_dir = self.profile.replay_dir or getattr(env_cfg, "synthetic_replay_dir", None)
        if replay_dir:
            files = sorted(Path(replay_dir).glob("*.png"))
            if not files:
                raise ValueError(f"synthetic replay_dir {replay_dir} holds no *.png screenshots")
            self._replay = [f.read_bytes() for f in files]
        self._latencies = None
        lat_file = getattr(env_cfg, "synthetic_latency_file", None)
        if lat_file:
            from asyncwebrl.web.latency import LatencyTable

            self._latencies = LatencyTable.load(lat_file)
        self.length_median = getattr(env_cfg, "synthetic_length_median", None)
        self.length_sigma = float(getattr(env_cfg, "synthetic_length_sigma", 1.0))
        self.task: Task | None = None
        self.closed = False
        self.episodes = 0

    # -- episode shape ------------------------------------------------------------------------
    def episode_shape(self, task: Task) -> tuple[int, int]:
        """(need, horizon) of a task: correct clicks to succeed, steps before giving up."""
        rng = random.Random(_seed_of("shape", task.task_id, task.seed))
        p = self.profile
        if self.length_median is not None:
            n = max(1, round(rng.lognormvariate(math.log(self.length_median), self.length_sigma)))
            cap = task.max_steps if task.max_steps and task.max_steps > 0 else n
            n = min(n, cap)
            return n, n
        need = 1 + round(rng.expovariate(1.0 / max(p.success_steps - 1, 1e-9))) if p.success_steps > 1 else 1
        # the base horizon is set so that the mean INCLUDING the long tail is failure_steps
        base = p.failure_steps / (1 + p.long_tail_prob * (p.long_tail_factor - 1))
        horizon = max(need, round(rng.gauss(base, base * 0.2)))
        if rng.random() < p.long_tail_prob:
            horizon = round(horizon * p.long_tail_factor)
        if task.max_steps and task.max_steps > 0:
            horizon = min(horizon, task.max_steps)
        return need, max(1, horizon)

    def _page(self, step: int) -> tuple[list[dict[str, Any]], int]:
        assert self.task is not None
        rng = random.Random(_seed_of("page", self.task.task_id, self.task.seed, self._progress, step))
        n = rng.randint(self.profile.min_elements, self.profile.max_elements)
        names = rng.sample(WORDS, n)
        ids = rng.sample(range(1, 10 * n + 1), n)
        row_h = max(12, (self.height - 10) // max(n, 1) - 4)
        elements = []
        for i, (eid, name) in enumerate(zip(ids, names, strict=True)):
            w = rng.randint(self.width // 3, self.width - 10)
            x = rng.randint(2, self.width - w - 2)
            elements.append({"id": eid, "role": rng.choice(ROLES), "name": name,
                             "box": [x, 5 + i * (row_h + 4), w, row_h]})
        return elements, rng.randrange(n)

    def _observe(self, step: int) -> Observation:
        assert self.task is not None
        self._elements, t = self._page(step)
        self._target = self._elements[t]
        goal = self.task.instruction or f"Complete task {self.task.task_id}"
        instr = f"{goal}. Click '{self._target['name']}' ({self._progress}/{self._need} done)."
        if self._replay:
            png = self._replay[_seed_of("replay", self.task.seed, step) % len(self._replay)]
        else:
            png = _draw_png(self.width, self.height, self._elements, _seed_of("img", self.task.seed, step))
        return Observation(screenshot=png, instruction=instr, elements=[dict(e) for e in self._elements],
                           url=f"synthetic://{self.task.task_id}/{self.task.seed}/{step}")

    async def _latency(self, mean_s: float) -> None:
        if mean_s <= 0:
            return
        sigma = self.profile.latency_sigma
        # log-normal with the requested mean: mu = ln(mean) - sigma^2 / 2
        delay = mean_s if sigma == 0 else self._latency_rng.lognormvariate(math.log(mean_s) - sigma**2 / 2, sigma)
        await asyncio.sleep(min(delay, 50 * mean_s))

    # -- the Env protocol ---------------------------------------------------------------------
    async def reset(self, task: Task) -> Observation:
        if self.closed:
            raise RuntimeError("SyntheticWebEnv is closed")
        self.task = task
        self._need, self._horizon = self.episode_shape(task)
        self._progress = 0
        self._steps = 0
        self.episodes += 1
        reset_s = self.step_latency_s if self.profile.reset_latency_ms is None else self.profile.reset_latency_ms / 1000
        if self._latencies is not None:
            if self.episodes == 1:
                await asyncio.sleep(self._latencies.draw("warmup", self._latency_rng))
            await asyncio.sleep(self._latencies.draw("reset", self._latency_rng))
            return self._observe(0)
        if self.episodes == 1 and self.profile.warmup_ms > 0:
            await asyncio.sleep(self.profile.warmup_ms / 1000)
        await self._latency(reset_s)
        return self._observe(0)

    def _hit(self, action: dict[str, Any]) -> dict[str, Any] | None:
        if "element" in action:
            for el in self._elements:
                if str(el["id"]) == str(action["element"]):
                    return el
            return None
        if "x" in action and "y" in action:
            try:
                x, y = float(action["x"]), float(action["y"])
            except (TypeError, ValueError):
                return None
            if self.coord_mode == "norm1000":
                x, y = x * self.width / 1000.0, y * self.height / 1000.0
            for el in self._elements:
                bx, by, bw, bh = el["box"]
                if bx <= x <= bx + bw and by <= y <= by + bh:
                    return el
        return None

    async def step(self, action: dict[str, Any] | None) -> tuple[Observation, StepResult]:
        if self.task is None:
            raise RuntimeError("SyntheticWebEnv.step before reset")
        if self._latencies is not None:
            await asyncio.sleep(self._latencies.draw("step", self._latency_rng))
        else:
            await self._latency(self.step_latency_s)
        self._steps += 1
        invalid = False
        if not isinstance(action, dict) or action.get("type") not in ("click", "type", "scroll", "wait", "go_back", "answer"):
            invalid = True
        elif action.get("type") == "click":
            el = self._hit(action)
            if el is None:
                invalid = True
            elif el is self._target:
                self._progress += 1
        success = self._progress >= self._need
        done = success or self._steps >= self._horizon
        penalty = float(getattr(self.cfg, "invalid_action_penalty", 0.0)) if invalid else 0.0
        reward = (1.0 if success else 0.0) + penalty
        obs = self._observe(self._steps)
        return obs, StepResult(reward=reward, raw_reward=1.0 if success else 0.0, done=done, success=success,
                               invalid=invalid, info={"progress": self._progress, "need": self._need,
                                                      "horizon": self._horizon})

    async def close(self) -> None:
        self.closed = True

    # -- helpers for oracles and tests ---------------------------------------------------------
    def oracle_action(self) -> dict[str, Any]:
        """The action that makes progress on the current page."""
        return {"type": "click", "element": self._target["id"]}
