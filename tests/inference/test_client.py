"""The rollout-side client against real HTTP servers (in-thread, tiny model): sticky episodes,
retries then failover, 400s not retried; pause/resume of every server through the refresh bracket's
control channel; the one health probe."""

from __future__ import annotations

import asyncio

import pytest

from asyncwebrl.inference.client import InferenceClient, InferenceUnavailable
from asyncwebrl.inference.engine import HFEngine
from asyncwebrl.inference.server import launch_in_thread
from asyncwebrl.net import answers_health, free_port
from asyncwebrl.protocol import ProtocolError

SAMPLING = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
KEY = "client-test-key"


@pytest.fixture(scope="module")
def servers():
    from asyncwebrl.models.prepare import resolve_model_path

    path = resolve_model_path("tiny-qwen2.5-vl")
    out = []
    for _ in range(2):
        eng = HFEngine(path, cpu_threads=1)
        eng.start()
        out.append(launch_in_thread(eng, api_key=KEY))
    yield [s.address for s in out]
    for s in out:
        s.stop()


def run(coro):
    return asyncio.run(coro)


def test_episode_sticks_to_its_server_and_moves_when_it_fails(servers):
    async def go():
        c = InferenceClient(servers, api_key=KEY)
        try:
            a = [await c.agenerate([1, 2, 3], None, SAMPLING, sticky_key="ep1") for _ in range(3)]
            assert len({o.server for o in a}) == 1
            first = a[0].server
            c.mark_failed(first)
            b = await c.agenerate([1, 2, 3], None, SAMPLING, sticky_key="ep1")
            assert b.server != first
            c.restore(first)
            assert (await c.agenerate([1, 2, 3], None, SAMPLING, sticky_key="ep1")).server == b.server
            # concurrent new episodes spread over the least-loaded servers
            outs = await asyncio.gather(*(c.agenerate([1, 2, 3], None, {**SAMPLING, "max_new_tokens": 8},
                                                      sticky_key=f"e{i}") for i in range(4)))
            assert {o.server for o in outs} == set(servers)
            for o in outs:
                assert len(o.output_ids) == len(o.output_logprobs) == len(o.output_versions) == 8
                assert o.output_versions == [0] * 8 and o.finish_reason == "length" and o.prompt_tokens == 3
        finally:
            await c.aclose()

    run(go())


def test_dead_server_is_retried_then_failed_over(servers):
    dead = f"http://127.0.0.1:{free_port()}"

    async def go():
        c = InferenceClient([dead, servers[0]], api_key=KEY, max_retries=2, retry_backoff_s=0.01, timeout_s=10)
        try:
            out = await c.agenerate([5, 6, 7], None, SAMPLING, sticky_key="x")
            assert out.server == servers[0] and c.stats["retries"] == 2 and c.stats["failovers"] == 1
            assert dead not in c.healthy_addresses()
            assert not answers_health(dead, KEY, timeout_s=2) and answers_health(servers[0], KEY, timeout_s=2)
        finally:
            await c.aclose()
        only_dead = InferenceClient([dead], api_key=KEY, max_retries=1, retry_backoff_s=0.01, timeout_s=5)
        with pytest.raises(InferenceUnavailable):
            await only_dead.agenerate([1], None, SAMPLING)
        await only_dead.aclose()

    run(go())


def test_bad_request_is_raised_not_retried(servers):
    async def go():
        c = InferenceClient(servers, api_key=KEY, max_retries=3)
        try:
            with pytest.raises(ProtocolError, match="vocab size"):
                await c.agenerate([10**8], None, SAMPLING)
            assert c.stats["retries"] == 0 and c.stats["failovers"] == 0
            with pytest.raises(ProtocolError, match="top_p"):
                await c.agenerate([1], None, {"top_p": 2.0})
        finally:
            await c.aclose()

    run(go())


def test_pause_resume_and_version_on_all_servers(servers):
    from asyncwebrl.weights.control import ControlChannel

    control = ControlChannel(servers, api_key=KEY, timeout_s=60)  # what the refresh bracket calls

    def call_all(endpoint: str, body: dict) -> dict:
        return control.call_all(endpoint, body)

    async def go():
        c = InferenceClient(servers, api_key=KEY)
        try:
            answers = await asyncio.to_thread(call_all, "/pause_generation", {"mode": "in_place"})
            assert set(answers) == set(servers)
            task = asyncio.create_task(c.agenerate([1, 2], None, SAMPLING))
            await asyncio.sleep(0.5)
            assert not task.done()  # paused servers keep the request
            await asyncio.to_thread(call_all, "/update_weight_version", {"new_version": "4"})
            await asyncio.to_thread(call_all, "/continue_generation", {})
            out = await asyncio.wait_for(task, 60)
            assert out.output_versions == [4] * 3
        finally:
            await asyncio.to_thread(call_all, "/update_weight_version", {"new_version": "0"})
            await c.aclose()

    try:
        run(go())
    finally:
        control.close()
    assert all(answers_health(a, KEY) for a in servers)


@pytest.mark.parametrize("status, body, exc, needle", [
    (400, {"error": {"message": "top_k must be -1 (disable) or at least 1, got 0."}}, ProtocolError, "top_k must be"),
    (401, {"error": "Unauthorized"}, "auth", "Unauthorized"),
    (422, {"detail": [{"loc": ["body", "text"], "msg": "field required"}]}, ProtocolError, "field required"),
])
def test_errors_in_sglang_shapes_reach_the_caller_with_their_message(status, body, exc, needle):
    """Real SGLang answers {"error": {"message"}} (and {"error": "Unauthorized"}, FastAPI's {"detail"}):
    the client raises with that message, not an empty one."""
    from aiohttp import web

    from asyncwebrl.inference.client import InferenceAuthError

    async def go():
        app = web.Application()
        app.router.add_post("/generate", lambda request: web.json_response(body, status=status))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        c = InferenceClient([f"http://127.0.0.1:{port}"], max_retries=0)
        try:
            with pytest.raises(InferenceAuthError if exc == "auth" else exc, match=needle):
                await c.agenerate([1, 2], None, SAMPLING)
        finally:
            await c.aclose()
            await runner.cleanup()

    run(go())
