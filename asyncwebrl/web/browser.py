"""The browser session pool: one Chromium process hosting many isolated contexts, a fresh context per
episode by default, relaunched after a crash, every context behind the network fence.

Invariants:
- A `BrowserSession` (one context + one page) belongs to exactly one environment at a time. It serves
  `recycle_context_every` episodes (default 1: every episode starts in a fresh context, so nothing a
  page stored — cookies, localStorage, IndexedDB, caches — carries over to the next episode).
- Every connection a context opens goes through its own gate of the `NetworkFence`
  (asyncwebrl/web/fence.py), which checks the resolved address against the session's
  `NavigationPolicy`; refusals are recorded on the session for the step result. WebRTC may use only
  proxied TCP (so the fence sees it too); downloads are refused, window.open returns null, popups
  are closed.
- A dead browser or page is never hidden: operations on it raise `EnvCrashed`, and the next
  `acquire()` relaunches the browser, so one crash costs one episode, not the pool. A session that
  missed a deadline is marked dead too and never reused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from asyncwebrl.web.base import EnvCrashed, EnvDeadline, TaskError
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.fence import BlockedRequest, NavigationPolicy, NetworkFence, Resolver
from asyncwebrl.web.observe import RUNTIME_JS
from asyncwebrl.web.pageread import PageReader

__all__ = ["BlockedRequest", "BrowserPool", "BrowserSession", "NavigationPolicy", "browser_root_pids"]

log = logging.getLogger(__name__)

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",
    # WebRTC: no UDP that bypasses the proxy; its TCP relay goes through the context's proxy (the fence)
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--dns-prefetch-disable",
]

# Runs in every page before its own scripts: no popups through script or through target=_blank links
# and forms (counted, so the step can report them; a window that still opens is closed by the pool).
_NO_POPUPS_JS = r"""
(() => {
  let n = 0;
  const other = (t) => t && !['_self', '_top', '_parent'].includes(t.toLowerCase());
  window.open = function () { n++; return null; };
  addEventListener('click', (e) => {
    const a = e.target && e.target.closest ? e.target.closest('a[target],area[target]') : null;
    if (a && other(a.target)) { e.preventDefault(); n++; }
  }, true);
  addEventListener('submit', (e) => { if (e.target && other(e.target.target)) { e.preventDefault(); n++; } }, true);
  Object.defineProperty(window, '__awrTakePopups', {value: () => { const k = n; n = 0; return k; },
                                                   writable: false, configurable: false, enumerable: false});
})();
"""

MAX_BLOCKED_RECORDS = 200
"""fence records kept per step (a page can make thousands of refused requests)"""

_PROXY_BYPASS = "<-loopback>"
"""Chromium's bypass rule that REMOVES its implicit bypass of loopback: localhost and 127.0.0.1 go
through the fence like everything else (given explicitly, Playwright passes it on unchanged)"""


def fence_target_matches(url: str, blocked: BlockedRequest) -> bool:
    """Whether `blocked` is the fence's record of a request for `url` (an http URL or its tunnel)."""
    if blocked.target == url:
        return True
    p = urlsplit(url)
    try:
        port = p.port or {"http": 80, "https": 443, "ws": 80, "wss": 443}.get(p.scheme, 0)
    except ValueError:
        return False
    host = (p.hostname or "").lower()
    return blocked.target in (f"{host}:{port}", f"[{host}]:{port}")


