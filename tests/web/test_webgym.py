"""WebGym-style task files on the shipped demo site: evaluators decide success, bad files fail at
load naming line and field, the VLM judge is off unless configured."""

from __future__ import annotations

import json

import pytest

from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.webgym import DEMO_TASKS, TaskFileError, WebGymEnv, load_task_file

CFG = EnvConfig(type="webgym", task_file=str(DEMO_TASKS), viewport_width=320, viewport_height=240)


def _tasks():
    return {t.task_id: t for t in load_task_file(DEMO_TASKS)}


def _el(obs, name):
    return next(e["id"] for e in obs.elements if e["name"] == name)


@pytest.mark.browser
def test_demo_tasks_solved_by_the_right_actions(runner):
    tasks = _tasks()

    async def go():
        env = WebGymEnv(CFG)
        out = {}
        try:
            obs = await env.reset(tasks["demo/about"])
            out["about_wrong"] = (await env.step(parse_action(f"click [{_el(obs, 'Products')}]")))[1]
            obs = await env.reset(tasks["demo/about"])
            out["about"] = (await env.step(parse_action(f"click [{_el(obs, 'About')}]")))[1]
            obs = await env.reset(tasks["demo/contact"])
            obs, _ = await env.step(parse_action(f"type [{_el(obs, 'Your name')}] [Alice]"))
            out["contact"] = (await env.step(parse_action(f"click [{_el(obs, 'Send')}]")))[1]
            await env.reset(tasks["demo/price"])
            out["price_wrong"] = (await env.step(parse_action("ANSWER [$9]")))[1]
            await env.reset(tasks["demo/price"])
            out["price"] = (await env.step(parse_action("send_msg_to_user('$12')")))[1]
            obs = await env.reset(tasks["demo/agree"])
            out["agree"] = (await env.step(parse_action(f"click [{_el(obs, 'I agree to the terms')}]")))[1]
        finally:
            await env.close()
        return out

    r = runner.run(go())
    assert not r["about_wrong"].done and not r["about_wrong"].success
    for k in ("about", "contact", "price", "agree"):
        assert r[k].done and r[k].success and r[k].reward == 1.0, k
    assert r["price_wrong"].done and not r["price_wrong"].success


def test_difficulty_sets_step_budget():
    t = _tasks()
    assert t["demo/about"].max_steps == 10 and t["demo/price"].max_steps == 3


@pytest.mark.parametrize(
    "line, field",
    [
        ("{not json", "<json>"),
        (json.dumps({"instruction": "x", "start_url": "https://a.org", "max_steps": 3,
                     "evaluator": {"type": "url_match", "pattern": "y"}}), "id"),
        (json.dumps({"id": "a", "instruction": "x", "start_url": "https://a.org", "difficulty": "extreme",
                     "evaluator": {"type": "url_match", "pattern": "y"}}), "difficulty"),
        (json.dumps({"id": "a", "instruction": "x", "start_url": "https://a.org", "max_steps": 0,
                     "evaluator": {"type": "url_match", "pattern": "y"}}), "max_steps"),
        (json.dumps({"id": "a", "instruction": "x", "start_url": "https://a.org", "max_steps": 3,
                     "evaluator": {"type": "oracle"}}), "evaluator.type"),
        (json.dumps({"id": "a", "instruction": "x", "start_url": "https://a.org", "max_steps": 3,
                     "evaluator": {"type": "answer_match"}}), "evaluator.answers"),
        (json.dumps({"id": "a", "instruction": "x", "start_url": "https://a.org", "max_steps": 3,
                     "allowed_origins": ["not an origin"], "evaluator": {"type": "url_match", "pattern": "y"}}),
         "allowed_origins"),
        (json.dumps({"id": "a", "instruction": "x", "start_url": "https://a.org", "max_steps": 3, "colour": 1,
                     "evaluator": {"type": "url_match", "pattern": "y"}}), "colour"),
        (json.dumps({"id": "a", "instruction": "x", "start_url": "index.html", "max_steps": 3,
                     "evaluator": {"type": "url_match", "pattern": "y"}}), "start_url"),
    ],
)
def test_bad_task_file_names_line_and_field(tmp_path, line, field):
    good = json.dumps({"id": "ok", "instruction": "x", "start_url": "https://a.org", "difficulty": "easy",
                       "evaluator": {"type": "url_match", "pattern": "y"}})
    f = tmp_path / "tasks.jsonl"
    f.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TaskFileError) as e:
        load_task_file(f)
    assert f"{f}:3:" in str(e.value) and f"'{field}'" in str(e.value)


def test_duplicate_ids_and_empty_files(tmp_path):
    line = json.dumps({"id": "a", "instruction": "x", "start_url": "https://a.org", "max_steps": 2,
                       "evaluator": {"type": "url_match", "pattern": "y"}})
    f = tmp_path / "t.jsonl"
    f.write_text(line + "\n" + line + "\n")
    with pytest.raises(TaskFileError, match=r":2: field 'id': duplicate"):
        load_task_file(f)
    f.write_text("# only a comment\n")
    with pytest.raises(TaskFileError, match="no tasks"):
        load_task_file(f)
    with pytest.raises(TaskFileError, match="does not exist"):
        load_task_file(tmp_path / "missing.jsonl")


def _judge_task_file(tmp_path):
    f = tmp_path / "judge.jsonl"
    f.write_text(json.dumps({"id": "demo/judge", "instruction": "Find the blue mug price.",
                             "site": str(DEMO_TASKS.parent), "start_url": "products.html", "max_steps": 2,
                             "evaluator": {"type": "vlm_judge", "rubric": "The answer is $12."}}) + "\n")
    return load_task_file(f)[0]


@pytest.mark.browser
def test_vlm_judge_is_off_by_default_and_works_when_configured(runner, tmp_path):
    from aiohttp import web

    task = _judge_task_file(tmp_path)
    seen = []

    async def chat(request):
        body = await request.json()
        seen.append(body)
        text = body["messages"][0]["content"][0]["text"]
        verdict = "YES" if "$12" in text.split("final answer:")[1] else "NO"
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": verdict}}]})

    async def go():
        with pytest.raises(ValueError, match="vlm_judge_url"):
            await WebGymEnv(CFG).reset(task)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app_runner = web.AppRunner(app)
        await app_runner.setup()
        site = web.TCPSite(app_runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        cfg = EnvConfig(type="webgym", task_file="x", viewport_width=320, viewport_height=240,
                        vlm_judge_url=f"http://127.0.0.1:{port}/v1")
        env = WebGymEnv(cfg)
        try:
            await env.reset(task)
            good = (await env.step(parse_action("ANSWER [$12]")))[1]
            await env.reset(task)
            bad = (await env.step(parse_action("ANSWER [$9]")))[1]
        finally:
            await env.close()
            await app_runner.cleanup()
        return good, bad

    good, bad = runner.run(go())
    assert good.success and good.done and bad.done and not bad.success
    assert seen[0]["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
