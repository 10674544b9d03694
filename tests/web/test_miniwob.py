"""MiniWoB++ in real Chromium: reward path, seeding, invalid actions, coordinates, recycling, and the
task registry / sampler."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv
from asyncwebrl.web.oracles import oracle_action
from asyncwebrl.web.tasks import MINIWOB_EASY, TaskSampler, miniwob_all, resolve_task_names

pytestmark = pytest.mark.browser


def _wrong_button(obs):
    target = obs.instruction.split('"')[1]
    return next(e for e in obs.elements if e["role"] == "button" and e["name"] != target)


def test_reward_path_success_and_failure(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig())
        try:
            obs = await env.reset(Task("miniwob/click-button", seed=11))
            assert obs.instruction.startswith("Click on the")
            assert Image.open(io.BytesIO(obs.screenshot)).size == (160, 210)
            _, res = await env.step(parse_action(oracle_action("click-button", obs)))
            good = res
            for seed in range(20):  # find a seed with a wrong button to press
                obs = await env.reset(Task("miniwob/click-button", seed=seed))
                try:
                    wrong = _wrong_button(obs)
                    break
                except StopIteration:
                    continue
            _, bad = await env.step({"type": "click", "element": wrong["id"]})
            return good, bad
        finally:
            await env.close()

    good, bad = runner.run(go())
    assert good.done and good.success and good.reward == 1.0 and good.raw_reward == 1.0
    assert 0 < good.info["discounted_reward"] <= 1.0
    assert bad.done and not bad.success and bad.reward == 0.0 and bad.raw_reward == -1.0


def test_seeded_episodes_repeat(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig())
        try:
            a = await env.reset(Task("miniwob/click-checkboxes", seed=7))
            b = await env.reset(Task("miniwob/click-checkboxes", seed=7))
            c = await env.reset(Task("miniwob/click-checkboxes", seed=8))
            return a, b, c
        finally:
            await env.close()

    a, b, c = runner.run(go())
    assert a.instruction == b.instruction and a.elements == b.elements and a.screenshot == b.screenshot
    assert (c.instruction, c.elements) != (a.instruction, a.elements)


def test_invalid_actions_are_steps_not_errors(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig())
        try:
            await env.reset(Task("miniwob/click-test", seed=1))
            out = []
            for action in [None, {"type": "click", "element": 99}, {"type": "click", "x": 500, "y": 5},
                           {"type": "teleport"}]:
                out.append((await env.step(action))[1])
            limit = await env.session.page.evaluate("core.EPISODE_MAX_TIME")
            return out, limit
        finally:
            await env.close()

    results, limit = runner.run(go())
    assert all(r.invalid and not r.done for r in results)
    assert results[0].screenshot_unchanged
    assert limit == 600_000  # the stock 10 s limit is raised to env.episode_time_limit_s


def test_normalized_coordinates_click_the_target(runner):
    cfg = EnvConfig(coord_mode="norm1000")

    async def go():
        env = MiniWoBEnv(cfg)
        try:
            obs = await env.reset(Task("miniwob/click-test", seed=3))
            x, y, w, h = obs.elements[0]["box"]
            nx, ny = (x + w / 2) * 1000 / cfg.viewport_width, (y + h / 2) * 1000 / cfg.viewport_height
            return (await env.step(parse_action(f"click [{nx:.0f}, {ny:.0f}]")))[1]
        finally:
            await env.close()

    res = runner.run(go())
    assert res.success


def test_set_of_marks_draws_on_screenshot(runner):
    async def go():
        plain, marked = MiniWoBEnv(EnvConfig()), MiniWoBEnv(EnvConfig(set_of_marks=True))
        try:
            a = await plain.reset(Task("miniwob/click-button", seed=2))
            b = await marked.reset(Task("miniwob/click-button", seed=2))
            return a, b
        finally:
            await plain.close()
            await marked.close()

    a, b = runner.run(go())
    img_a, img_b = Image.open(io.BytesIO(a.screenshot)).convert("RGB"), Image.open(io.BytesIO(b.screenshot)).convert("RGB")
    x, y, _, _ = b.elements[0]["box"]
    assert img_b.getpixel((x + 1, y + 1))[0] > 200 and img_b.getpixel((x + 1, y + 1))[1] < 60  # red label
    assert img_a.tobytes() != img_b.tobytes()


def test_contexts_are_reused_then_recycled(runner):
    cfg = EnvConfig(recycle_context_every=3)

    async def go():
        from asyncwebrl.web.browser import BrowserPool

        pool = BrowserPool.shared(cfg)
        env = MiniWoBEnv(cfg, pool=pool)
        try:
            sessions = []
            for i in range(7):
                await env.reset(Task("miniwob/click-test", seed=i))
                sessions.append(env.session)
            return sessions
        finally:
            await env.close()

    sessions = runner.run(go())
    assert len({id(s) for s in sessions}) == 3  # 3 + 3 + 1 episodes
    assert sessions[0] is sessions[2] and sessions[2] is not sessions[3]


def test_registry_and_errors():
    assert len(miniwob_all()) >= 120
    assert resolve_task_names("miniwob-easy") == MINIWOB_EASY
    assert resolve_task_names("click-test,miniwob/click-tab") == ["click-test", "click-tab"]
    with pytest.raises(ValueError, match="unknown MiniWoB task"):
        resolve_task_names("click-everything")


def test_sampler_is_deterministic_and_resumable():
    a = TaskSampler(MINIWOB_EASY, seed=3)
    first = [a.next() for _ in range(25)]
    assert {t.task_id for t in first[:9]} == {f"miniwob/{n}" for n in MINIWOB_EASY}  # one full pass
    state = a.state_dict()
    rest = [a.next() for _ in range(5)]
    b = TaskSampler(MINIWOB_EASY, seed=3)
    b.load_state_dict(state)
    assert [(t.task_id, t.seed) for t in rest] == [(t.task_id, t.seed) for t in (b.next() for _ in range(5))]
    c = TaskSampler(MINIWOB_EASY, seed=4)
    assert [(t.task_id, t.seed) for t in first[:5]] != [(t.task_id, t.seed) for t in (c.next() for _ in range(5))]
    with pytest.raises(ValueError, match="saved over"):
        TaskSampler(["click-test"]).load_state_dict(state)


def test_medium_and_heldout_subsets_are_real_tasks_disjoint_from_easy():
    medium, held = resolve_task_names("miniwob-medium"), resolve_task_names("miniwob-heldout")
    assert medium and held
    assert not (set(medium) | set(held)) & set(MINIWOB_EASY)
    assert not set(medium) & set(held)