async def within_deadline(coro, seconds: float, what: str, session_of: Callable[[], BrowserSession | None]):
    """Await `coro` for at most `seconds`; on a miss the session `session_of()` names then is marked
    dead (never reused) and `EnvDeadline` says which call missed. Any other fault that is not an
    `EnvCrashed` (or a `TaskError`: the task itself is wrong) becomes an `EnvCrashed` naming its cause,
    and that session is discarded too: whatever a page does, an env call fails only as EnvCrashed."""
    cm = asyncio.timeout(seconds)
    try:
        async with cm:
            return await coro
    except (EnvCrashed, TaskError):
        raise
    except TimeoutError as e:
        _discard(session_of())
        if not cm.expired():
            raise EnvCrashed(f"{what} failed: a call inside it timed out: {e}") from e
        raise EnvDeadline(f"{what} did not finish within its {seconds:g} s deadline (a page that never "
                          "yields, or a site that never answers); the browser context is discarded") from None
    except Exception as e:
        _discard(session_of())
        raise EnvCrashed(f"{what} failed: {type(e).__name__}: {str(e)[:300]}") from e


def _discard(session: BrowserSession | None) -> None:
    if session is not None:
        session.crashed = True


class EpisodeBudget:
    """The env wall time of one episode: each reset/step gets min(its own deadline, what is left of
    `env.episode_timeout_s`), and the time it took is charged. Model time between steps is not env
    time and is not charged."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.used_s = 0.0

    def start(self) -> None:
        self.used_s = 0.0

    async def run(self, coro, per_call_s: float, what: str, session_of: Callable[[], BrowserSession | None]):
        """(the call's result, its wall seconds) under the tighter of both deadlines."""
        total = self.cfg.episode_timeout_s
        left = total - self.used_s
        if left <= 0:
            coro.close()
            _discard(session_of())
            raise EnvDeadline(f"{what}: the episode has used its whole env budget of {total:g} s "
                              f"(env.episode_timeout_s); a page this slow holds a rollout slot for nothing")
        if left < per_call_s:
            what = f"{what} (the last {left:.2f} s of the episode's {total:g} s env budget)"
        t0 = time.monotonic()
        try:
            return await within_deadline(coro, min(per_call_s, left), what, session_of), time.monotonic() - t0
        finally:
            self.used_s += time.monotonic() - t0


class BrowserSession:
    """One isolated context with one page, on loan to one environment."""

    def __init__(self, pool: BrowserPool, context, page, generation: int, gate_port: int | None = None):
        self.pool = pool
        self.context = context
        self.page = page
        self.reader = PageReader(page)
        """the page's read channels its scripts cannot patch (isolated world, V8-serialized values)"""
        self.generation = generation
        """browser launch number this session lives in (a relaunch invalidates older sessions)"""
        self.gate_port = gate_port
        """this context's gate of the network fence"""
        self.policy = NavigationPolicy()
        self.viewport: dict[str, int] = {}
        self.episodes = 0
        self.crashed = False
        self._lock = threading.Lock()  # the fence records from its own thread
        self._blocked: list[BlockedRequest] = []
        self._blocked_dropped = 0
        self.popups = 0
        """popups closed since the last `take_blocked()`"""
        self._navigations: list[str] = []
        page.on("crash", lambda *_: self._mark_crashed())
        page.on("close", lambda *_: self._mark_crashed())
        page.on("request", self._on_request)
        context.on("page", self._on_popup)

    def _mark_crashed(self) -> None:
        self.crashed = True

    def _on_request(self, request) -> None:
        try:
            if request.is_navigation_request() and request.frame == self.page.main_frame:
                with self._lock:
                    self._navigations.append(request.url)
        except Exception:  # requests without a frame (workers) are not page navigations
            pass

    async def _on_popup(self, page) -> None:
        if page is self.page or getattr(page, "_awr_counted", False):
            return
        page._awr_counted = True
        self.popups += 1
        try:
            await page.close()
        except Exception:  # the popup may already be gone
            pass

    async def close_popups(self) -> None:
        """Count the popups the page tried to open (refused in the page) and close any window besides
        the session's page that is still open now."""
        try:
            self.popups += int(await self.page.evaluate(
                "() => window.__awrTakePopups ? window.__awrTakePopups() : 0"))
        except Exception:  # a page mid-navigation: nothing counted this time
            if self.page.is_closed():
                raise
        for p in list(self.context.pages):
            if p is not self.page:
                await self._on_popup(p)

    def record_blocked(self, item: BlockedRequest) -> None:
        """Called by the fence (from its thread) for every refused or unreachable connection; a page
        that floods the fence keeps only the first MAX_BLOCKED_RECORDS per step (plus a count)."""
        log.debug("fence: %s %s (%s)", item.kind, item.target, item.reason)
        with self._lock:
            if len(self._blocked) < MAX_BLOCKED_RECORDS:
                self._blocked.append(item)
            else:
                self._blocked_dropped += 1

    def alive(self) -> bool:
        return (not self.crashed and not self.page.is_closed() and self.pool.connected()
                and self.generation == self.pool.generation)

    def take_blocked(self) -> list[BlockedRequest]:
        """The fence's records since the last call (popups closed count as refused 'popup' targets)."""
        with self._lock:
            out, self._blocked, dropped, self._blocked_dropped = self._blocked, [], self._blocked_dropped, 0
        if dropped:
            out.append(BlockedRequest(f"({dropped} more)", "refused", "further records of this step dropped"))
        if self.popups:
            out += [BlockedRequest("popup", "refused", "new windows are closed")] * self.popups
            self.popups = 0
        return out

    def has_navigations(self) -> bool:
        with self._lock:
            return bool(self._navigations)

    def take_navigations(self) -> list[str]:
        """URLs the main frame requested (each redirect hop too) since the last call."""
        with self._lock:
            out, self._navigations = self._navigations, []
        return out


class BrowserPool:
    """One Chromium process, many contexts; relaunches the browser after it dies.

    Bound to the asyncio loop it was started in (Playwright objects are loop-bound); use
    `BrowserPool.shared(env_cfg)` to get the pool of the running loop.
    """

    _shared: dict[int, BrowserPool] = {}

    def __init__(self, env_cfg: EnvConfig | None = None, resolver: Resolver | None = None):
        """resolver: how the fence resolves host names (default the system's; tests inject one)."""
        self.cfg = env_cfg or EnvConfig()
        self._resolver = resolver
        self.fence: NetworkFence | None = None
        self._pw = None
        self._browser = None
        self._lock = asyncio.Lock()
        self.generation = 0
        self.launches = 0
        self.sessions_created = 0
        self.sessions_recycled = 0
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        """the loop the browser was launched from (Playwright objects are bound to it)"""
        self._pid: int | None = None
        """process id of the browser of the current launch"""

    @classmethod
    def shared(cls, env_cfg: EnvConfig | None = None) -> BrowserPool:
        loop = asyncio.get_running_loop()
        pool = cls._shared.get(id(loop))
        if pool is None or pool._closed or (pool._loop is not None and pool._loop is not loop):
            pool = cls._shared[id(loop)] = cls(env_cfg)
        return pool

    def connected(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    async def _ensure_browser(self) -> None:
        if self.connected():
            return
        if self._closed:
            raise RuntimeError("BrowserPool is closed")
        if not os.path.exists(self.cfg.headless_shell):
            raise FileNotFoundError(
                f"Chromium binary not found at {self.cfg.headless_shell}; install chromium-headless-shell "
                "(make setup) or set env.headless_shell"
            )
        if self.fence is None:
            self.fence = NetworkFence(self._resolver)
        if self._pw is None:
            from playwright.async_api import async_playwright

            self._loop = asyncio.get_running_loop()
            self._pw = await async_playwright().start()
        if self._browser is not None:
            log.warning("browser died; relaunching (launch %d)", self.launches + 1)
            try:
                await self._browser.close()
            except Exception:
                pass
        # a switch Chromium ignores but keeps on its command line: it names THIS launch, so the pid
        # found below is this pool's browser, never another pool's in the same process
        marker = f"--asyncwebrl-pool={os.getpid()}-{id(self):x}-{self.launches + 1}"
        self._browser = await asyncio.wait_for(
            self._pw.chromium.launch(
                executable_path=self.cfg.headless_shell, args=[*CHROMIUM_ARGS, marker],
                # anything not in a context of ours (there should be nothing) meets a gate that refuses all
                proxy={"server": f"http://127.0.0.1:{self.fence.deny_port}", "bypass": _PROXY_BYPASS},
                handle_sigint=False, handle_sigterm=False, handle_sighup=False),
            timeout=60,
        )
        self._pid = _pid_with_marker(self.cfg.headless_shell, marker)
        self.generation += 1
        self.launches += 1

    def browser_pid(self) -> int | None:
        """Process id of the browser this pool launched (recorded at launch; None when it is not
        running). Used for memory accounting and crash tests."""
        return self._pid if self.connected() else None

    async def acquire(self, previous: BrowserSession | None = None, cfg: EnvConfig | None = None) -> BrowserSession:
        """A session ready for an episode: `previous` itself while it is healthy and young, else a new one.

        cfg: the environment's config (viewport, recycling); default the pool's own.
        """
        cfg = cfg or self.cfg
        viewport = {"width": cfg.viewport_width, "height": cfg.viewport_height}
        if previous is not None:
            if (previous.alive() and previous.episodes < max(1, cfg.recycle_context_every)
                    and previous.viewport == viewport):
                return previous
            was_alive = previous.alive()
            await self.release(previous)
            if was_alive:
                self.sessions_recycled += 1
        async with self._lock:
            await self._ensure_browser()
            port = await self.fence.open_gate()  # refuses all until bound
            try:
                context = await asyncio.wait_for(self._browser.new_context(
                    viewport=viewport,
                    accept_downloads=False,
                    service_workers="block",
                    java_script_enabled=True,
                    proxy={"server": f"http://127.0.0.1:{port}", "bypass": _PROXY_BYPASS},
                ), timeout=30)
                await context.add_init_script(_NO_POPUPS_JS + "\n" + RUNTIME_JS)
                page = await context.new_page()
            except Exception as e:
                await self.fence.close_gate(port)
                raise EnvCrashed(f"could not open a browser context: {e}") from e
        session = BrowserSession(self, context, page, self.generation, gate_port=port)
        self.fence.bind_gate(port, session)
        session.viewport = viewport
        page.set_default_timeout(10_000)
        self.sessions_created += 1
        return session

    async def release(self, session: BrowserSession | None) -> None:
        if session is None:
            return
        session.crashed = True  # never handed out again
        try:
            await asyncio.wait_for(session.context.close(), timeout=10)
        except Exception:  # context of a dead browser: nothing left to close
            pass
        if self.fence is not None and session.gate_port is not None:
            await self.fence.close_gate(session.gate_port)

    async def close(self) -> None:
        self._closed = True
        for k, v in list(BrowserPool._shared.items()):
            if v is self:
                del BrowserPool._shared[k]
        if self._browser is not None:
            try:
                await asyncio.wait_for(self._browser.close(), timeout=10)
            except Exception:
                pass
            self._browser = None
        if self._pw is not None:
            try:
                await asyncio.wait_for(self._pw.stop(), timeout=10)
            except Exception:
                pass
            self._pw = None
        if self.fence is not None:
            await asyncio.to_thread(self.fence.close)
            self.fence = None


def _pid_with_marker(headless_shell: str, marker: str) -> int | None:
    """The main (non --type=) Chromium process among this process's descendants whose command line
    holds `marker`."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0] == headless_shell and marker in cmd and not any(a.startswith("--type=") for a in cmd):
            return p.pid
    return None


def browser_root_pids(headless_shell: str) -> list[int]:
    """The main Chromium processes among this process's descendants (Ray workers and other pools
    included): the roots whose trees hold a pool's renderers. Used by the soak and the fault tests."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0] == headless_shell and not any(a.startswith("--type=") for a in cmd):
            out.append(p.pid)
    return out
