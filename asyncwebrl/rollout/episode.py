"""The multi-step episode loop (WebGym workflow) shared by training rollout, the synchronous
baseline, and evaluation: screenshot -> PixelStore key -> prompt -> generate -> parse -> act.

Invariants:
- Each step is its own training sample: the exact prompt ids the server saw, the generated ids,
  their behaviour logprobs and per-token weight versions (all three aligned), and the PixelStore
  keys of the screenshots in that prompt (in prompt order). A key reused by a later step's window
  is retained once more, so every occurrence in the trajectory is one reference to free.
- Each screenshot is decoded and base64-encoded once, when it enters the history window; later steps
  that show it again reuse both (the window keeps them beside its key).
- In `store` transport no pixels ride in the trajectory; in `object_store` transport they do and
  nothing is put in the store.
- The loop never raises for a bad model output (invalid step) or a broken environment/server: it
  returns the trajectory with `failed=True` and the reason in `info["error"]`, after freeing the
  pixel references it took. Cancellation frees them too and propagates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from asyncwebrl.models.vlm import decode_image, encode_image_b64
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.protocol import cache_key_of
from asyncwebrl.records import StepSample, Trajectory, new_id
from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.base import EnvCrashed, Task
from asyncwebrl.web.prompt import build_messages, short_action

log = logging.getLogger(__name__)

PIXEL_TRANSPORTS = ("store", "object_store")


@dataclass(frozen=True)
class Shot:
    """A screenshot of the history window: its store key (None in object_store transport), the PNG,
    and what the prompt and the request need of it, each made once."""

    key: str | None
    png: bytes
    image: Image.Image
    b64: str

    @classmethod
    def of(cls, key: str | None, png: bytes) -> Shot:
        return cls(key, png, decode_image(png), encode_image_b64(png))


async def run_episode(
    env: Any,
    task: Task,
    client: Any,
    adapter: Any,
    store: PixelStore | None,
    sampling: dict[str, Any],
    env_cfg: Any,
    version: int | Callable[[], int],
    pixel_transport: str = "store",
) -> Trajectory:
    """Play one episode of `task` in `env` with the policy behind `client`; returns its Trajectory.

    version: the trainer's current weight version (or a getter); used for tokens the client
    returns without per-token versions.
    """
    if pixel_transport not in PIXEL_TRANSPORTS:
        raise ValueError(f"pixel_transport must be one of {PIXEL_TRANSPORTS}, got {pixel_transport!r}")
    version_of = version if callable(version) else (lambda: version)
    traj = Trajectory(traj_id=new_id("t-"), task_id=task.group_key, steps=[], reward=0.0, start_time=time.time())
    use_store = pixel_transport == "store"
    window_k = env_cfg.history_k if env_cfg.use_screenshot else 0
    window: list[Shot] = []
    history: list[str] = []
    taken: list[str] = []  # every pixel reference this episode holds, for cleanup on failure
    gen_s = env_s = 0.0
    n_unchanged = 0
    n_slow = 0  # steps the page stalled (StepResult.slow): reported even when the episode then fails
    max_prompt = 0
    v0 = int(version_of())
    max_steps = task.max_steps if task.max_steps and task.max_steps > 0 else env_cfg.max_steps
    last = None
    try:
        t = time.monotonic()
        obs = await env.reset(task)
        env_s += time.monotonic() - t
        traj.info["instruction"] = obs.instruction  # the goal as the model read it (the episode viewer shows it)
        for _ in range(max_steps):
            if window_k > 0:
                # store calls run off the loop: a bounded store blocks on back-pressure
                key = await asyncio.to_thread(store.put, obs.screenshot) if use_store else None
                if key is not None:
                    taken.append(key)
                shot = await asyncio.to_thread(Shot.of, key, obs.screenshot)
                window = (window + [shot])[-window_k:]
                reused = [s.key for s in window[:-1] if s.key is not None]
                if reused:
                    await asyncio.to_thread(store.retain, reused)
                    taken.extend(reused)
            messages = build_messages(obs.instruction, obs.elements, history, len(window), env_cfg)
            text = adapter.chat_text(messages)
            pngs = [s.png for s in window]
            enc = await asyncio.to_thread(adapter.encode, text, [s.image for s in window])
            max_prompt = max(max_prompt, len(enc.input_ids))
            t = time.monotonic()
            out = await client.agenerate(
                enc.input_ids,
                image_data=[s.b64 for s in window],
                sampling=sampling,
                sticky_key=traj.traj_id,
                cache_key=cache_key_of(v0),  # never a prefix cached by weights older than the episode's
            )
            gen_s += time.monotonic() - t
            ids = list(out.output_ids)
            versions = list(out.output_versions) if out.output_versions else [int(version_of())] * len(ids)
            action = parse_action(out.text)
            t = time.monotonic()
            obs, res = await env.step(action)
            env_s += time.monotonic() - t
            invalid = action is None or res.invalid
            traj.steps.append(StepSample(
                prompt_ids=list(enc.input_ids),
                output_ids=ids,
                behave_logprobs=list(out.output_logprobs),
                versions=versions,
                pixel_keys=[s.key for s in window if s.key is not None] if use_store else [],
                pixels=None if use_store else list(pngs),
                action_text=out.text,
                action=action,
                invalid=invalid,
                no_effect=bool(res.no_effect) and not invalid,
                step_reward=res.reward,
            ))
            traj.n_invalid += int(invalid)
            traj.n_no_effect += int(bool(res.no_effect) and not invalid)
            n_unchanged += int(res.screenshot_unchanged)
            n_slow += int(bool(getattr(res, "slow", False)))
            history.append("" if action is None else short_action(out.text))
            last = res
            if res.done:
                break
    except asyncio.CancelledError:
        await _release(store, taken)
        raise
    except Exception as e:  # the episode broke (EnvCrashed, server failure): reported, never raised
        kind = "env_crashed" if isinstance(e, EnvCrashed) else type(e).__name__
        log.warning("episode %s of %s failed: %s: %s", traj.traj_id, task.group_key, kind, e)
        await _release(store, taken)
        for s in traj.steps:
            s.pixel_keys = []
        traj.failed = True
        traj.info["error"] = f"{kind}: {e}"
    release = getattr(client, "release", None)
    if callable(release):
        try:
            release(traj.traj_id)  # the episode's server stickiness ends with it
        except Exception:
            pass
    traj.end_time = time.time()
    traj.success = bool(last is not None and last.done and last.success) and not traj.failed
    traj.truncated = not traj.failed and not (last is not None and last.done)
    traj.raw_reward = float(last.raw_reward) if last is not None else 0.0
    traj.reward = 0.0 if traj.failed else ((1.0 if traj.success else 0.0)
                                           + env_cfg.invalid_action_penalty * traj.n_invalid
                                           + env_cfg.no_effect_penalty * traj.n_no_effect)
    traj.info.update(n_unchanged=n_unchanged, n_slow_steps=n_slow, gen_s=round(gen_s, 4), env_s=round(env_s, 4),
                     max_prompt_tokens=max_prompt, start_version=v0)
    return traj


async def _release(store: PixelStore | None, keys: list[str]) -> None:
    if not keys or store is None:
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(store.free, keys), timeout=30)
    except Exception as e:  # a dead store loses the pixels anyway; the trainer counts them missing
        log.warning("could not free %d pixel references: %s", len(keys), e)
