"""No web page and no bad request can touch the inference server (issue 20, server
half). One real `asyncwebrl serve` (tiny model, key in its environment, control scope) is attacked the
way a page in the agent's browser or a hostile client would; each test fails if its guard is removed.
Loopback addresses only."""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import psutil
import pytest

from asyncwebrl.scheduling.servers import launch_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from asyncwebrl.models.prepare import resolve_model_path

    root = tmp_path_factory.mktemp("weights-root")
    s = launch_server(model=resolve_model_path("tiny-qwen2.5-vl"), log_path=str(root.parent / "server.log"),
                      max_context_len=256, weights_roots=[str(root)], allow_auto_truncate=False)
    s.weights_root = root
    yield s
    s.stop()


def req(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
        timeout: float = 60) -> tuple[int, dict]:
    port = int(srv.address.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def control(srv, path: str, body: dict, extra: dict | None = None) -> tuple[int, dict]:
    return req(srv, "POST", path, json.dumps(body).encode(),
               {"Content-Type": "application/json", "Authorization": f"Bearer {srv.api_key}", **(extra or {})})


def version(srv) -> str:
    return req(srv, "GET", "/model_info")[1]["weight_version"]


def test_key_stays_out_of_the_process_list_and_control_endpoints_need_it(srv):
    cmdline = " ".join(psutil.Process(srv.pid).cmdline())
    assert srv.api_key and srv.api_key not in cmdline
    for path, body in [("/update_weight_version", {"new_version": "evil"}), ("/pause_generation", {"mode": "abort"}),
                       ("/continue_generation", {}), ("/flush_cache", {}), ("/abort_request", {"abort_all": True}),
                       ("/update_weights_from_disk", {"model_path": str(srv.weights_root)}),
                       ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 9,
                                                       "rank_offset": 1, "world_size": 2, "backend": "gloo"}),
                       ("/destroy_weights_update_group", {})]:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": srv.api_key}):
            status, answer = req(srv, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json", **auth})
            assert status == 401 and answer["error"]["message"], (path, auth, status)
    assert version(srv) != "evil"
    # generation stays open to loopback programs (control scope), as with SGLang without a key
    status, out = req(srv, "POST", "/generate", b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}',
                      {"Content-Type": "application/json"})
    assert status == 200 and len(out["output_ids"]) == 1
    assert control(srv, "/update_weight_version", {"new_version": "0"})[0] == 200


def test_a_form_post_from_a_page_is_refused(srv):
    """What a <form enctype=text/plain> posting to the server sends (body shaped as JSON)."""
    form = b'{"new_version": "pwned", "x": "="}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        # even with the key (a leaked one): the body type alone is refused
        status, answer = req(srv, "POST", "/update_weight_version", form,
                             {"Content-Type": ctype, "Authorization": f"Bearer {srv.api_key}"})
        assert status == 415 and "application/json" in answer["error"]["message"], (ctype, status)
    assert version(srv) != "pwned"


@pytest.mark.parametrize("header", [("Origin", "http://attacker.example"), ("Origin", "null"),
                                    ("Sec-Fetch-Site", "cross-site"), ("Sec-Fetch-Mode", "no-cors")])
def test_requests_from_browsers_are_refused(srv, header):
    status, answer = control(srv, "/update_weight_version", {"new_version": "pwned"}, dict([header]))
    assert status == 403 and header[0] in answer["error"]["message"]
    status, _ = req(srv, "POST", "/generate", b'{"text": "hi"}', {"Content-Type": "application/json", header[0]: header[1]})
    assert status == 403
    assert req(srv, "GET", "/server_info", headers=dict([header]))[0] == 403
    assert version(srv) != "pwned"


def test_dns_rebinding_host_is_refused(srv):
    port = srv.address.rsplit(":", 1)[1]
    for host in (f"attacker.example:{port}", "rebind.attacker.example", f"localhost.attacker.example:{port}"):
        status, answer = control(srv, "/update_weight_version", {"new_version": "pwned"}, {"Host": host})
        assert status == 403 and "Host" in answer["error"]["message"], host
        assert req(srv, "GET", "/server_info", headers={"Host": host})[0] == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert req(srv, "GET", "/server_info", headers={"Host": host})[0] == 200, host
    assert version(srv) != "pwned"


