"""Fixtures for the report tests: a real headless Chromium and real screenshots taken with it."""

from __future__ import annotations

import contextlib

import pytest
from view_fixtures import CHROMIUM, CHROMIUM_ARGS, PAGE_TEMPLATE


@contextlib.contextmanager
def _chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
        try:
            yield b
        finally:
            b.close()


# Module scope, not session: while Playwright's sync API is open it owns a running asyncio loop on the
# main thread, and every later test that calls asyncio.run() (the web suite does) would fail.
@pytest.fixture(scope="module")
def browser():
    with _chromium() as b:
        yield b


@pytest.fixture(scope="session")
def screenshots() -> list[bytes]:
    """Four MiniWoB-sized (160x210) screenshots of a small task page, taken by Chromium (closed again)."""
    with _chromium() as b:
        return _take(b)


def _take(browser) -> list[bytes]:
    page = browser.new_page(viewport={"width": 160, "height": 210})
    shots = []
    for i, instr in enumerate(["Click on the ONE button.", "Click on the TWO button.",
                               "Type 'hello' in the box.", "Scroll down and click submit."]):
        buttons = "".join(f'<button style="margin:3px">{w}</button>' for w in ("ONE", "TWO", "OK")[: 2 + i % 2])
        page.set_content(PAGE_TEMPLATE.format(instr=instr, buttons=buttons, typed="hel" if i == 2 else ""))
        shots.append(page.screenshot(type="png"))
    page.close()
    return shots


