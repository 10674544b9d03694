"""On the production episode path (`run_episode`, what rollout workers run): a page that busy-loops
its main thread ends the episode as a FAILED trajectory (counted, its error named) within the step
deadline, and the same environment plays its next episode normally. (The env-level cases — dead
origin, unresolvable name — are in tests/web/test_isolation.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from asyncwebrl.pixelstore.store import InProcessPixelStore
from asyncwebrl.protocol import GenerationOutput
from asyncwebrl.rollout.episode import run_episode
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.webgym import WebGymEnv, load_task_file

pytestmark = pytest.mark.browser


class FixedReplies:
    """Stands in for the inference client (same agenerate signature): replies with fixed action text."""

    def __init__(self, adapter, text: str):
        self.adapter, self.text = adapter, text

    async def agenerate(self, input_ids, image_data, sampling, sticky_key=None, rid=None, cache_key=None):
        ids = self.adapter.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return GenerationOutput(output_ids=ids, output_logprobs=[-0.5] * len(ids), output_versions=[1] * len(ids),
                                text=self.text, finish_reason="stop", prompt_tokens=len(input_ids),
                                server="stand-in", latency_s=0.0)


def test_busy_page_fails_the_episode_and_the_worker_goes_on(tmp_path, default_model_path):
    from asyncwebrl.models.vlm import VLMAdapter

    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text('<html><body><button onclick="while (true) {}">Hang</button></body></html>')
    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps({"id": "hang", "instruction": "press it", "site": "site", "start_url": "index.html",
                             "max_steps": 2, "evaluator": {"type": "url_match", "pattern": "never"}}) + "\n")
    task = load_task_file(f)[0]
    cfg = EnvConfig(type="webgym", task_file=str(f), step_timeout_s=4, viewport_width=160, viewport_height=210)
    adapter = VLMAdapter(default_model_path)
    store = InProcessPixelStore()

    async def go():
        pool = BrowserPool(cfg)
        env = WebGymEnv(cfg, pool=pool)
        try:
            t0 = time.monotonic()
            hung = await run_episode(env, task, FixedReplies(adapter, "click [1]"), adapter, store,
                                     {"max_new_tokens": 8}, cfg, 1)
            took = time.monotonic() - t0
            fine = await run_episode(env, task, FixedReplies(adapter, "wait"), adapter, store,
                                     {"max_new_tokens": 8}, cfg, 1)
            return hung, took, fine
        finally:
            await env.close()
            await pool.close()

    hung, took, fine = asyncio.run(asyncio.wait_for(go(), 120))
    assert hung.failed and not hung.success and hung.reward == 0.0
    assert hung.info["error"].startswith("env_crashed") and "4 s deadline" in hung.info["error"]
    assert took < 30
    assert not fine.failed and len(fine.steps) == 2 and fine.truncated
    assert store.stats()["items"] == len(fine.all_pixel_keys())  # the failed episode's pixels were freed
