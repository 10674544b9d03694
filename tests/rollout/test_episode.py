"""The multi-step episode loop against real MiniWoB in Chromium: per-step samples line up with what
the server saw, pixels go to the store (or ride inline), bad outputs are invalid steps, a crashed
browser gives a failed trajectory with its pixel references released."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import threading

import pytest

from asyncwebrl.pixelstore.store import InProcessPixelStore
from asyncwebrl.protocol import GenerationOutput
from asyncwebrl.rollout.episode import run_episode
from asyncwebrl.web.base import Observation, Task
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv
from asyncwebrl.web.oracles import oracle_action

pytestmark = pytest.mark.browser
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0}


@pytest.fixture(scope="module")
def adapter(default_model_path):
    from asyncwebrl.models.vlm import VLMAdapter

    return VLMAdapter(default_model_path)


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    pools: list[BrowserPool] = []

    def run(coro_fn, timeout=300):
        async def wrapped():
            pool = BrowserPool(EnvConfig())
            pools.append(pool)
            return await coro_fn(pool)
        return asyncio.run_coroutine_threadsafe(wrapped(), lp).result(timeout)

    yield run
    for p in pools:
        asyncio.run_coroutine_threadsafe(p.close(), lp).result(60)
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)


class ScriptedClient:
    """Stands in for InferenceClient (same agenerate signature). It reads the prompt back from the
    token ids, so the oracle it consults sees only what the model would see."""

    def __init__(self, adapter, policy, versions=True):
        self.adapter, self.policy, self.versions = adapter, policy, versions
        self.calls: list[dict] = []
        self.released: list[str] = []

    async def agenerate(self, input_ids, image_data, sampling, sticky_key=None, rid=None, cache_key=None):
        prompt = self.adapter.tokenizer.decode(input_ids)
        self.calls.append(dict(input_ids=list(input_ids), image_data=image_data, sticky_key=sticky_key, prompt=prompt,
                               cache_key=cache_key))
        text = self.policy(prompt)
        ids = self.adapter.tokenizer(text, add_special_tokens=False)["input_ids"]
        return GenerationOutput(output_ids=ids, output_logprobs=[-0.5] * len(ids),
                                output_versions=[3] * len(ids) if self.versions else [],
                                text=text, finish_reason="stop", prompt_tokens=len(input_ids),
                                server="fake", latency_s=0.0)

    def release(self, key):
        self.released.append(key)


def oracle_from_prompt(task_name):
    def policy(prompt: str) -> str:
        last = prompt.rsplit("<|im_start|>user", 1)[1]
        instruction = re.search(r"Task: (.*)", last).group(1).strip()
        elements = []
        for m in re.finditer(r'^\[(\d+)\] (\w+) "(.*?)"(.*)$', last, flags=re.M):
            rest = m.group(4)
            value = re.search(r'value="(.*?)"', rest)
            elements.append({"id": int(m.group(1)), "role": m.group(2), "name": m.group(3),
                             "checked": "(checked)" in rest, "box": [0, 0, 1, 1],
                             **({"value": value.group(1)} if value else {})})
        return oracle_action(task_name, Observation(screenshot=b"", instruction=instruction, elements=elements))
    return policy


def play_one(loop, cfg, task, client, adapter, store, version, **kw):
    """One episode of `task` on a fresh MiniWoB env of the test loop's pool."""

    async def go(pool):
        env = MiniWoBEnv(cfg, pool=pool)
        try:
            return await run_episode(env, task, client, adapter, store, SAMPLING, cfg, version=version, **kw)
        finally:
            await env.close()

    return loop(go)


