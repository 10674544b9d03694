"""Every endpoint of the embedded server round-trips over real HTTP (one subprocess per module);
bad input is a 400 with a message and the server keeps serving; the API key is enforced."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from PIL import Image

from asyncwebrl.inference.client import InferenceAuthError, InferenceClient
from asyncwebrl.models.vlm import VLMAdapter, encode_image_b64
from asyncwebrl.scheduling.servers import launch_server, wait_healthy

pytestmark = pytest.mark.slow
KEY = "server-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    srv = launch_server(wait=False, model=default_model_path, log_path=str(log), max_context_len=512, api_key=KEY)
    try:
        wait_healthy(srv.address, 300, proc=srv, api_key=KEY)
        yield srv.address
    finally:
        srv.stop()
    assert srv.proc.returncode is not None


@pytest.fixture(scope="module")
def adapter(default_model_path):
    return VLMAdapter(default_model_path)


def raw(addr: str, path: str, data: bytes | None, method: str = "POST", headers: dict | None = None,
        timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(addr + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def http(addr: str, path: str, body: dict | None = None, **kw) -> tuple[int, dict]:
    if body is None and kw.get("method", "POST") == "GET":
        return raw(addr, path, None, **kw)
    return raw(addr, path, json.dumps(body or {}).encode(), **kw)


def ids_of(adapter, text: str) -> list[int]:
    return adapter.encode(adapter.chat_text([{"role": "user", "content": [{"type": "text", "text": text}]}])).input_ids


def test_generate_text_ids_and_image_prompts(server, adapter):
    status, body = http(server, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 5,
                                                                                  "temperature": 0}})
    assert status == 200 and set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["completion_tokens"] == len(body["output_ids"]) <= 5 and meta["prompt_tokens"] >= 1
    assert meta["finish_reason"]["type"] in ("stop", "length") and "output_token_logprobs" not in meta
    assert {"id", "weight_version", "e2e_latency", "prompt_tokens"} <= set(meta)

    img = Image.new("RGB", (160, 210), (250, 10, 10))
    enc = adapter.encode(adapter.chat_text([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]), [img])
    status, body = http(server, "/generate", {
        "input_ids": enc.input_ids, "image_data": ["data:image/png;base64," + encode_image_b64(img)],
        "return_logprob": True, "rid": "img-1",
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}})
    assert status == 200, body
    lps = body["meta_info"]["output_token_logprobs"]
    assert body["meta_info"]["id"] == "img-1" and body["meta_info"]["prompt_tokens"] == len(enc.input_ids)
    assert [t for _, t, _ in lps] == body["output_ids"] and len(lps) == 6
    assert all(lp <= 0 and extra is None for lp, _, extra in lps)


def test_stream_sends_cumulative_chunks_then_done(server, adapter):
    req = urllib.request.Request(server + "/generate", data=json.dumps({
        "input_ids": ids_of(adapter, "Hi"), "stream": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).encode(),
        headers={"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert len(final["output_ids"]) == 4 and final["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_continue_abort_flush_version_and_info_endpoints(server, adapter):
    ids = ids_of(adapter, "Tell me a story.")
    got: dict = {}

    def long_request():
        got["r"] = http(server, "/generate", {"input_ids": ids, "rid": "long", "sampling_params": {
            "max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}})

    assert http(server, "/pause_generation", {})[1]["success"]
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 60
    while http(server, "/server_info", method="GET")[1]["waiting"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    info = http(server, "/server_info", method="GET")[1]
    assert info["paused"] and info["waiting"] == 1 and "r" not in got
    assert http(server, "/continue_generation", {})[1]["success"]
    deadline = time.time() + 60
    while http(server, "/server_info", method="GET")[1]["running"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    status, body = http(server, "/pause_generation", {"mode": "in_place"})
    assert status == 200 and body["running"] == 1
    n1 = http(server, "/server_info", method="GET")[1]["stats"]["generated_tokens"]
    time.sleep(0.5)
    assert http(server, "/server_info", method="GET")[1]["stats"]["generated_tokens"] == n1  # not scheduled
    assert "r" not in got  # ... and not lost
    assert http(server, "/continue_generation", {})[0] == 200
    assert http(server, "/abort_request", {"rid": "long"})[1]["n_aborted"] == 1
    t.join(60)
    status, body = got["r"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(body["output_ids"]) < 400
    assert http(server, "/abort_request", {"abort_all": True})[1]["success"]

    assert http(server, "/flush_cache", {})[1]["success"]
    assert http(server, "/update_weight_version", {"new_version": "5"})[1]["new_version"] == "5"
    status, body = http(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    assert body["meta_info"]["weight_version"] == "5"
    for path in ("/model_info", "/get_model_info"):
        status, info = http(server, path, method="GET")
        assert status == 200 and info["weight_version"] == "5" and info["is_generation"]
    assert http(server, "/health", method="GET")[1]["success"]
    assert http(server, "/server_info", method="GET")[1]["stats"]["errors"] == 0


@pytest.mark.parametrize("data, needle", [
    (b"{not json", "malformed JSON"),
    (b'{"input_ids": [1, 2], "temperature": 0}', "unknown field"),
    (b'{"input_ids": "12"}', "'input_ids'"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}', "max_new_tokens"),
    (b'{"input_ids": [1], "image_data": ["not-an-image"]}', "image_data[0]"),
    (b'{"input_ids": [99999999]}', "vocab size"),
    (json.dumps({"input_ids": [1] * 600}).encode(), "context length"),
    (b'{"input_ids": [1], "sampling_params": {"top_k": 0}}', "top_k must be -1 (disable) or at least 1"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "finite"),
    (b'{"text": ["a", ""]}', "'text' is empty"),
    (b'{"input_ids": [[1], [2]], "rid": ["x", "x"]}', "duplicate"),
])
def test_bad_generate_input_is_400_and_the_server_keeps_serving(server, data, needle):
    status, body = raw(server, "/generate", data)
    assert status == 400 and body["success"] is False and needle in body["message"], body
    status, body = http(server, "/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and len(body["output_ids"]) == 1


def test_bad_control_input_is_400(server):
    status, body = http(server, "/abort_request", {})  # SGLang answers 200 and aborts nothing: so do we
    assert status == 200 and body["n_aborted"] == 0, body
    assert http(server, "/pause_generation", {"mode": "sideways"})[0] == 400
    assert http(server, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"],
                                                             "shapes": [[1]], "group_name": "none"})[0] == 400
    assert http(server, "/destroy_weights_update_group", {"group_name": "none"})[0] == 400
    assert http(server, "/update_weight_version", {"new_version": None})[0] == 400
    assert raw(server, "/generate", b"[]")[0] == 400
    assert http(server, "/health", method="GET")[0] == 200


def test_api_key_required_on_every_request(tmp_path):
    from asyncwebrl.models.prepare import resolve_model_path

    srv = launch_server(wait=False, model=resolve_model_path("tiny-qwen2.5-vl"), api_key="s3cret",
                                  log_path=str(tmp_path / "log"))
    try:
        wait_healthy(srv.address, 300, proc=srv, api_key="s3cret")
        assert srv.address.startswith("http://127.0.0.1:")
        assert http(srv.address, "/health", method="GET")[0] == 200  # SGLang leaves /health open
        assert http(srv.address, "/model_info", method="GET")[0] == 401
        assert http(srv.address, "/generate", {"text": "hi"})[0] == 401
        assert http(srv.address, "/generate", {"text": "hi"}, headers={"Authorization": "Bearer wrong"})[0] == 401
        status, body = http(srv.address, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                            headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and len(body["output_ids"]) <= 2
        ok = InferenceClient([srv.address], api_key="s3cret").generate([1, 2, 3], None, {"max_new_tokens": 2})
        assert len(ok.output_ids) == len(ok.output_versions) <= 2
        with pytest.raises(InferenceAuthError):
            InferenceClient([srv.address]).generate([1, 2, 3], None, {"max_new_tokens": 2})
    finally:
        srv.stop()
