"""The Gymnasium wrapper: registered ids, the standard reset/step contract, real rewards."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import asyncwebrl.web.gym_env  # noqa: F401  (registers the ids)
from asyncwebrl.web.webgym import DEMO_TASKS

pytestmark = pytest.mark.browser


def _target_id(obs) -> int:
    target = obs["instruction"].split('"')[1]
    for line in obs["elements"].splitlines():
        if line.endswith(f'button "{target}"'):
            return int(line[1:line.index("]")])
    raise AssertionError(obs)


def test_miniwob_click_button_through_gymnasium():
    assert "asyncwebrl/miniwob-click-tab-v0" in gym.registry
    env = gym.make("asyncwebrl/miniwob-click-button-v0", max_steps=2)
    try:
        obs, info = env.reset(seed=5)
        assert obs["screenshot"].shape == (210, 160, 3) and obs["screenshot"].dtype == np.uint8
        again, _ = env.reset(seed=5)
        assert again["instruction"] == obs["instruction"] and again["elements"] == obs["elements"]
        _, reward, terminated, truncated, info = env.step(f"click [{_target_id(again)}]")
        assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
        env.reset(seed=6)
        _, reward, terminated, truncated, info = env.step("no idea")
        assert info["invalid"] and reward == 0.0 and not terminated and not truncated
        _, _, terminated, truncated, _ = env.step("still no idea")
        assert truncated and not terminated  # the 2-step budget ran out
        assert env.render().shape == (210, 160, 3)
    finally:
        env.close()


def test_webgym_task_through_gymnasium():
    env = gym.make("asyncwebrl/webgym-v0", task_file=str(DEMO_TASKS), task="demo/price",
                   viewport_width=320, viewport_height=240)
    try:
        env.reset(seed=0)
        _, reward, terminated, _, _ = env.step("ANSWER [$12]")
        assert reward == 1.0 and terminated
    finally:
        env.close()
