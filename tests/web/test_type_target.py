"""`type [id] [text]` types only into a text field. Into a link or button it is an invalid step that
changes nothing, as BrowserGym's `fill` refuses a non-editable element; before, it clicked the
element first, so `type [k] [..]` on click-link scored whenever k was the target link, and the
default run learnt to answer every click task with the prompt's example `type [1] [Bob]`."""

from __future__ import annotations

import re

import pytest

from asyncwebrl.web.actions import is_editable
from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv


def test_editable_roles():
    assert is_editable({"role": "textbox"}) and is_editable({"role": "searchbox"})
    assert is_editable({"role": "clickable", "editable": True})  # a contenteditable <div>
    assert not is_editable({"role": "link"}) and not is_editable({"role": "button"})
    assert not is_editable({"role": "checkbox"})


@pytest.mark.browser
def test_type_into_link_is_invalid_and_clicks_nothing(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig())
        try:
            obs = await env.reset(Task("miniwob/click-link", seed=3))
            word = re.search(r'"(.+)"', obs.instruction).group(1)
            link = next(e for e in obs.elements if e["name"] == word)  # a pointer-styled <span>
            obs, typed = await env.step({"type": "type", "element": link["id"], "text": "a"})
            link = next(e for e in obs.elements if e["name"] == word)  # ids are drawn per observation
            clicked = (await env.step({"type": "click", "element": link["id"]}))[1]
            obs = await env.reset(Task("miniwob/enter-text", seed=3))
            box = next(e for e in obs.elements if e["role"] == "textbox")
            into_box = (await env.step({"type": "type", "element": box["id"], "text": "hello"}))[1]
            return typed, clicked, into_box
        finally:
            await env.close()

    typed, clicked, into_box = runner.run(go())
    assert typed.invalid and not typed.done and typed.reward == 0
    assert "not a text field" in typed.info["error"] and "click [" in typed.info["error"]
    assert clicked.done and clicked.reward == 1.0  # the link was still there to click: typing did nothing
    assert not into_box.invalid and not into_box.no_effect
