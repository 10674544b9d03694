"""Bad input never crashes or hangs anything: random JSON and random bytes thrown at every endpoint of a
real inference server always get a JSON 2xx/4xx answer (never a 5xx, never a hang) and the server still
generates afterwards; random task files load or raise a TaskFileError naming line and field.
(The action parser is fuzzed in tests/web/test_actions.py and configs in test_config_fuzz.py.)"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncwebrl.scheduling.servers import launch_server, wait_healthy
from asyncwebrl.web.webgym import TaskFileError, load_task_file

POST_PATHS = ["/generate", "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
              "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
              "/update_weights_from_disk", "/update_weight_version"]
GET_PATHS = ["/health", "/model_info", "/server_info", "/weights_checksum", "/flush_cache", "/nope"]
# /init_weights_update_group with a well-formed body would make the server dial a rendezvous; the
# fuzzer keeps master_address unroutable-fast (loopback, closed port) via the body strategy below.

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12,
)
FIELDS = ["text", "input_ids", "image_data", "sampling_params", "rid", "stream", "return_logprob", "max_new_tokens",
          "temperature", "weight_version", "model_path", "names", "dtypes", "shapes", "group_name", "version",
          "master_address", "master_port", "rank_offset", "world_size", "backend"]
BODY = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(-5, 10**6), max_size=8),
                           "sampling_params": st.dictionaries(st.sampled_from(
                               ["max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids"]),
                               JSON, max_size=4)}),
)


KEY = "fuzz-key"


def _call(addr: str, path: str, data: bytes | None, method: str) -> tuple[int, object]:
    req = urllib.request.Request(addr + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from asyncwebrl.models.prepare import resolve_model_path

    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    srv = launch_server(wait=False, model=resolve_model_path("tiny-qwen2.5-vl"), log_path=str(log), max_context_len=256,
                        api_key=KEY)
    try:
        wait_healthy(srv.address, 300, proc=srv, api_key=KEY)
        yield srv.address
    finally:
        srv.stop()


def _generates(addr: str) -> None:
    code, body = _call(addr, "/generate", json.dumps(
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).encode(), "POST")
    assert code == 200 and 1 <= len(body["output_ids"]) <= 2, body


def _safe(path: str, body: object) -> object:
    # keep any rendezvous the fuzzer asks for short and local: a closed loopback port fails at once
    if path == "/init_weights_update_group" and isinstance(body, dict):
        body = dict(body, master_address="127.0.0.1", master_port=9, timeout_s=2)
    if path in ("/pause_generation",):  # a paused server would make later /generate calls wait
        return None
    return body


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(POST_PATHS), body=BODY)
def test_random_json_bodies_get_a_json_4xx_or_2xx(server, path, body):
    body = _safe(path, body)
    if body is None:
        return
    code, answer = _call(server, path, json.dumps(body).encode(), "POST")
    assert code < 500, (path, body, answer)
    assert isinstance(answer, dict)
    if code >= 400:
        assert answer.get("message") or answer.get("error"), answer
    _call(server, "/continue_generation", b"{}", "POST")


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(POST_PATHS + GET_PATHS), data=st.binary(max_size=300),
       method=st.sampled_from(["POST", "GET", "PUT"]))
def test_random_bytes_get_a_json_4xx_or_2xx(server, path, data, method):
    if path in ("/pause_generation",):
        return
    code, answer = _call(server, path, data if method != "GET" else None, method)
    assert code < 500 and isinstance(answer, dict), (path, data, answer)
    _call(server, "/continue_generation", b"{}", "POST")


@pytest.mark.slow
def test_server_still_generates_after_the_fuzzing(server):
    _call(server, "/continue_generation", b"{}", "POST")
    _generates(server)
    code, health = _call(server, "/health", None, "GET")
    assert code == 200


TASK_LINE = st.one_of(
    st.text(max_size=80),
    JSON.map(json.dumps),
    st.fixed_dictionaries(
        {"id": st.text(max_size=8), "instruction": st.text(max_size=20),
         "start_url": st.sampled_from(["http://127.0.0.1:1/x", "https://example.com", "file:///etc/passwd",
                                       "chrome://settings", "", "nota url"])},
        optional={"allowed_origins": JSON, "max_steps": JSON, "evaluator": JSON, "site": JSON},
    ).map(json.dumps),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(TASK_LINE, max_size=5))
def test_random_task_files_load_or_name_the_line_and_field(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("tasks") / "t.jsonl"
    text = "\n".join(lines)
    path.write_text(text)
    try:
        tasks = load_task_file(path)
    except TaskFileError as e:
        msg = str(e)
        assert str(path) in msg
        m = re.search(r":(\d+): field '", msg)
        if m is None:  # the only file-level complaint: nothing but blank/comment lines
            assert "holds no tasks" in msg, msg
        else:
            assert 1 <= int(m.group(1)) <= max(1, len(text.splitlines()))  # the loader's line numbering
    else:
        for t in tasks:
            assert t.task_id and t.instruction and t.start_url


def test_missing_task_file_is_a_task_file_error(tmp_path):
    with pytest.raises(TaskFileError, match="does not exist"):
        load_task_file(tmp_path / "absent.jsonl")
