"""The browser session pool: one Chromium process hosting many isolated contexts, reused across
episodes, recycled periodically, relaunched after a crash, and fenced by a navigation policy.

Invariants:
- A `BrowserSession` (one context + one page) belongs to exactly one environment at a time; it is
  reused across that environment's episodes and replaced after `recycle_context_every` episodes, so
  renderer memory stays flat over long runs.
- Every request a page makes passes `NavigationPolicy.permits` (request routing): only the task's
  allowed origins are reachable; file://, chrome:// and private address ranges are refused unless a
  task allows them explicitly. Downloads are refused, window.open returns null, popups are closed.
- A dead browser or page is never hidden: operations on it raise `EnvCrashed`, and the next
  `acquire()` relaunches the browser, so one crash costs one episode, not the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from asyncwebrl.web.base import EnvCrashed
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.observe import RUNTIME_JS

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
]

# Runs in every page before its own scripts: no popups through script.
_NO_POPUPS_JS = "window.open = function () { return null; };"

_ALWAYS_OK_SCHEMES = {"data", "blob", "about"}


def _origin(url: str) -> str:
    p = urlsplit(url)
    if not p.scheme or not p.hostname:
        return ""
    port = f":{p.port}" if p.port else ""
    return f"{p.scheme}://{p.hostname}{port}".lower()


def _is_private_host(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: it cannot be resolved here without the network; the origin list decides
    return ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_unspecified


@dataclass
class NavigationPolicy:
    """Which URLs a session may load. `allowed_origins` empty = any public http(s) origin."""

    allowed_origins: list[str] = field(default_factory=list)
    """exact origins, e.g. 'http://127.0.0.1:8123'; '*' = any public http(s) origin"""
    allow_private: bool = False
    """let http(s) reach private/loopback address ranges that are not listed explicitly"""
    allow_file: bool = False
    """let file:// URLs load"""

    def __post_init__(self) -> None:
        self.allowed_origins = [o.rstrip("/").lower() for o in self.allowed_origins]

    def permits(self, url: str) -> tuple[bool, str]:
        """(allowed, reason) for one URL."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme in _ALWAYS_OK_SCHEMES:
            return True, ""
        if scheme == "file":
            return (True, "") if self.allow_file else (False, "file:// is blocked")
        if scheme not in ("http", "https"):
            return False, f"scheme '{scheme}:' is blocked"
        origin = _origin(url)
        if origin in self.allowed_origins:
            return True, ""
        host = urlsplit(url).hostname or ""
        if _is_private_host(host) and not self.allow_private:
            return False, f"private address {host} is blocked"
        if not self.allowed_origins or "*" in self.allowed_origins:
            return True, ""
        return False, f"origin {origin} is not among the task's allowed origins"


class BrowserSession:
    """One isolated context with one page, on loan to one environment."""

    def __init__(self, pool: BrowserPool, context, page, generation: int):
        self.pool = pool
        self.context = context
        self.page = page
        self.generation = generation
        """browser launch number this session lives in (a relaunch invalidates older sessions)"""
        self.policy = NavigationPolicy()
        self.viewport: dict[str, int] = {}
        self.episodes = 0
        self.crashed = False
        self.blocked: list[str] = []
        """URLs refused by the policy since the last `take_blocked()`"""
        self.blocked_navigation = False
        """the main frame tried to navigate to a refused URL"""
        page.on("crash", lambda *_: self._mark_crashed())
        page.on("close", lambda *_: self._mark_crashed())
        context.on("page", self._on_popup)

    def _mark_crashed(self) -> None:
        self.crashed = True

    async def _on_popup(self, page) -> None:
        if page is self.page:
            return
        self.blocked.append("popup")
        try:
            await page.close()
        except Exception:  # the popup may already be gone
            pass

    def alive(self) -> bool:
        return (not self.crashed and not self.page.is_closed() and self.pool.connected()
                and self.generation == self.pool.generation)

    def check_alive(self) -> None:
        if not self.alive():
            raise EnvCrashed("browser or page died during the episode")

    def take_blocked(self) -> list[str]:
        out, self.blocked = self.blocked, []
        return out

    async def undo_blocked_navigation(self, last_url: str) -> bool:
        """If the main frame tried to navigate somewhere refused, put it back on `last_url` (after the
        browser has committed its error page, which otherwise lands after we look); True if it did."""
        if not self.blocked_navigation:
            return False
        self.blocked_navigation = False
        for _ in range(20):
            if self.page.url.startswith("chrome-error:") or self.page.url != last_url:
                break
            await asyncio.sleep(0.05)
        if self.page.url != last_url:
            await self.page.goto(last_url, wait_until="load", timeout=30_000)
        self.blocked_navigation = False
        return True

    async def _route(self, route) -> None:
        ok, reason = self.policy.permits(route.request.url)
        if ok and route.request.is_navigation_request():
            # Playwright routes only the first URL of a redirect chain: fetch navigations without
            # following redirects, and check each Location against the policy before the browser goes there
            # (the browser follows a fulfilled redirect unrouted too, so the whole chain is walked first)
            from urllib.parse import urljoin

            resp = hop = await route.fetch(max_redirects=0)
            url = route.request.url
            for _ in range(10):
                location = hop.headers.get("location") if 300 <= hop.status < 400 else None
                if location is None:
                    break
                url = urljoin(url, location)
                ok, reason = self.policy.permits(url)
                if not ok:
                    route = _RedirectRefusal(route, url)
                    break
                hop = await route.fetch(url=url, method="GET", max_redirects=0)
            else:
                ok, reason = False, "more than 10 redirects"
            if ok:
                await route.fulfill(response=resp)
                return
        if ok:
            await route.continue_()
        else:
            self.blocked.append(route.request.url)
            try:
                if route.request.is_navigation_request() and route.request.frame == self.page.main_frame:
                    self.blocked_navigation = True
            except Exception:  # requests without a frame (workers) are not page navigations
                pass
            log.debug("blocked %s: %s", route.request.url, reason)
            await route.abort("blockedbyclient")


class _RedirectRefusal:
    """A route whose redirect target was refused: reported (and blocked) under the target's URL."""

    def __init__(self, route, target: str):
        self._route, self.target = route, target
        self.request = _RequestAs(route.request, target)

    async def abort(self, code: str) -> None:
        await self._route.abort(code)


