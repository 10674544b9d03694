"""The synthetic web-like env: deterministic by seed, web-like lengths, action-dependent success."""

from __future__ import annotations

import asyncio
import io
import random
import statistics

import pytest
from PIL import Image

from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.synthetic import SyntheticProfile, SyntheticWebEnv

CFG = EnvConfig(type="synthetic", synthetic_step_latency_ms=0.0)


async def play(env: SyntheticWebEnv, task: Task, policy) -> tuple[list, object]:
    obs = await env.reset(task)
    seen = [obs]
    while True:
        obs, res = await env.step(policy(env, obs))
        seen.append(obs)
        if res.done:
            return seen, res


def oracle(env, obs):
    return env.oracle_action()


def wrong(env, obs):
    target = env.oracle_action()["element"]
    return {"type": "click", "element": next(e["id"] for e in obs.elements if e["id"] != target)}


def test_same_seed_same_episode_and_png_screenshots():
    task = Task("synthetic/a", seed=42, max_steps=100)
    a, ra = asyncio.run(play(SyntheticWebEnv(CFG), task, oracle))
    b, rb = asyncio.run(play(SyntheticWebEnv(CFG), task, oracle))
    assert [o.screenshot for o in a] == [o.screenshot for o in b]
    assert [o.elements for o in a] == [o.elements for o in b] and ra.success and rb.success
    img = Image.open(io.BytesIO(a[0].screenshot))
    assert img.format == "PNG" and img.size == (CFG.viewport_width, CFG.viewport_height)
    other, _ = asyncio.run(play(SyntheticWebEnv(CFG), Task("synthetic/a", seed=43, max_steps=100), oracle))
    assert other[0].screenshot != a[0].screenshot  # varied across seeds


def test_episode_lengths_are_web_like():
    env = SyntheticWebEnv(CFG)
    shapes = [env.episode_shape(Task("synthetic/len", seed=s, max_steps=1000)) for s in range(3000)]
    need = [n for n, _ in shapes]
    horizon = [h for _, h in shapes]
    assert 4.5 <= statistics.mean(need) <= 5.5  # successes take about 5 steps
    assert 11.5 <= statistics.mean(horizon) <= 13.5  # failures give up after about 12.5
    assert max(horizon) >= 3 * 12.5 and 0.02 <= sum(h > 30 for h in horizon) / len(horizon) <= 0.08  # rare long ones
    # the played episodes have exactly those lengths
    for seed in range(20):
        task = Task("synthetic/len", seed=seed, max_steps=1000)
        n, h = env.episode_shape(task)
        s, res = asyncio.run(play(env, task, oracle))
        assert res.success and len(s) - 1 == n
        f, res = asyncio.run(play(env, task, wrong))
        assert not res.success and len(f) - 1 == h
    capped = env.episode_shape(Task("synthetic/len", seed=1, max_steps=3))
    assert capped[1] <= 3  # the task's step budget caps the horizon


def test_success_depends_on_the_action_by_id_or_point():
    env = SyntheticWebEnv(CFG, SyntheticProfile(success_steps=1.0))
    task = Task("synthetic/one", seed=5, max_steps=10)
    asyncio.run(env.reset(task))
    x, y, w, h = env._target["box"]
    _, res = asyncio.run(env.step({"type": "click", "x": x + w / 2, "y": y + h / 2}))
    assert res.success and res.done and res.reward == 1.0
    asyncio.run(env.reset(task))
    _, res = asyncio.run(env.step(None))  # unparsable output: invalid, no crash
    assert res.invalid and not res.success
    _, res = asyncio.run(env.step({"type": "click", "element": 99999}))
    assert res.invalid


def test_random_policy_rarely_succeeds_but_oracle_always_does():
    env = SyntheticWebEnv(CFG)
    rng = random.Random(0)

    def rand(env, obs):
        return {"type": "click", "element": rng.choice(obs.elements)["id"]}

    wins = sum(asyncio.run(play(env, Task("synthetic/r", seed=s, max_steps=1000), rand))[1].success for s in range(40))
    assert 2 <= wins <= 32


def test_latency_and_warmup_and_replay(tmp_path):
    import time

    from asyncwebrl.web.synthetic import _draw_png

    (tmp_path / "a.png").write_bytes(_draw_png(64, 64, [], 1))
    cfg = EnvConfig(type="synthetic", synthetic_step_latency_ms=30.0)
    env = SyntheticWebEnv(cfg, SyntheticProfile(latency_sigma=0.0, warmup_ms=200, replay_dir=str(tmp_path)))
    t0 = time.monotonic()
    obs = asyncio.run(env.reset(Task("synthetic/l", seed=1)))
    assert time.monotonic() - t0 >= 0.2  # first reset pays the session warm-up
    assert obs.screenshot == (tmp_path / "a.png").read_bytes()
    t0 = time.monotonic()
    asyncio.run(env.reset(Task("synthetic/l", seed=2)))
    asyncio.run(env.step({"type": "wait"}))
    assert 0.05 <= time.monotonic() - t0 < 0.2
    with pytest.raises(ValueError, match="no \\*.png"):
        SyntheticWebEnv(cfg, SyntheticProfile(replay_dir=str(tmp_path / "empty")))
    with pytest.raises(ValueError):
        SyntheticWebEnv(cfg, SyntheticProfile(long_tail_prob=2.0))


def test_recorded_miniwob_screens_replay_through_the_config_key(tmp_path):
    """`asyncwebrl record-screens` writes real Chromium pages; env.synthetic_replay_dir shows them."""
    from asyncwebrl.config import ConfigError, load_run_config
    from asyncwebrl.web.record import record_screens

    files = asyncio.run(record_screens(tmp_path / "screens", episodes=3, tasks="click-test,click-button"))
    assert len(files) >= 3
    for f in files:
        with Image.open(f) as im:
            assert im.size == (CFG.viewport_width, CFG.viewport_height)
            assert len(set(im.convert("RGB").getdata())) > 4  # a rendered page, not a blank frame
    cfg = load_run_config(None, ["env.type=synthetic", f"env.synthetic_replay_dir={tmp_path / 'screens'}"])
    env = SyntheticWebEnv(cfg.env)
    obs = asyncio.run(env.reset(Task("synthetic/r", seed=3)))
    assert obs.screenshot in {f.read_bytes() for f in files}
    with pytest.raises(ConfigError, match="synthetic_replay_dir"):
        load_run_config(None, ["env.type=synthetic", f"env.synthetic_replay_dir={tmp_path / 'nothing'}"])
