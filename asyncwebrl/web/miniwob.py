"""MiniWoB++ tasks in a real browser: the `miniwob` package's HTML served on loopback, seeded
episodes started through the task's own JS, reward and done read from the WOB globals.

Invariants: equal (task, seed) give the same episode (`Math.seedrandom(seed)` before
`core.startEpisodeReal()`); the real-time limit is `env.episode_time_limit_s`, not the stock 10 s;
`StepResult.reward` is binary success (raw reward > 0, the MiniWoB convention) and `raw_reward`
is the task's own reward before its time discount.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import threading
from pathlib import Path
from typing import Any

from asyncwebrl.net import LOOPBACK
from asyncwebrl.web.actions import act
from asyncwebrl.web.base import EnvCrashed, Observation, StepResult, Task
from asyncwebrl.web.browser import BrowserPool, BrowserSession, EpisodeBudget, NavigationPolicy
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.fence import BlockedRequest
from asyncwebrl.web.observe import (
    MAX_ELEMENTS,
    assign_ids,
    clean_elements,
    draw_set_of_marks,
    observation_key,
    settle,
    settle_quiet_ms,
    take_screenshot,
)
from asyncwebrl.web.pageread import PageReadError


def miniwob_html_dir() -> Path:
    import miniwob

    d = Path(miniwob.__file__).parent / "html"
    if not (d / "miniwob").is_dir():
        raise FileNotFoundError(f"the miniwob package has no bundled HTML under {d}; reinstall `miniwob`")
    return d


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a browser that cancels a load (blocked navigation, closed page) is not an error here


class StaticServer:
    """A static file server on loopback (ephemeral port) in a daemon thread: the browser that loads the
    tasks runs in the same process (same node), so loopback always reaches it."""

    def __init__(self, root: Path):
        self.root = Path(root)
        handler = functools.partial(_QuietHandler, directory=str(self.root))
        self.httpd = _Server((LOOPBACK, 0), handler)
        self.port = self.httpd.server_address[1]
        self.origin = f"http://{LOOPBACK}:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"static-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


_servers: dict[str, StaticServer] = {}
_servers_lock = threading.Lock()


def static_server(root: Path) -> StaticServer:
    """The process's one server for `root`, started on first use."""
    key = str(Path(root).resolve())
    with _servers_lock:
        srv = _servers.get(key)
        if srv is None:
            srv = _servers[key] = StaticServer(Path(key))
        return srv


def miniwob_server() -> StaticServer:
    return static_server(miniwob_html_dir())


# The reward HUD sits right of the 160 px task area and would make the page scroll sideways in a
# task-sized viewport (jQuery dialogs then land off screen), so it is hidden.
_START_JS = """([seed, maxMs]) => {
  if (!document.getElementById('awr-style')) {
    const st = document.createElement('style');
    st.id = 'awr-style';
    st.textContent = '#reward-display { display: none !important; } html, body { overflow: hidden !important; }';
    document.head.appendChild(st);
  }
  window.scrollTo(0, 0);
  core.EPISODE_MAX_TIME = maxMs;
  Math.seedrandom(seed);
  core.startEpisodeReal();
  window.scrollTo(0, 0);
  return WOB_TASK_READY;
}"""



def _state_expression(max_n: int) -> str:
    """One round trip per observation: the WOB globals (they live in the page's main world) and the
    element list, read by `PageReader.main_world`: the value is copied out by V8, not by the page's
    JSON.stringify, so a page that patched JSON (or Boolean, or Array.prototype) cannot bend it."""
    return ("({done: WOB_DONE_GLOBAL, reward: WOB_REWARD_GLOBAL, raw: WOB_RAW_REWARD_GLOBAL, "
            "reason: WOB_REWARD_REASON, utterance: core.getUtterance(), ready: WOB_TASK_READY, "
            f"elements: window.__awr ? window.__awr.elements({int(max_n)}) : [], "
            "changes: window.__awr ? window.__awr.changes() : -1})")