def test_disk_loads_only_from_weight_roots_and_groups_dial_only_trainers(srv, tmp_path):
    outside = tmp_path / "attacker-weights"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"x")
    before = req(srv, "GET", "/weights_checksum")[1]["sha256"]
    for path in (str(outside), str(srv.weights_root / ".." / outside.name), "/"):
        status, answer = control(srv, "/update_weights_from_disk", {"model_path": path, "weight_version": "pwned"})
        assert status == 400 and "weight roots" in answer["error"]["message"], (path, answer)
    # a link inside the root that points outside is judged by its target
    link = srv.weights_root / "link"
    link.symlink_to(outside)
    status, answer = control(srv, "/update_weights_from_disk", {"model_path": str(link)})
    assert status == 400 and "weight roots" in answer["error"]["message"]
    link.unlink()
    t0 = time.monotonic()
    status, answer = control(srv, "/init_weights_update_group", {
        "master_address": "192.0.2.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    assert status == 400 and "trainer address" in answer["error"]["message"] and time.monotonic() - t0 < 5
    assert req(srv, "GET", "/weights_checksum")[1]["sha256"] == before and version(srv) != "pwned"


def _send_headers_only(srv, path: str, length: int) -> tuple[int, float]:
    """POST claiming `length` bytes, sending only a little: the answer must not wait for the rest."""
    port = int(srv.address.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    t0 = time.monotonic()
    try:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode() + b'{"input_ids": [' + b"1," * 1000)
        status = int(s.recv(4096).split(b" ", 2)[1])
        return status, time.monotonic() - t0
    finally:
        s.close()


def test_huge_bodies_are_refused_from_their_length_and_health_stays_fast(srv):
    status, took = _send_headers_only(srv, "/generate", 100 * 2**20)
    assert status == 413 and took < 2
    assert _send_headers_only(srv, "/update_weight_version", 8 * 2**20)[0] == 413
    # a large body under the limit (25 MB of token ids) is read and parsed off the event loop:
    # /health answers within 1 s all the while
    body = b'{"input_ids": [' + b"7," * (12_500_000 - 1) + b'7], "sampling_params": {"max_new_tokens": 1}}'

    def health_s() -> float:
        t0 = time.monotonic()
        assert req(srv, "GET", "/health", timeout=30)[0] == 200
        return time.monotonic() - t0

    # this machine's cores are shared: the allowance is 1 s or, on a loaded box, 3x the idle worst case
    idle = 0.0
    for _ in range(20):
        idle = max(idle, health_s())
        time.sleep(0.05)
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(r=req(srv, "POST", "/generate", body,
                                                          {"Content-Type": "application/json"}, timeout=120)))
    t.start()
    worst, polls = 0.0, 0
    while t.is_alive():
        worst, polls = max(worst, health_s()), polls + 1
        time.sleep(0.05)
    t.join()
    assert done["r"][0] == 400 and "context length" in done["r"][1]["error"]["message"]  # 12.5M tokens > 256
    print(f"/health worst {worst:.3f} s over {polls} polls while a 25 MB body was parsed (idle worst {idle:.3f} s)")
    assert polls >= 3 and worst < max(1.0, 3 * idle), f"/health took {worst:.2f} s (idle worst {idle:.2f} s)"


def _png_header_says(width: int, height: int) -> bytes:
    """A valid grayscale PNG of width x height, all zero: ~100 KB on the wire, width*height bytes decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_image_bombs_are_refused_from_the_header_before_decoding(srv):
    import base64

    png = base64.b64encode(_png_header_says(8000, 8000)).decode()
    rss = psutil.Process(srv.pid).memory_info().rss
    body = {"text": "<|vision_start|><|image_pad|><|vision_end|>hi", "image_data": png,
            "sampling_params": {"max_new_tokens": 1}}
    status, answer = req(srv, "POST", "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 400 and "8000x8000" in answer["error"]["message"], answer
    assert psutil.Process(srv.pid).memory_info().rss - rss < 150 * 2**20
    many = dict(body, image_data=[base64.b64encode(_png_header_says(8, 8)).decode()] * 17)
    status, answer = req(srv, "POST", "/generate", json.dumps(many).encode(), {"Content-Type": "application/json"})
    assert status == 400 and "17 images" in answer["error"]["message"]


@pytest.mark.parametrize("image", ["file:///etc/passwd", "/etc/passwd", "http://127.0.0.1:9/x.png", "~/.ssh/id_rsa"])
def test_image_data_is_never_fetched_or_opened(srv, image):
    """SGLang also takes file names and URLs; here image_data is data only: no file read, no request."""
    body = {"text": "<|vision_start|><|image_pad|><|vision_end|>hi", "image_data": image,
            "sampling_params": {"max_new_tokens": 1}}
    status, answer = req(srv, "POST", "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 400 and "image_data[0]" in answer["error"]["message"], answer


def test_long_text_prompts_are_refused_before_tokenizing(srv):
    body = json.dumps({"text": "word " * 1_000_000, "sampling_params": {"max_new_tokens": 1}}).encode()
    t0 = time.monotonic()
    status, answer = req(srv, "POST", "/generate", body, {"Content-Type": "application/json"})
    assert status == 400 and "characters exceeds the limit" in answer["error"]["message"]
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("raw, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),
    (b'{"text": "\\ud800"}', "malformed JSON"),
    (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "finite"),
    (b'{"text": "hi", "sampling_params": {"temperature": Infinity}}', "finite"),
    (b"\xff\xfe\x00", "malformed JSON"),
])
def test_malformed_bodies_are_400_not_500(srv, raw, needle):
    status, answer = req(srv, "POST", "/generate", raw, {"Content-Type": "application/json"})
    assert status == 400 and needle in answer["error"]["message"], answer


def test_a_tiny_temperature_is_greedy_not_an_overflow(srv):
    status, out = req(srv, "POST", "/generate", json.dumps({"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 4, "temperature": 3e-39, "ignore_eos": True}}).encode(), {"Content-Type": "application/json"})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
    _, greedy = req(srv, "POST", "/generate", json.dumps({"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).encode(), {"Content-Type": "application/json"})
    assert out["output_ids"] == greedy["output_ids"]


def test_a_key_file_written_by_a_server_is_private(tmp_path, monkeypatch):
    import argparse

    from asyncwebrl.inference.server import policy_from_args

    monkeypatch.delenv("ASYNCWEBRL_API_KEY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    policy, path = policy_from_args(argparse.Namespace(host="127.0.0.1", api_key=None), 1234)
    assert path and Path(path).read_text() == policy.api_key and policy.key_scope == "control"
    assert os.stat(path).st_mode & 0o777 == 0o600
    lan, _ = policy_from_args(argparse.Namespace(host="0.0.0.0", api_key=None), 1235)
    assert lan.key_scope == "all"  # a server others can reach never serves anything without the key
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by group/others"):
        policy_from_args(argparse.Namespace(host="127.0.0.1", api_key=None, api_key_file=path), 1234)
