"""The inference server's cost model (issue 33): every limit refuses what breaks it before any image is
decoded, whatever the body size; a shared image is decoded once; decoded-image memory is reserved
against a budget (413 / 429); the fair queue serves clients round-robin. A real HTTP server (in a
thread of this process, tiny Qwen2.5-VL) on 127.0.0.1; every load is bounded in count and time."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import threading
import time

import psutil
import pytest
from PIL import Image

from asyncwebrl.inference.admission import CostLimits, FairQueue, MemoryBudget, Refused

MiB = 1024 * 1024
LIMITS = CostLimits(max_images=8, max_request_pixels=8 * MiB, bytes_per_pixel=32, memory_budget_bytes=96 * MiB,
                    client_budget_share=1.0)
"""the module server's limits: 96 MiB of decoded images at 32 bytes a pixel = 3 Mpx in flight, all of it
open to one client (the client share has its own test)"""


def png_b64(w: int, h: int, noise: bool = False) -> str:
    if noise:
        img = Image.frombytes("RGB", (w, h), os.urandom(w * h * 3))
    else:
        img = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def srv():
    from asyncwebrl.inference.engine import HFEngine
    from asyncwebrl.inference.server import launch_in_thread
    from asyncwebrl.models.prepare import resolve_model_path

    engine = HFEngine(resolve_model_path("tiny-qwen2.5-vl"), max_batch_size=4, max_context_len=512)
    engine.start()
    s = launch_in_thread(engine, limits=LIMITS)
    s.port = int(s.address.rsplit(":", 1)[1])
    yield s
    s.stop()
    engine.stop()


@pytest.fixture(scope="module")
def ids_for(srv):
    """(image b64) -> input_ids of a short prompt holding that image, as the rollout client builds them."""
    from asyncwebrl.models.vlm import decode_image

    adapter = srv.engine.adapter
    cache: dict[str, list[int]] = {}

    def make(b64: str) -> list[int]:
        if b64 not in cache:
            enc = adapter.encode("<|vision_start|><|image_pad|><|vision_end|>What is shown?",
                                 [decode_image(base64.b64decode(b64))])
            cache[b64] = list(enc.input_ids)
        return cache[b64]

    return make


def post(srv, body: dict, timeout: float = 60, client: str | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", **({"X-Client-Id": client} if client else {})}
        conn.request("POST", "/generate", body=json.dumps(body).encode(), headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def get(srv, path: str, timeout: float = 10) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def control(srv, path: str, body: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {srv.api_key}"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


class RssPeak:
    """Peak resident memory of this process (the server runs in it) while the block runs."""

    def __enter__(self):
        self.p = psutil.Process()
        self.base = self.p.memory_info().rss
        self.peak = self.base
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self.p.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *a):
        self._stop = True
        self._t.join()

    @property
    def grew(self) -> int:
        return self.peak - self.base


SMALL = {"max_new_tokens": 4, "temperature": 0}


def message(body: dict) -> str:
    return json.dumps(body)


# ---- one test per limit ----------------------------------------------------------------------------

def test_prompt_count_is_limited_whatever_the_body_size(srv):
    """3,000 prompts in a ~30 KB body are refused at once (the limit held only above 256 KiB before)."""
    body = {"input_ids": [[1, 2, 3]] * 3000, "sampling_params": {"max_new_tokens": 1}}
    assert len(json.dumps(body)) < 256 * 1024
    t0 = time.monotonic()
    status, out = post(srv, body, timeout=20)
    assert status == 400 and "3000 prompts" in message(out) and "256" in message(out)
    assert time.monotonic() - t0 < 5


def test_distinct_images_and_request_pixels_are_limited(srv):
    many = [png_b64(8, 8 + i) for i in range(LIMITS.max_images + 1)]
    status, out = post(srv, {"input_ids": [1, 2], "image_data": many, "sampling_params": SMALL})
    assert status == 400 and "distinct images" in message(out)
    big = [png_b64(1500, 1500 + i) for i in range(4)]  # each under the per-image limit, 9 Mpx together
    status, out = post(srv, {"input_ids": [1, 2], "image_data": big, "sampling_params": SMALL})
    assert status == 400 and "pixels" in message(out)


def test_placeholder_counts_are_checked_before_any_decoding(srv, ids_for):
    """Three concurrent requests with a 4 Mpx image and the wrong number of image tokens are refused
    from the image header alone: the server does not grow by the decoded images."""
    img = png_b64(2000, 2000)
    ids = ids_for(png_b64(64, 64))  # the token count of a 64x64 image, not of the 2000x2000 one
    results = []
    with RssPeak() as m:
        threads = [threading.Thread(target=lambda: results.append(
            post(srv, {"input_ids": ids, "image_data": [img], "sampling_params": SMALL}))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [s for s, _ in results] == [400] * 3
    assert all("image tokens" in message(o) for _, o in results)
    assert m.grew < 30 * MiB, f"grew {m.grew / MiB:.0f} MiB: images were decoded"  # one decode: 12+ MiB each


def test_a_shared_image_is_decoded_once(srv, ids_for):
    """64 prompts sharing one image string reserve, decode and keep that image once."""
    img = png_b64(1024, 1024, noise=True)
    ids = ids_for(img)
    warm = {"input_ids": [ids] * 4, "image_data": img, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    assert post(srv, warm, timeout=120)[0] == 200  # the first image forward sizes the allocator's arenas
    with RssPeak() as m:
        status, out = post(srv, {"input_ids": [ids] * 64, "image_data": img,
                                 "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=120)
    assert status == 200 and len(out) == 64
    info = get(srv, "/server_info")[1]["admission"]
    assert info["image_reserved_peak_bytes"] <= 1024 * 1024 * LIMITS.bytes_per_pixel
    # kept once per prompt, 64 processed copies of the image would be 64 x 1.2 MiB, plus 64 decodes
    assert m.grew < 40 * MiB, f"grew {m.grew / MiB:.0f} MiB for one shared 1 Mpx image"


def test_the_image_budget_refuses_with_429_then_413(srv, ids_for):
    """While one request holds 72 MiB of the 96 MiB budget another that needs 32 MiB gets 429; a request
    that alone needs more than the budget gets 413; once the first is done the second goes through."""
    held_img, other_img, huge_img = png_b64(1536, 1536), png_b64(1024, 1024), png_b64(2048, 2048)
    assert control(srv, "/pause_generation", {"mode": "in_place"}) == 200
    first: list = []
    t = threading.Thread(target=lambda: first.append(post(srv, {"input_ids": ids_for(held_img), "image_data": [held_img],
                                                               "sampling_params": SMALL}, timeout=120)))
    try:
        t.start()
        deadline = time.monotonic() + 30
        while get(srv, "/server_info")[1]["admission"]["image_reserved_bytes"] == 0:
            assert time.monotonic() < deadline, "the first request was never admitted"
            time.sleep(0.05)
        status, out = post(srv, {"input_ids": ids_for(other_img), "image_data": [other_img], "sampling_params": SMALL})
        assert status == 429 and "retry" in message(out)
        status, out = post(srv, {"input_ids": ids_for(huge_img), "image_data": [huge_img], "sampling_params": SMALL})
        assert status == 413 and "budget" in message(out)
    finally:
        assert control(srv, "/continue_generation", {}) == 200
        t.join(120)
    assert first and first[0][0] == 200
    status, _ = post(srv, {"input_ids": ids_for(other_img), "image_data": [other_img], "sampling_params": SMALL})
    assert status == 200


def test_unit_fair_queue_and_budget():
    got = []
    q = FairQueue(got.append, window=2)
    q.push("a", [f"a{i}" for i in range(5)])
    q.push("b", ["b0", "b1"])
    assert got == ["a0", "a1"]
    for item in ["a0", "a1", "a2", "b0", "a3"]:
        q.done(item[0])
    assert got[:6] == ["a0", "a1", "a2", "b0", "a3", "b1"]
    # the engine's queue: a client with nothing in gets its first prompt in past the window
    got.clear()
    q = FairQueue(got.append, window=2, first_always=True)
    q.push("a", ["a0", "a1", "a2"])
    q.push("b", ["b0", "b1"])
    assert got == ["a0", "a1", "b0"] and q.in_engine == 3
    # the preparation threads: one job of a client at a time
    got.clear()
    q = FairQueue(got.append, window=2, per_client=1)
    q.push("a", ["a0", "a1"])
    assert got == ["a0"]
    q.push("b", ["b0"])
    assert got == ["a0", "b0"]
    q.done("a")
    assert got == ["a0", "b0", "a1"]
    b = MemoryBudget(100)
    b.reserve(60)
    with pytest.raises(Refused) as e:
        b.reserve(50)
    assert e.value.status == 429
    with pytest.raises(Refused) as e:
        b.reserve(101)
    assert e.value.status == 413
    b.release(60)
    b.reserve(100)


# ---- the refresh bracket ---------------------------------------------------------------------------

def _batch_in_thread(srv, n: int, client: str) -> tuple[threading.Thread, list]:
    out: list = []
    body = {"input_ids": [[1, 2, 3, 4]] * n, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
    t = threading.Thread(target=lambda: out.append(post(srv, body, timeout=120, client=client)))
    t.start()
    return t, out


def _wait_queued(srv) -> dict:
    deadline = time.monotonic() + 30
    while True:
        a = get(srv, "/server_info")[1]["admission"]
        if a["queued_prompts"] > 0:
            return a
        assert time.monotonic() < deadline, f"the batch never queued: {a}"
        time.sleep(0.05)


def test_a_pause_in_place_holds_queued_prompts_and_they_run_after_continue(srv):
    assert control(srv, "/pause_generation", {"mode": "in_place"}) == 200
    try:
        t, out = _batch_in_thread(srv, 10, "batcher")
        a = _wait_queued(srv)
        assert a["in_engine_prompts"] == srv.engine.max_batch_size  # the window is full, the rest queued
    finally:
        assert control(srv, "/continue_generation", {}) == 200
    t.join(120)
    status, answers = out[0]
    assert status == 200 and [x["meta_info"]["finish_reason"]["type"] for x in answers] == ["length"] * 10


def test_a_pause_that_aborts_ends_queued_and_preparing_prompts_and_leaves_the_queues_empty(srv):
    assert control(srv, "/pause_generation", {"mode": "in_place"}) == 200
    try:
        t, out = _batch_in_thread(srv, 10, "batcher")
        _wait_queued(srv)
        assert control(srv, "/pause_generation", {"mode": "abort"}) == 200
        t.join(60)
        status, answers = out[0]
        assert status == 200 and [x["meta_info"]["finish_reason"]["type"] for x in answers] == ["abort"] * 10
        a = get(srv, "/server_info")[1]["admission"]
        assert (a["queued_prompts"], a["in_engine_prompts"], a["preparing_prompts"]) == (0, 0, 0), a
    finally:
        assert control(srv, "/continue_generation", {}) == 200
    status, answer = post(srv, {"input_ids": [1, 2, 3], "sampling_params": SMALL}, client="batcher")
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] != "abort"


def test_one_client_holds_at_most_its_share_of_the_image_budget():
    b = MemoryBudget(100, client_share=0.5)
    b.reserve(50, "a")
    with pytest.raises(Refused) as e:
        b.reserve(1, "a")
    assert e.value.status == 429 and "this client's share" in str(e.value)
    b.reserve(50, "b")  # another client finds the other half
    with pytest.raises(Refused) as e:
        b.reserve(51, "c")
    assert e.value.status == 413
    b.release(50, "a")
    b.reserve(50, "a")


def test_the_run_configs_cost_limits_reach_a_server_through_its_environment():
    """inference.cost.* overrides -> the launcher's $ASYNCWEBRL_COST_LIMITS -> the server's limits."""
    from asyncwebrl.configtree import build
    from asyncwebrl.inference.admission import COST_ENV
    from asyncwebrl.inference.config import InferenceConfig
    from asyncwebrl.inference.server import cost_limits

    cfg = build(InferenceConfig, {"cost": {"max_prompts": 8, "client_budget_share": 0.25}}, prefix="inference.")
    assert cost_limits([], cfg.cost.as_env()[COST_ENV]) == cfg.cost
    assert cost_limits(["max_prompts=4"], cfg.cost.as_env()[COST_ENV]).max_prompts == 4  # --cost comes last