def test_oracle_episode_store_transport(loop, adapter):
    cfg = EnvConfig()
    store = InProcessPixelStore("t")
    client = ScriptedClient(adapter, oracle_from_prompt("click-button"))

    traj = play_one(loop, cfg, Task("miniwob/click-button", seed=4, max_steps=3), client, adapter, store, 7)
    assert traj.success and traj.reward == 1.0 and not traj.truncated and not traj.failed
    assert len(traj.steps) == 1 and traj.task_id == "miniwob/click-button#4"
    s, call = traj.steps[0], client.calls[0]
    assert s.prompt_ids == call["input_ids"] and call["sticky_key"] == traj.traj_id
    assert len(s.output_ids) == len(s.behave_logprobs) == len(s.versions) and s.versions == [3] * len(s.versions)
    assert s.pixels is None and len(s.pixel_keys) == 1
    png = store.get(s.pixel_keys)[0]
    assert png.startswith(b"\x89PNG") and base64.b64decode(call["image_data"][0]) == png
    assert adapter.image_token_id in s.prompt_ids
    assert len(s.prompt_ids) < 250, len(s.prompt_ids)  # short prompts: CPU cost is prompt length
    assert "click [" in call["prompt"] and "type [" in call["prompt"]  # the two format examples
    assert client.released == [traj.traj_id]


def test_multistep_object_store_transport_and_history(loop, adapter):
    cfg = EnvConfig(history_k=2)
    store = InProcessPixelStore("t")
    client = ScriptedClient(adapter, oracle_from_prompt("enter-text"))

    traj = play_one(loop, cfg, Task("miniwob/enter-text", seed=9, max_steps=4), client, adapter, store, 0,
                    pixel_transport="object_store")
    assert traj.success and len(traj.steps) == 2
    assert store.stats()["items"] == 0 and all(not s.pixel_keys for s in traj.steps)
    assert [len(s.pixels) for s in traj.steps] == [1, 2]  # sliding window of the last 2 screenshots
    assert traj.steps[1].pixels[0] == traj.steps[0].pixels[0]
    assert "Done so far: type [" in client.calls[1]["prompt"]


def test_requests_never_share_a_prefix_cache_with_older_weights(loop, adapter):
    """SGLang cannot flush its prefix cache while an in-place refresh holds requests, so each request
    names the weights its episode started under (`extra_key`): an episode keeps its namespace across
    a refresh, and an episode that starts after it never reuses KV cached under the older weights."""
    from asyncwebrl.protocol import cache_key_of

    cfg = EnvConfig(history_k=1)
    version = {"v": 4}

    def policy(prompt):
        version["v"] = 5  # a refresh lands while the episode runs
        return oracle_from_prompt("enter-text")(prompt)

    client = ScriptedClient(adapter, policy)
    task = Task("miniwob/enter-text", seed=9, max_steps=4)
    first = play_one(loop, cfg, task, client, adapter, InProcessPixelStore("t"), lambda: version["v"])
    n = len(client.calls)
    second = play_one(loop, cfg, task, client, adapter, InProcessPixelStore("t"), lambda: version["v"])
    assert first.success and second.success and n == 2
    assert [c["cache_key"] for c in client.calls] == [cache_key_of(4)] * 2 + [cache_key_of(5)] * 2


def test_shared_window_keys_are_refcounted(loop, adapter):
    cfg = EnvConfig(history_k=2)
    store = InProcessPixelStore(capacity_bytes=64 << 20)
    client = ScriptedClient(adapter, oracle_from_prompt("enter-text"))

    traj = play_one(loop, cfg, Task("miniwob/enter-text", seed=9, max_steps=4), client, adapter, store, 0)
    keys = traj.all_pixel_keys()
    assert len(keys) == 3 and len(set(keys)) == 2
    store.free(traj.steps[0].pixel_keys)
    assert store.count_missing(traj.steps[1].pixel_keys) == 0  # still used by step 2
    store.free(traj.steps[1].pixel_keys)
    assert store.stats()["items"] == 0


def test_unparsable_outputs_are_penalized_and_truncated(loop, adapter):
    cfg = EnvConfig(invalid_action_penalty=-0.1)
    client = ScriptedClient(adapter, lambda prompt: "I am not sure what to do", versions=False)

    traj = play_one(loop, cfg, Task("miniwob/click-test", seed=1, max_steps=3), client, adapter,
                    InProcessPixelStore(), lambda: 5)
    assert len(traj.steps) == 3 and traj.n_invalid == 3 and traj.truncated and not traj.success
    assert traj.reward == pytest.approx(-0.3)
    assert all(s.invalid and s.action is None and set(s.versions) == {5} for s in traj.steps)
    assert traj.info["n_unchanged"] == 3


