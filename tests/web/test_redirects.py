"""Redirects cannot lead the agent out of its task's origin: an HTTP 302 to another (private) origin,
a 302 to file://, and a meta refresh to another origin, all from pages of the allowed origin. The
forbidden server must never receive a request, and the agent stays on the allowed page.
(The direct cases — links, window.open, script navigation — are in tests/web/test_safety.py.)"""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.webgym import WebGymEnv, load_task_file

pytestmark = pytest.mark.browser


def _serve(handler_cls) -> tuple[ThreadingHTTPServer, threading.Thread]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return srv, t


def test_redirects_to_other_origins_and_files_are_refused(tmp_path):
    hits: list[str] = []
    current = [""]

    class Forbidden(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(f"{current[0]}: {self.path}")
            body = b"<html><head><title>SECRET</title></head><body>secret</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    bad, bad_t = _serve(Forbidden)
    secret = f"http://127.0.0.1:{bad.server_address[1]}/secret.html"

    class Allowed(BaseHTTPRequestHandler):
        def _html(self, html: str) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _redirect(self, where: str) -> None:
            self.send_response(302)
            self.send_header("Location", where)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):  # noqa: N802
            if self.path == "/r-other":
                self._redirect(secret)
            elif self.path == "/r-chain":
                self._redirect("/r-other")  # same origin first, then out
            elif self.path == "/r-same":
                self._redirect("/page2.html")
            elif self.path == "/page2.html":
                self._html("<html><head><title>page2</title></head><body>fine</body></html>")
            elif self.path == "/r-file":
                self._redirect("file:///etc/passwd")
            elif self.path == "/r-meta":
                self._html(f'<html><head><meta http-equiv="refresh" content="0;url={secret}"></head>'
                           "<body>moving</body></html>")
            else:
                self._html('<html><head><title>start</title></head><body>'
                           '<a href="/r-other">Other origin</a> <a href="/r-file">Local file</a> '
                           '<a href="/r-meta">Meta refresh</a> <a href="/r-chain">Chain</a> '
                           '<a href="/r-same">Same origin</a></body></html>')

        def log_message(self, *a):
            pass

    good, good_t = _serve(Allowed)
    origin = f"http://127.0.0.1:{good.server_address[1]}"
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(f'{{"id": "redir", "instruction": "stay", "max_steps": 5, "start_url": "{origin}/start.html", "evaluator": {{"type": "url_match", "pattern": "never.html"}}}}\n')
    task = load_task_file(tasks)[0]
    cfg = EnvConfig(type="webgym", task_file=str(tasks), viewport_width=320, viewport_height=240)

    async def go():
        from asyncwebrl.web.browser import BrowserPool

        env = WebGymEnv(cfg)
        try:
            results = {}
            for name in ["Other origin", "Local file", "Meta refresh", "Chain", "Same origin"]:
                current[0] = name
                obs = await env.reset(task)
                ids = {e["name"]: e["id"] for e in obs.elements}
                o, r = await env.step({"type": "click", "element": ids[name]})
                await asyncio.sleep(1.0)  # let a meta refresh fire
                results[name] = (o.url, env.session.page.url, await env.session.page.title(), r)
            return results
        finally:
            await env.close()
            pool = BrowserPool._shared.get(id(asyncio.get_running_loop()))
            if pool is not None:
                await pool.close()

    try:
        results = asyncio.run(asyncio.wait_for(go(), 180))
    finally:
        for s in (good, bad):
            s.shutdown()
            s.server_close()
    assert hits == [], f"the forbidden origin was reached: {hits}"
    # a redirect within the allowed origin still works
    assert results.pop("Same origin")[1] == origin + "/page2.html"
    for name, (obs_url, page_url, title, _res) in results.items():
        assert title != "SECRET", name
        assert page_url.startswith(origin), (name, page_url)
        assert obs_url.startswith(origin), (name, obs_url)
