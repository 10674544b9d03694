"""A dead browser or renderer is detected: the episode in flight raises EnvCrashed (the episode loop
reports it failed), and the next episode runs on a relaunched browser / fresh context."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from asyncwebrl.web.base import EnvCrashed, Task
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv

pytestmark = pytest.mark.browser


def _renderers(browser_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(browser_pid).children(recursive=True)
            if any(a == "--type=renderer" for a in p.cmdline())]


def test_killed_browser_raises_envcrashed_then_relaunches(runner):
    async def go():
        pool = BrowserPool(EnvConfig())  # a private pool: the crash must not hit other tests' sessions
        env = MiniWoBEnv(EnvConfig(), pool=pool)
        try:
            await env.reset(Task("miniwob/click-test", seed=1))
            pid = pool.browser_pid()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EnvCrashed):
                for _ in range(50):  # the disconnect is noticed on the next browser call
                    await env.step({"type": "click", "element": 1})
            await env.reset(Task("miniwob/click-test", seed=2))
            _, res = await env.step({"type": "click", "element": 1})
            return pool.launches, pid, pool.browser_pid(), res
        finally:
            await env.close()
            await pool.close()

    launches, old_pid, new_pid, res = runner.run(go())
    assert launches == 2 and new_pid != old_pid
    assert res.success


def test_crashed_renderer_raises_envcrashed_and_gets_a_fresh_context(runner):
    async def go():
        pool = BrowserPool(EnvConfig())
        env = MiniWoBEnv(EnvConfig(), pool=pool)
        try:
            await env.reset(Task("miniwob/click-test", seed=1))
            old_session = env.session
            for pid in _renderers(pool.browser_pid()):
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(EnvCrashed):
                for _ in range(50):
                    await env.step({"type": "click", "element": 1})
            await env.reset(Task("miniwob/click-test", seed=2))
            _, res = await env.step({"type": "click", "element": 1})
            return pool.launches, env.session is old_session, res
        finally:
            await env.close()
            await pool.close()

    launches, same_session, res = runner.run(go())
    assert launches == 1 and not same_session
    assert res.success
