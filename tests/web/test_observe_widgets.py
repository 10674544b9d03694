"""What the agent sees is what it can act on (issue 34), on real MiniWoB++ widgets in real Chromium:
an open datepicker lists its arrows and its days with their month, and covers Submit; an
autocomplete menu shows up in the observation after typing; spinner arrows are named; a labelled
text field shows what it holds; `select` sets the whole selection of a multi-select list. Each is
measured with an oracle that reads only the element list."""

from __future__ import annotations

import pytest

from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv
from asyncwebrl.web.observe import elements_text
from asyncwebrl.web.oracles import oracle_action

pytestmark = pytest.mark.browser


def box_id(obs):
    return next(e["id"] for e in obs.elements if e["role"] == "textbox")


def _named(obs, name):
    return next(e for e in obs.elements if e["name"] == name)


def test_open_datepicker_lists_arrows_and_dated_days_and_covers_submit(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig(recycle_context_every=100))
        try:
            obs = await env.reset(Task("miniwob/choose-date", seed=1))
            closed = elements_text(obs.elements)
            box = next(e for e in obs.elements if e["role"] == "textbox")
            opened, _ = await env.step(parse_action(f"click [{box['id']}]"))
            return closed, opened
        finally:
            await env.close()

    closed, opened = runner.run(go())
    assert "(covered)" not in closed
    names = [e["name"] for e in opened.elements]
    assert "Prev" in names and "1 December 2016" in names and "31 December 2016" in names
    assert _named(opened, "Submit").get("covered")  # the open picker lies over it (and it says so)


def test_spinner_arrows_are_named_and_text_fields_show_their_value(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig(recycle_context_every=100))
        try:
            spin = await env.reset(Task("miniwob/use-spinner", seed=1))
            obs = await env.reset(Task("miniwob/use-autocomplete", seed=1))
            box = next(e for e in obs.elements if e["role"] == "textbox")
            typed, _ = await env.step(parse_action(f"type [{box['id']}] [Ce]"))
            return spin, typed
        finally:
            await env.close()

    spin, typed = runner.run(go())
    assert {"up", "down"} <= {e["name"] for e in spin.elements if e["role"] == "button"}
    assert all(e["name"] for e in spin.elements)
    box = next(e for e in typed.elements if e["role"] == "textbox")
    assert box["name"] == "Tags:" and box["value"] == "Ce" and 'value="Ce"' in elements_text(typed.elements)
    # the autocomplete menu (shown 300 ms after typing) is in the observation, its items listed
    assert any(e["name"].startswith("Ce") and e["role"] == "option" for e in typed.elements)


@pytest.mark.parametrize("name", ["choose-date", "use-autocomplete", "click-scroll-list"])
def test_widget_oracles_solve_through_the_element_list(runner, name):
    async def go():
        env = MiniWoBEnv(EnvConfig(recycle_context_every=100))
        solved = 0
        try:
            for seed in range(6):
                obs = await env.reset(Task(f"miniwob/{name}", seed=seed))
                for _ in range(16):
                    obs, res = await env.step(parse_action(oracle_action(name, obs)))
                    if res.done:
                        solved += res.success
                        break
        finally:
            await env.close()
        return solved

    assert runner.run(go()) >= 5


def test_select_sets_the_whole_selection_of_a_multi_select(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig(recycle_context_every=100))
        try:
            obs = await env.reset(Task("miniwob/click-scroll-list", seed=3))
            lst = next(e for e in obs.elements if "options" in e)
            a, b, c = lst["options"][:3]
            obs, _ = await env.step(parse_action(f"select [{lst['id']}] [{a} | {b}]"))
            first = next(e for e in obs.elements if "options" in e)
            obs, _ = await env.step(parse_action(f"select [{first['id']}] [{c}]"))
            second = next(e for e in obs.elements if "options" in e)
            return lst, first, second, (a, b, c)
        finally:
            await env.close()

    lst, first, second, (a, b, c) = runner.run(go())
    assert lst["role"] == "listbox" and lst["value"] == ""
    assert first["value"] == f"{a} | {b}"
    assert second["value"] == c  # the whole selection, not one more option


def test_unlabelled_fields_take_the_text_before_them_and_tabs_show_which_is_shown(runner):
    """login-user's fields follow a <label> that names no control: they are listed by that text, not
    as `textbox ""`, and typing changes a field's value, not its name; a tab list says which tab is shown, and the mark moves with a click."""
    async def go():
        env = MiniWoBEnv(EnvConfig(recycle_context_every=100))
        try:
            login = await env.reset(Task("miniwob/login-user", seed=3))
            typed, _ = await env.step(parse_action(f"type [{login.elements[0]['id']}] [alice]"))
            blank = await env.reset(Task("miniwob/enter-text", seed=9))
            box = next(e for e in blank.elements if e["role"] == "textbox")
            filled, _ = await env.step(parse_action(f"type [{box['id']}] [Kasie]"))
            tabs = await env.reset(Task("miniwob/click-tab-2", seed=3))
            second = _named(tabs, "Tab #2")
            moved, _ = await env.step(parse_action(f"click [{second['id']}]"))
            return login, typed, filled, tabs, moved
        finally:
            await env.close()

    login, typed, filled, tabs, moved = runner.run(go())
    assert [e["name"] for e in login.elements if e["role"] == "textbox"] == ["Username", "Password"]
    # what a field holds is its value, never its name: a typed field keeps its name, a nameless one
    # stays nameless, so `"Kasie"` can never be read as a field called Kasie
    assert [e["name"] for e in typed.elements if e["role"] == "textbox"] == ["Username", "Password"]
    assert f'[{box_id(filled)}] textbox "" value="Kasie"' in elements_text(filled.elements)
    shown = lambda obs: [e["name"] for e in obs.elements if e.get("selected")]  # noqa: E731
    assert shown(tabs) == ["Tab #1"] and shown(moved) == ["Tab #2"]
    assert '"Tab #2" (selected)' in elements_text(moved.elements)


def test_a_text_field_after_a_button_is_not_named_by_the_button(runner):
    """click-button seed 2 puts a text field right after the `ok` button: the field must not be listed
    as a second `ok` (the button's text names the button), only the button is."""
    async def go():
        env = MiniWoBEnv(EnvConfig(recycle_context_every=100))
        try:
            return await env.reset(Task("miniwob/click-button", seed=2))
        finally:
            await env.close()

    obs = runner.run(go())
    named_ok = [e["role"] for e in obs.elements if e["name"] == "ok"]
    assert named_ok == ["button"], elements_text(obs.elements)
    assert oracle_action("click-button", obs) == f"click [{_named(obs, 'ok')['id']}]"