class _RequestAs:
    def __init__(self, request, url: str):
        self._request, self.url = request, url

    def is_navigation_request(self) -> bool:
        return self._request.is_navigation_request()

    @property
    def frame(self):
        return self._request.frame


class BrowserPool:
    """One Chromium process, many contexts; relaunches the browser after it dies.

    Bound to the asyncio loop it was started in (Playwright objects are loop-bound); use
    `BrowserPool.shared(env_cfg)` to get the pool of the running loop.
    """

    _shared: dict[int, BrowserPool] = {}

    def __init__(self, env_cfg: EnvConfig | None = None):
        self.cfg = env_cfg or EnvConfig()
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
            self._pw.chromium.launch(executable_path=self.cfg.headless_shell, args=[*CHROMIUM_ARGS, marker],
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
            await self.release(previous)
            if previous.alive():
                self.sessions_recycled += 1
        async with self._lock:
            await self._ensure_browser()
            try:
                context = await asyncio.wait_for(self._browser.new_context(
                    viewport=viewport,
                    accept_downloads=False,
                    service_workers="block",
                    java_script_enabled=True,
                ), timeout=30)
                await context.add_init_script(_NO_POPUPS_JS + "\n" + RUNTIME_JS)
                page = await context.new_page()
            except Exception as e:
                raise EnvCrashed(f"could not open a browser context: {e}") from e
        session = BrowserSession(self, context, page, self.generation)
        session.viewport = viewport
        await context.route("**/*", session._route)
        page.set_default_timeout(10_000)
        self.sessions_created += 1
        return session

    async def release(self, session: BrowserSession | None) -> None:
        if session is None:
            return
        try:
            await asyncio.wait_for(session.context.close(), timeout=10)
        except Exception:  # context of a dead browser: nothing left to close
            pass

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
