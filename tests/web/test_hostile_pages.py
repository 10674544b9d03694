"""Pages that fight the environment (issue 33): a page cannot decide its own reward, cannot make a step
fail under any cause but `EnvCrashed`, cannot hold a rollout slot silently, and cannot strand the agent
on `about:blank`. Real Chromium, real MiniWoB++ pages, real local sites on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from asyncwebrl.web.base import EnvCrashed, EnvDeadline, Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv
from asyncwebrl.web.webgym import WebGymEnv, load_task_file

pytestmark = pytest.mark.browser

CFG = EnvConfig(type="webgym", task_file="x", viewport_width=320, viewport_height=240)

# What a page that wants reward 1 (or wants the env to trip) does to the JS world the env reads from.
LIAR_JS = r"""
window.Boolean = function () { return true; };
JSON.stringify = function () { return '{"not": json'; };
JSON.parse = function () { return {done: true, reward: 1}; };
Array.prototype.includes = function () { return true; };
Array.prototype.indexOf = function () { return 0; };
Array.prototype.some = function () { return true; };
Array.prototype.every = function () { return true; };
Function.prototype.call = function () { return true; };
Function.prototype.apply = function () { return true; };
document.querySelector = function () { return {checked: true, value: 'yes', textContent: 'yes'}; };
document.getElementById = function () { return {checked: true, value: 'yes', textContent: 'yes'}; };
Object.defineProperty(HTMLInputElement.prototype, 'checked', {get() { return true; }, set(v) {}});
"""

# the part a MiniWoB page can take without breaking its own jQuery (which needs call/apply)
JSON_LIAR_JS = r"""
window.Boolean = function () { return true; };
JSON.stringify = function () { return '{"not": json'; };
JSON.parse = function () { return {done: true, reward: 1}; };
Array.prototype.includes = function () { return true; };
"""

PAGE = """<!DOCTYPE html><html><head><title>liar</title><script>{js}</script></head><body>
<label><input type="checkbox" id="agree"> I agree</label>
<button onclick="document.body.dataset.clicked = '1'">Press</button>
<p id="note">no</p>
</body></html>"""

# each predicate with its true verdict on the untouched page (nothing clicked, box unticked)
PREDICATES = [
    ("false", False),
    ("0", False),
    ("document.querySelector('#agree').checked", False),
    ("document.getElementById('agree').checked", False),
    ("document.getElementById('note').textContent === 'yes'", False),
    ("[1, 2].includes(3)", False),
    ("[1, 2].indexOf(3) === 0", False),
    ("JSON.stringify({a: 1}) === '{\"a\":1}'", True),
    ("document.querySelectorAll('input').length === 1", True),
    ("document.body.dataset.clicked === '1'", False),
]


def _site(tmp_path, js: str, predicates: list[str]):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "index.html").write_text(PAGE.format(js=js))
    f = tmp_path / "tasks.jsonl"
    f.write_text("".join(json.dumps({"id": f"liar/{i}", "instruction": "Do nothing.", "site": "site",
                                     "start_url": "index.html", "max_steps": 3,
                                     "evaluator": {"type": "js_predicate", "script": p}}) + "\n"
                         for i, p in enumerate(predicates)))
    return load_task_file(f)


def _verdicts(runner, tasks, cfg=CFG, action=None):
    async def go():
        env = WebGymEnv(cfg)
        out = []
        try:
            for t in tasks:
                await env.reset(t)
                _, res = await env.step(action or {"type": "wait"})
                out.append(res.success)
        finally:
            await env.close()
        return out

    return runner.run(go())


def test_a_page_cannot_change_any_evaluator_verdict(runner, tmp_path):
    """Overriding Boolean, JSON, Array.prototype, Function.prototype.call and document.querySelector
    in the page changes no js_predicate verdict: evaluators run in a world of their own."""
    preds = [p for p, _ in PREDICATES]
    hostile = _verdicts(runner, _site(tmp_path, LIAR_JS, preds))
    assert hostile == [want for _, want in PREDICATES]


def test_honest_verdicts_still_follow_the_page(runner, tmp_path):
    """The isolated world sees the live DOM: ticking the box makes the checkbox predicate true."""
    (t,) = _site(tmp_path, "", ["document.getElementById('agree').checked"])

    async def go():
        env = WebGymEnv(CFG)
        try:
            obs = await env.reset(t)
            box = next(e for e in obs.elements if e["role"] == "checkbox")
            _, res = await env.step({"type": "click", "element": box["id"]})
            return res
        finally:
            await env.close()

    res = runner.run(go())
    assert res.success and res.done and res.reward == 1.0


def test_a_page_that_replaces_json_stringify_does_not_break_the_step(runner, tmp_path):
    """env.step of a page that replaced JSON.stringify observes it as usual (no JSONDecodeError)."""
    (t,) = _site(tmp_path, "JSON.stringify = function () { return '{oops'; };", ["false"])

    async def go():
        env = WebGymEnv(CFG)
        try:
            obs = await env.reset(t)
            o2, res = await env.step({"type": "wait"})
            return obs, o2, res
        finally:
            await env.close()

    obs, o2, res = runner.run(go())
    assert {e["role"] for e in obs.elements} >= {"checkbox", "button"}
    def unnumbered(elements):  # the ids are drawn anew for every observation
        return [{k: v for k, v in e.items() if k != "id"} for e in elements]

    assert unnumbered(o2.elements) == unnumbered(obs.elements) and not res.invalid and not res.success


def test_a_page_that_breaks_the_observation_fails_as_envcrashed(runner, tmp_path):
    """A page that makes reading the page throw fails the episode as EnvCrashed with the cause named."""
    js = "Element.prototype.getBoundingClientRect = function () { throw new Error('no boxes here'); };"
    (t,) = _site(tmp_path, js, ["false"])

    async def go():
        env = WebGymEnv(CFG)
        try:
            with pytest.raises(EnvCrashed) as e:
                await env.reset(t)
            return str(e.value)
        finally:
            await env.close()

    msg = runner.run(go())
    assert "no boxes here" in msg


def test_miniwob_reward_reads_ignore_a_patched_json(runner):
    """A MiniWoB page whose JSON, Boolean and Array.prototype are patched still reports its true reward."""
    from asyncwebrl.web.actions import parse_action
    from asyncwebrl.web.oracles import oracle_action

    async def go():
        env = MiniWoBEnv(EnvConfig())
        try:
            obs = await env.reset(Task("miniwob/click-button", seed=3))
            await env.session.page.evaluate(f"() => {{ {JSON_LIAR_JS} }}")
            good = (await env.step(parse_action(oracle_action("click-button", obs))))[1]
            for seed in range(4, 30):  # a seed with a wrong button to press
                obs = await env.reset(Task("miniwob/click-button", seed=seed))
                target = obs.instruction.split('"')[1]
                wrong = [e for e in obs.elements if e["role"] == "button" and e["name"] != target]
                if wrong:
                    break
            await env.session.page.evaluate(f"() => {{ {JSON_LIAR_JS} }}")
            wrong = wrong[0]
            bad = (await env.step({"type": "click", "element": wrong["id"]}))[1]
            return good, bad
        finally:
            await env.close()

    good, bad = runner.run(go())
    assert good.done and good.success and good.reward == 1.0
    assert bad.done and not bad.success and bad.reward == 0.0


def test_default_step_deadline_suits_miniwob():
    cfg = EnvConfig()
    assert cfg.step_timeout_s <= 15, "a MiniWoB step takes tens of milliseconds; a minute per step hides stalls"
    assert cfg.episode_timeout_s <= 300 and cfg.slow_step_s < cfg.step_timeout_s
    bad = EnvConfig(episode_timeout_s=0)
    with pytest.raises(ValueError, match="episode_timeout_s"):
        bad.validate()


STALL_JS = """addEventListener('click', () => { const t = Date.now(); while (Date.now() - t < 1200) {} });"""


def test_slow_steps_are_reported_and_the_episode_is_bounded(runner, tmp_path):
    """A page that stalls every step for just under the step deadline: each such step is reported slow,
    and the episode ends with EnvDeadline once its wall budget is spent, not after max_steps stalls."""
    (t,) = _site(tmp_path, STALL_JS, ["false"])
    t.max_steps = 20
    cfg = EnvConfig(type="webgym", task_file="x", viewport_width=320, viewport_height=240,
                    step_timeout_s=5.0, slow_step_s=0.8, episode_timeout_s=5.0)

    async def go():
        env = WebGymEnv(cfg)
        results = []
        try:
            obs = await env.reset(t)
            with pytest.raises(EnvDeadline) as e:
                for _ in range(20):
                    button = next(e for e in obs.elements if e["role"] == "button")  # ids drawn per observation
                    obs, res = await env.step({"type": "click", "element": button["id"]})
                    results.append(res)
            return results, str(e.value)
        finally:
            await env.close()

    results, msg = runner.run(go())
    assert 1 <= len(results) <= 4, len(results)
    assert all(r.slow and r.step_s >= 0.8 for r in results)
    assert "episode" in msg


def test_a_fast_step_is_not_slow(runner, tmp_path):
    (t,) = _site(tmp_path, "", ["false"])
    res = None

    async def go():
        env = WebGymEnv(CFG)
        try:
            await env.reset(t)
            return (await env.step({"type": "wait"}))[1]
        finally:
            await env.close()

    res = runner.run(go())
    assert not res.slow and 0 < res.step_s < CFG.slow_step_s


def test_go_back_on_the_first_page_does_not_land_on_about_blank(runner):
    from asyncwebrl.web.webgym import DEMO_TASKS

    task = next(t for t in load_task_file(DEMO_TASKS) if t.task_id == "demo/about")

    async def go():
        env = WebGymEnv(CFG)
        try:
            start = await env.reset(task)
            obs, res = await env.step({"type": "go_back"})
            return start, obs, res
        finally:
            await env.close()

    start, obs, res = runner.run(go())
    assert obs.url == start.url and not obs.url.startswith("about:")
    assert res.invalid and "about:" in res.info.get("error", "")


def test_go_back_in_miniwob_keeps_the_task_page(runner):
    async def go():
        env = MiniWoBEnv(EnvConfig())
        try:
            start = await env.reset(Task("miniwob/click-button", seed=1))
            obs, res = await env.step({"type": "go_back"})
            again, res2 = await env.step({"type": "wait"})
            return start, obs, res, again, res2
        finally:
            await env.close()

    start, obs, res, again, res2 = runner.run(go())
    assert obs.url == start.url and res.invalid and not res.done
    assert again.url == start.url and not res2.invalid and again.elements
