"""Actions reach every MiniWoB widget (issue 19): a <select> shows its current value and its options
apart in the element list, `select [id] [option]` / BrowserGym's `select_option('id', 'option')`
choose an option, so choose-list is solved in 2 steps (as with BrowserGym); typing into a select and
clicking where nothing is say so in the step result (`no_effect`) instead of passing as valid steps."""

from __future__ import annotations

import re

import gymnasium as gym
import pytest

import asyncwebrl.web.gym_env  # noqa: F401  (registers the ids)
from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv

pytestmark = pytest.mark.browser


def _goal(instruction: str) -> str:
    return re.match(r"Select (.+) from the list and click Submit\.", instruction).group(1)


def _ids(elements_text: str) -> tuple[int, int, str]:
    """(select id, submit id, the select's line) from the element list text."""
    sel = next(line for line in elements_text.splitlines() if " combobox " in line)
    sub = next(line for line in elements_text.splitlines() if line.endswith('button "Submit"'))
    return int(sel[1:sel.index("]")]), int(sub[1:sub.index("]")]), sel


@pytest.mark.parametrize("grammar", ["webgym", "browsergym"])
def test_choose_list_in_two_steps_through_gymnasium(grammar):
    env = gym.make("asyncwebrl/miniwob-choose-list-v0", max_steps=3)
    try:
        solved = 0
        for seed in (1, 2, 3):
            obs, _ = env.reset(seed=seed)
            sel_id, _, line = _ids(obs["elements"])
            goal = _goal(obs["instruction"])
            # the value and each option stand apart (not all options run together as the name)
            value, options = re.search(r'value="([^"]*)" options: (.*)$', line).groups()
            choices = options.split(" | ")
            assert goal in choices and value == choices[0] and len(choices) >= 3, line
            act = f"select [{sel_id}] [{goal}]" if grammar == "webgym" else f"select_option('{sel_id}', '{goal}')"
            obs, reward, terminated, _, info = env.step(act)
            assert not info["invalid"] and not info["no_effect"] and not terminated, info
            _, submit_id, line = _ids(obs["elements"])  # ids are drawn anew for every observation
            assert f'value="{goal}"' in line  # the list now shows the choice
            _, reward, terminated, _, info = env.step(f"click [{submit_id}]")
            solved += int(terminated and reward == 1.0)
        assert solved == 3
    finally:
        env.close()


def test_actions_without_effect_say_so(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig())
        try:
            obs = await env.reset(Task("miniwob/choose-list", seed=4))
            sel = next(e for e in obs.elements if e["role"] == "combobox")
            goal = _goal(obs.instruction)
            def select_id(obs):  # ids are drawn anew for every observation
                return next(e for e in obs.elements if e["role"] == "combobox")["id"]

            obs, typed = await env.step({"type": "type", "element": sel["id"], "text": goal})
            obs, nothing = await env.step({"type": "click", "x": 150, "y": 200})  # empty area below the task
            obs, missing = await env.step({"type": "select", "element": select_id(obs), "option": "No Such Option"})
            _, chose = await env.step({"type": "select", "element": select_id(obs), "option": goal})
            return typed, nothing, missing, chose
        finally:
            await env.close()

    typed, nothing, missing, chose = runner.run(go())
    assert typed.invalid and typed.no_effect and "select [" in typed.info["error"]
    assert nothing.no_effect and not nothing.invalid and "changed nothing" in nothing.info["error"]
    assert missing.invalid and "no option" in missing.info["error"]
    assert not chose.invalid and not chose.no_effect
