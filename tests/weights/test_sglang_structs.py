"""Our control API against SGLang 0.5.23's own, read from the wheel: every control body SGLang's
request structs accept (`io_struct.py`, field for field, with SGLang's defaults) is accepted by our
protocol models with the same defaults; every route our weight code calls is called with a method
SGLang's route table allows; and the embedded server answers the calls SGLang answers with 200
(`/abort_request {}`, fields it does not act on, listed in /model_info) and refuses what SGLang
refuses (a second update session)."""

from __future__ import annotations

import ast
import glob
import json
import os
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from asyncwebrl.protocol import REQUEST_TYPES, parse_request

SGLANG_VERSION = "0.5.23"
WHEEL_DIR = Path(os.environ.get("ASYNCWEBRL_SGLANG_WHEEL_DIR", Path.home() / ".cache" / "asyncwebrl" / "sglang-wheel"))
NOT_HERE = {"/generate", "/update_weights_from_tensor", "/flush_cache"}
"""/generate is GenerateReqInput (a dataclass, tested in tests/inference), the tensor route is its own
issue's, and SGLang's /flush_cache reads no body"""
SAMPLE = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
          "names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "model_path": "/tmp/ckpt", "new_version": "3"}
"""values for SGLang's required fields"""


@pytest.fixture(scope="module")
def sglang_src() -> dict[str, str]:
    found = sorted(glob.glob(str(WHEEL_DIR / f"sglang-{SGLANG_VERSION}-*.whl")))
    if not found:
        pytest.fail(f"no sglang-{SGLANG_VERSION} wheel in {WHEEL_DIR}: run `make setup`")
    with zipfile.ZipFile(found[-1]) as z:
        return {k: z.read(f"sglang/srt/{k}").decode() for k in ("managers/io_struct.py", "entrypoints/http_server.py")}


def structs(src: str) -> dict[str, dict[str, object]]:
    """class -> {field: default (... when required, None when not a literal)} with BaseReq's fields."""
    out: dict[str, dict[str, object]] = {}
    for n in ast.parse(src).body:
        if not isinstance(n, ast.ClassDef):
            continue
        fields: dict[str, object] = {}
        for b in n.bases:
            if isinstance(b, ast.Name) and b.id in out:
                fields.update(out[b.id])
        for a in n.body:
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name):
                try:
                    fields[a.target.id] = ... if a.value is None else ast.literal_eval(a.value)
                except ValueError:
                    fields[a.target.id] = None
        out[n.name] = fields
    return out


def routes(src: str) -> dict[str, tuple[set[str], str | None]]:
    """path -> (methods, body struct name) from SGLang's http_server decorators and signatures."""
    out: dict[str, tuple[set[str], str | None]] = {}
    for n in ast.walk(ast.parse(src)):
        if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = None
        for a in n.args.args:
            ann = ast.unparse(a.annotation) if a.annotation else ""
            if ann.startswith("Annotated[") and "Body()" in ann:
                body = ann.removeprefix("Annotated[").split(",")[0]
        for d in n.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and isinstance(d.func.value, ast.Name)
                    and d.func.value.id == "app" and d.args and isinstance(d.args[0], ast.Constant)):
                continue
            kind = d.func.attr
            methods = {kind.upper()} if kind != "api_route" else set(ast.literal_eval(
                next(k.value for k in d.keywords if k.arg == "methods")))
            old = out.get(d.args[0].value, (set(), None))
            out[d.args[0].value] = (old[0] | methods, body or old[1])
    return out


