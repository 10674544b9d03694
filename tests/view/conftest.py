"""Fixtures for the report tests: a real headless Chromium and real screenshots taken with it."""

from __future__ import annotations

import pytest
from view_fixtures import CHROMIUM, CHROMIUM_ARGS, PAGE_TEMPLATE


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
        yield b
        b.close()


@pytest.fixture(scope="session")
def screenshots(browser) -> list[bytes]:
    """Four MiniWoB-sized (160x210) screenshots of a small task page, taken by Chromium."""
    page = browser.new_page(viewport={"width": 160, "height": 210})
    shots = []
    for i, instr in enumerate(["Click on the ONE button.", "Click on the TWO button.",
                               "Type 'hello' in the box.", "Scroll down and click submit."]):
        buttons = "".join(f'<button style="margin:3px">{w}</button>' for w in ("ONE", "TWO", "OK")[: 2 + i % 2])
        page.set_content(PAGE_TEMPLATE.format(instr=instr, buttons=buttons, typed="hel" if i == 2 else ""))
        shots.append(page.screenshot(type="png"))
    page.close()
    return shots


