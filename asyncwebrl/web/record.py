"""Record real MiniWoB++ screenshots for the synthetic env to replay (`asyncwebrl record-screens DIR`).

GPU boxes have no Chromium; the synthetic env there can still show the policy real pages. This plays
oracle episodes of the tasks that have oracles (and one random click per page of the others) in
headless Chromium and writes every observed screenshot as `NNNN-TASK-sSEED-kSTEP.png`, at the
MiniWoB size (160x210) or any viewport (1280x768: the full-size pages of the WebGym setting).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.oracles import ORACLES, EpisodeOracle
from asyncwebrl.web.tasks import TaskSampler, resolve_task_names


async def record_screens(out: Path, episodes: int, tasks: str = "miniwob-easy", seed: int = 0,
                         max_steps: int = 4, width: int = 160, height: int = 210) -> list[Path]:
    from asyncwebrl.web.env_factory import make_env

    out.mkdir(parents=True, exist_ok=True)
    env_cfg = EnvConfig(type="miniwob", tasks=tasks, max_steps=max_steps, viewport_width=width, viewport_height=height)
    env_cfg.validate()
    sampler = TaskSampler(resolve_task_names(tasks), seed=seed, max_steps=max_steps)
    rng = random.Random(seed)
    env = make_env(env_cfg)
    written: list[Path] = []
    try:
        for _ in range(episodes):
            task = sampler.next()
            name = task.task_id.split("/", 1)[-1]
            obs = await env.reset(task)
            oracle = EpisodeOracle(task.task_id) if name in ORACLES else None  # keeps the episode's memory
            for k in range(max_steps):
                path = out / f"{len(written):04d}-{name}-s{task.seed}-k{k}.png"
                path.write_bytes(obs.screenshot)
                written.append(path)
                if oracle is not None:
                    text = oracle(obs)
                else:
                    text = f"mouse_click({rng.randrange(env_cfg.viewport_width)}, {rng.randrange(env_cfg.viewport_height)})"
                obs, res = await env.step(parse_action(text))
                if res.done:
                    break
    finally:
        await env.close()
    return written


def record_main(out: str, episodes: int, tasks: str, seed: int, width: int = 160, height: int = 210) -> int:
    files = asyncio.run(record_screens(Path(out), episodes, tasks, seed, width=width, height=height))
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} screenshots ({size / 1e3:.0f} kB) to {out}; "
          f"replay them with env.type=synthetic env.synthetic_replay_dir={out}")
    return 0