def test_our_control_bodies_take_sglangs_structs_field_for_field(sglang_src):
    table, sts = routes(sglang_src["entrypoints/http_server.py"]), structs(sglang_src["managers/io_struct.py"])
    checked = []
    for path, ours in REQUEST_TYPES.items():
        if path in NOT_HERE or path not in table:
            continue
        fields = sts[table[path][1]]
        body = {f: SAMPLE[f] if d is ... else d for f, d in fields.items()}
        parse_request(ours, {k: v for k, v in body.items()})  # every SGLang field, at SGLang's default
        for f, d in fields.items():
            assert f in ours.model_fields, f"{path}: SGLang's field '{f}' is not in {ours.__name__}"
            if d is not ... and d is not None:
                assert ours.model_fields[f].default == d, f"{path}: default of '{f}' differs from SGLang's ({d!r})"
        parse_request(ours, {**body, "a_field_of_a_later_sglang": 1})  # SGLang ignores unknown fields
        checked.append(path)
    assert len(checked) >= 10, checked
    assert REQUEST_TYPES["/update_weight_version"].model_fields["abort_all_requests"].default is True


def test_the_weight_path_calls_sglang_routes_with_their_methods(sglang_src):
    table = routes(sglang_src["entrypoints/http_server.py"])
    posted = ["/pause_generation", "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
              "/flush_cache", "/update_weight_version", "/continue_generation", "/init_weights_update_group",
              "/destroy_weights_update_group", "/update_weights_from_disk", "/abort_request"]
    for p in posted:
        assert "POST" in table[p][0], p
    assert table["/server_info"][0] == {"GET"}  # the sender asks it with GET (a POST is 405 there)
    assert {"GET"} <= table["/model_info"][0]


# ---- the embedded server -------------------------------------------------------------------------

KEY = "sglang-structs-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.scheduling.servers import launch_server, wait_healthy

    tiny = os.environ.get("ASYNCWEBRL_TINY_MODEL") or str(Path(resolve_model_path("default")).parent / "tiny-qwen2.5-vl")
    srv = launch_server(model=tiny, log_path=tmp_path_factory.mktemp("srv") / "s.log", wait=False, api_key=KEY)
    try:
        wait_healthy(srv.address, 300, proc=srv, api_key=KEY)
        yield srv.address
    finally:
        srv.stop()


def post(addr: str, path: str, body: dict | None, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(addr + path, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.slow
def test_embedded_server_answers_what_sglang_answers(server):
    assert post(server, "/abort_request", {})[0] == 200
    assert post(server, "/continue_generation", {"torch_empty_cache": False, "rid": "c1"})[0] == 200
    assert post(server, "/begin_weight_update", {"rid": "b1", "selector": "all"})[0] == 200
    code, answer = post(server, "/begin_weight_update", {})
    assert code == 400 and "already open" in json.dumps(answer)
    assert post(server, "/end_weight_update", {"rid": "e1"})[0] == 200
    assert post(server, "/flush_cache", {"timeout_s": 1.0})[0] == 200
    assert post(server, "/update_weight_version", {"new_version": "7", "abort_all_requests": False, "rid": "v"})[0] == 200
    info = post(server, "/model_info", None, "GET")[1]
    assert info["weight_version"] == "7"
    assert {"is_async", "keep_pause", "torch_empty_cache"} <= set(info["ignored_fields"]["/update_weights_from_disk"])
    assert "torch_empty_cache" in info["ignored_fields"]["/continue_generation"]


def _dataclass_fields(src: str, name: str) -> set[str]:
    cls = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == name)
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def test_every_field_our_client_sends_to_generate_is_one_sglang_reads(sglang_src):
    """Our rollout's /generate body, with every option the client uses (the prefix-cache namespace
    included), names only fields of SGLang's GenerateReqInput: a real SGLang server acts on each."""
    from asyncwebrl.protocol import build_generate_payload, cache_key_of

    body = build_generate_payload([1, 2, 3], [b"\x89PNG"], {"max_new_tokens": 4, "temperature": 1.0}, rid="r-0",
                                  return_logprob=True, cache_key=cache_key_of(7))
    fields = _dataclass_fields(sglang_src["managers/io_struct.py"], "GenerateReqInput")
    assert "extra_key" in fields and body["extra_key"] == "weights-v7"
    assert set(body) <= fields, set(body) - fields
