"""A page cannot lead the agent out: local files, private addresses, other origins, new windows
and script navigations are refused, and the agent stays on the task's allowed origin."""

from __future__ import annotations

import pytest

from asyncwebrl.web.browser import NavigationPolicy
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.webgym import DEMO_TASKS, WebGymEnv, load_task_file


def test_policy_rules():
    p = NavigationPolicy(["http://127.0.0.1:8000"])
    assert p.permits("http://127.0.0.1:8000/a.html")[0]
    for url in ["file:///etc/passwd", "chrome://settings", "http://10.0.0.1/", "http://192.168.1.1/x",
                "http://127.0.0.1:9000/", "http://localhost:8000/", "https://example.com/", "javascript:alert(1)",
                "http://[::1]:8000/", "http://169.254.169.254/latest/meta-data"]:
        ok, reason = p.permits(url)
        assert not ok and reason, url
    anywhere = NavigationPolicy(["*"])
    assert anywhere.permits("https://example.com/")[0] and not anywhere.permits("http://10.1.2.3/")[0]
    assert NavigationPolicy(["*"], allow_private=True).permits("http://10.1.2.3/")[0]
    assert NavigationPolicy([], allow_file=True).permits("file:///tmp/x")[0]
    assert p.permits("data:text/html,hi")[0] and p.permits("about:blank")[0]


@pytest.mark.browser
def test_agent_stays_on_allowed_origin(runner):
    task = next(t for t in load_task_file(DEMO_TASKS) if t.task_id == "demo/unsafe")
    cfg = EnvConfig(type="webgym", task_file=str(DEMO_TASKS), viewport_width=320, viewport_height=240)

    async def go():
        env = WebGymEnv(cfg)
        try:
            obs = await env.reset(task)
            origin = obs.url.rsplit("/", 1)[0]
            results = {}
            for name in ["Local file", "Router", "Elsewhere", "New tab", "Popup", "Admin"]:
                ids = {e["name"]: e["id"] for e in obs.elements}  # drawn anew for every observation
                obs, r = await env.step({"type": "click", "element": ids[name]})
                o = obs
                results[name] = (o.url, r, len(env.session.context.pages), await env.session.page.title())
            return origin, results
        finally:
            await env.close()

    origin, results = runner.run(go())
    for name, (url, res, n_pages, _title) in results.items():
        assert url == origin + "/unsafe.html", (name, url)
        assert n_pages == 1, name  # no second window survives
        assert not res.done
    for name in ["Router", "Elsewhere", "Admin", "New tab"]:
        assert results[name][1].invalid and results[name][1].blocked, name
    assert results["Popup"][3] == "opened"  # the page ran its script; window.open just returned null


def test_fence_records_are_capped_per_step():
    """A page that floods the fence with refused requests cannot blow up the step result."""
    from asyncwebrl.web.browser import MAX_BLOCKED_RECORDS, BrowserSession
    from asyncwebrl.web.fence import BlockedRequest

    class Quiet:
        def on(self, *a):
            pass

    s = BrowserSession(None, Quiet(), Quiet(), 0)
    for i in range(MAX_BLOCKED_RECORDS + 50):
        s.record_blocked(BlockedRequest(f"http://10.0.0.1/{i}", "refused", "private"))
    out = s.take_blocked()
    assert len(out) == MAX_BLOCKED_RECORDS + 1 and out[-1].target == "(50 more)"
    assert s.take_blocked() == []