def _number(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def task_name(task_id: str) -> str:
    return task_id.split("/", 1)[1] if task_id.startswith("miniwob/") else task_id


class MiniWoBEnv:
    """One browser session playing MiniWoB episodes (implements asyncwebrl.web.base.Env)."""

    def __init__(self, env_cfg: EnvConfig | None = None, pool: BrowserPool | None = None):
        self.cfg = env_cfg or EnvConfig()
        self._pool = pool
        self.session: BrowserSession | None = None
        self.server = miniwob_server()
        self.task: Task | None = None
        self._elements: list[dict[str, Any]] = []
        self._last_png = b""
        self._instruction = ""
        self._done = True
        self.steps = 0
        self._pending_blocked: list[BlockedRequest] = []
        """fence records from the reset, reported with the first step"""
        self._changes = -1
        """the page's change count at the last observation (see observe.RUNTIME_JS)"""
        self.budget = EpisodeBudget(self.cfg)
        """the episode's env wall time (env.episode_timeout_s)"""
        self._observations = 0
        """observations taken in this episode (the drawn element ids are seeded from it)"""

    @property
    def pool(self) -> BrowserPool:
        if self._pool is None:
            self._pool = BrowserPool.shared(self.cfg)
        return self._pool

    def task_url(self, task: Task) -> str:
        name = task_name(task.task_id)
        if not (self.server.root / "miniwob" / f"{name}.html").is_file():
            raise ValueError(f"unknown MiniWoB task '{name}' (see asyncwebrl.web.tasks.MINIWOB_ALL)")
        return f"{self.server.origin}/miniwob/{name}.html"

    async def reset(self, task: Task) -> Observation:
        url = self.task_url(task)
        self.budget.start()
        obs, _ = await self.budget.run(self._reset(task, url), self.cfg.reset_timeout_s,
                                       f"reset of {task.task_id}", lambda: self.session)
        return obs

    async def _reset(self, task: Task, url: str) -> Observation:
        self.session = await self.pool.acquire(self.session, self.cfg)
        s = self.session
        s.policy = NavigationPolicy([self.server.origin])
        try:
            if s.page.url != url:
                await s.page.goto(url, wait_until="load", timeout=30_000)
            ready = await s.page.evaluate(_START_JS, [task.seed, int(self.cfg.episode_time_limit_s * 1000)])
            for _ in range(100):
                if ready:
                    break
                await asyncio.sleep(0.05)
                ready = await s.page.evaluate("WOB_TASK_READY")
            else:
                raise EnvCrashed(f"MiniWoB task {task.task_id} did not become ready")
            self._pending_blocked = s.take_blocked()
            s.take_navigations()
            s.episodes += 1
            self.task, self._done, self.steps, self._observations = task, False, 0, 0
            await settle(s.page, self.cfg.settle_quiet_ms, self.cfg.settle_max_ms, "WOB_DONE_GLOBAL")
            obs, _ = await self._observe()
            self._last_png = obs.screenshot
        except EnvCrashed:
            raise
        except Exception as e:
            if not s.alive():
                raise EnvCrashed(f"browser died while starting {task.task_id}: {e}") from e
            raise
        return obs

    async def _observe(self) -> tuple[Observation, dict[str, Any]]:
        page = self.session.page
        state = await self.session.reader.main_world(
            _state_expression(MAX_ELEMENTS if self.cfg.element_list or self.cfg.set_of_marks else 0), "task state")
        if not isinstance(state, dict):
            raise PageReadError(f"the MiniWoB state read back as {str(state)[:100]}")
        png = await take_screenshot(page)
        self._elements = assign_ids(clean_elements(state.get("elements")), self.cfg.element_ids,
                                    observation_key(self.task.task_id, self.task.seed, self._observations))
        self._observations += 1
        self._changes = state["changes"] if isinstance(state.get("changes"), int) else -1
        if not state.get("done") and isinstance(state.get("utterance"), str):
            self._instruction = state["utterance"]
        if self.cfg.set_of_marks:
            png = draw_set_of_marks(png, self._elements)
        obs = Observation(screenshot=png, instruction=self._instruction, elements=self._elements, url=page.url)
        return obs, state

    async def step(self, action: dict[str, Any] | None) -> tuple[Observation, StepResult]:
        if self.session is None or self.task is None:
            raise RuntimeError("step() before reset()")
        (obs, res), seconds = await self.budget.run(self._step(action), self.cfg.step_timeout_s,
                                                    f"step of {self.task.task_id}", lambda: self.session)
        res.step_s, res.slow = seconds, seconds >= self.cfg.slow_step_s
        return obs, res

    async def _step(self, action: dict[str, Any] | None) -> tuple[Observation, StepResult]:
        s = self.session
        prev_png, prev_changes, prev_url = self._last_png, self._changes, s.page.url
        was_done = self._done
        info: dict[str, Any] = {}
        executed = False
        try:
            if action is not None and action.get("type") == "go_back" and not self._done:
                # a MiniWoB task is one page: going back leaves it (to about:blank) and strands the agent
                executed, info = False, {"error": "a MiniWoB task is a single page: there is nothing to go back to"}
            else:
                executed, info = await act(s.page, action, self._elements, self.cfg, episode_done=self._done)
            if executed and not self._done:
                await settle(s.page, settle_quiet_ms(self.cfg, action), self.cfg.settle_max_ms, "WOB_DONE_GLOBAL")
            if action is not None and not self._done and self.cfg.action_settle_ms > 0:
                await asyncio.sleep(self.cfg.action_settle_ms / 1000)
            obs, state = await self._observe()
        except EnvCrashed:
            raise
        except Exception as e:
            if not s.alive():
                raise EnvCrashed(f"browser died during {self.task.task_id}: {e}") from e
            info["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            obs, state = await self._observe_or_crash()
            executed = False
        blocked, self._pending_blocked = self._pending_blocked + s.take_blocked(), []
        s.take_navigations()
        self.steps += 1
        done = state.get("done") is True or was_done
        raw = _number(state.get("raw")) if done and not was_done else 0.0
        success = done and raw > 0
        self._done = self._done or done
        self._last_png = obs.screenshot
        no_effect = (executed and not done and action["type"] in ("click", "type", "select", "scroll")
                     and state.get("changes") == prev_changes and obs.url == prev_url and obs.screenshot == prev_png)
        if no_effect:
            info.setdefault("error", "the action changed nothing on the page")
        elif not executed and action is not None and action.get("type") == "type" and "drop-down" in info.get("error", ""):
            no_effect = True
        res = StepResult(
            reward=1.0 if success else 0.0, raw_reward=raw, done=done, success=success,
            invalid=not executed, screenshot_unchanged=obs.screenshot == prev_png, blocked=blocked,
            no_effect=no_effect,
            info={**info, "discounted_reward": _number(state.get("reward")) if done and not was_done else 0.0,
                  "reason": state.get("reason") if isinstance(state.get("reason"), str | None) else None},
        )
        return obs, res

    async def _observe_or_crash(self) -> tuple[Observation, dict[str, Any]]:
        try:
            return await self._observe()
        except Exception as e:
            if self.session is None or not self.session.alive():
                raise EnvCrashed(f"browser died: {e}") from e
            raise

    async def close(self) -> None:
        if self.session is not None:
            await self.pool.release(self.session)
            self.session = None