def test_an_action_that_changes_nothing_is_penalized_apart_from_invalid_ones(loop, adapter):
    """A click on empty space is a valid action that does nothing: it costs no_effect_penalty per
    step; an unparsable output costs invalid_action_penalty and is not double counted; the button click
    that solves a task costs nothing."""
    cfg = EnvConfig(invalid_action_penalty=-0.1, no_effect_penalty=-0.05)
    outputs = iter(["click [150, 200]", "gibberish", "click [150, 200]"])
    client = ScriptedClient(adapter, lambda prompt: next(outputs), versions=False)
    traj = play_one(loop, cfg, Task("miniwob/choose-list", seed=4, max_steps=3), client, adapter,
                    InProcessPixelStore(), 0)
    assert len(traj.steps) == 3 and not traj.success
    assert [s.no_effect for s in traj.steps] == [True, False, True]
    assert [s.invalid for s in traj.steps] == [False, True, False]
    assert traj.n_no_effect == 2 and traj.n_invalid == 1
    assert traj.reward == pytest.approx(-0.1 - 2 * 0.05)

    solved = play_one(loop, cfg, Task("miniwob/click-test", seed=1, max_steps=3),
                      ScriptedClient(adapter, oracle_from_prompt("click-test")), adapter, InProcessPixelStore(), 0)
    assert solved.success and solved.n_no_effect == 0 and solved.reward == 1.0


def test_browser_crash_gives_failed_trajectory_and_frees_pixels(loop, adapter):
    cfg = EnvConfig()
    store = InProcessPixelStore()

    async def go(pool):
        env = MiniWoBEnv(cfg, pool=pool)

        def crash_then_answer(prompt):
            os.kill(pool.browser_pid(), signal.SIGKILL)
            return "click [1]"

        try:
            traj = await run_episode(env, Task("miniwob/click-test", seed=1, max_steps=3),
                                     ScriptedClient(adapter, crash_then_answer), adapter, store, SAMPLING, cfg, 0)
            again = await run_episode(env, Task("miniwob/click-test", seed=2, max_steps=3),
                                      ScriptedClient(adapter, oracle_from_prompt("click-test")), adapter, store,
                                      SAMPLING, cfg, 0)
            return traj, again
        finally:
            await env.close()

    traj, again = loop(go)
    assert traj.failed and not traj.success and traj.reward == 0.0
    assert traj.info["error"].startswith("env_crashed")
    assert store.count_missing(again.all_pixel_keys()) == 0
    assert store.stats()["items"] == len(again.all_pixel_keys())  # the failed episode's pixels were freed
    assert again.success  # the same env goes on, on a relaunched browser


@pytest.mark.slow
def test_episode_against_real_embedded_server(loop, adapter, default_model_path):
    from asyncwebrl.inference.client import InferenceClient
    from asyncwebrl.scheduling.servers import launch_server

    cfg = EnvConfig()
    server = launch_server(model=default_model_path, startup_timeout=300)
    try:
        async def go(pool):
            client = InferenceClient([server.address])
            env = MiniWoBEnv(cfg, pool=pool)
            try:
                return await run_episode(env, Task("miniwob/click-button", seed=3, max_steps=2), client, adapter,
                                         InProcessPixelStore(), {"max_new_tokens": 8, "temperature": 1.0,
                                                                 "stop_token_ids": adapter.eos_token_ids},
                                         cfg, version=0)
            finally:
                await env.close()
                await client.aclose()

        traj = loop(go, timeout=600)
    finally:
        server.stop()
    assert not traj.failed, traj.info
    assert 1 <= len(traj.steps) <= 2
    for s in traj.steps:
        assert 0 < len(s.output_ids) <= 8 and len(s.output_ids) == len(s.behave_logprobs) == len(s.versions)
        assert all(lp <= 0 for lp in s.behave_logprobs) and all(v >= 0 for v in s.versions)
        assert len(s.prompt_ids) < 250
