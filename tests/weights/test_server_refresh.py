"""Weight refresh against a real server subprocess: broadcast from a separate trainer process
(TCPStore + ProcessGroupGloo), load from disk, a dead trainer, and the client's abort-resubmit loop
keeping tokens, logprobs and versions aligned across an update."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from asyncwebrl.inference.client import InferenceClient
from asyncwebrl.inference.engine import params_checksum
from asyncwebrl.models.vlm import VLMAdapter, load_model
from asyncwebrl.scheduling.servers import free_port, launch_server
from asyncwebrl.weights.group import join_group

pytestmark = pytest.mark.slow
SYNC_TIMEOUT_S = 6
KEY = "weights-test-key"


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    srv = launch_server(model=default_model_path, log_path=log, weight_sync_timeout_s=SYNC_TIMEOUT_S, api_key=KEY,
                        weights_roots=[str(tmp_path_factory.getbasetemp()), default_model_path])
    yield srv.address
    srv.stop()


@pytest.fixture(scope="module")
def adapter(default_model_path):
    return VLMAdapter(default_model_path)


def http(addr: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(addr + path, data=data, headers={"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy(addr: str, ids: list[int], n: int = 8) -> dict:
    status, body = http(addr, "/generate", {"input_ids": ids, "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                "ignore_eos": True}})
    assert status == 200, body
    return body


def prompt(adapter, text: str) -> list[int]:
    return adapter.encode(adapter.chat_text([{"role": "user", "content": [{"type": "text", "text": text}]}])).input_ids


def test_update_from_distributed_changes_served_weights_bit_exactly(server, adapter, default_model_path):
    ids = prompt(adapter, "Name three colours.")
    before = greedy(server, ids)
    sum_before = http(server, "/weights_checksum")[1]["sha256"]
    port = free_port()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("trainer_proc.py")), "--server", server, "--model",
         default_model_path, "--port", str(port), "--version", "7", "--seed", "3"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "ASYNCWEBRL_API_KEY": KEY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["success"] for r in sent["replies"]) and sent["destroy"]["success"], sent
    served = http(server, "/weights_checksum")[1]
    assert served["sha256"] == sent["checksum"] != sum_before
    assert http(server, "/model_info")[1]["weight_version"] == "7"
    after = greedy(server, ids)
    assert after["meta_info"]["weight_version"] == "7"
    assert after["meta_info"]["output_token_versions"] == ["7"] * 8
    assert after["output_ids"] != before["output_ids"]
    assert http(server, "/server_info")[1]["weight_update_groups"] == []


def test_dead_or_silent_trainer_is_an_http_error_not_a_hang(server, adapter):
    # nobody listens on the store port: joining fails within the timeout
    t0 = time.monotonic()
    status, body = http(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "group_name": "nobody", "backend": "gloo"})
    assert status == 500 and not body["success"] and time.monotonic() - t0 < SYNC_TIMEOUT_S + 30
    # a trainer that forms the group, announces a bucket, and never broadcasts
    port = free_port()
    timeout = datetime.timedelta(seconds=60)
    joined: dict = {}
    t = threading.Thread(target=lambda: joined.update(r=http(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "silent", "backend": "gloo"})))
    t.start()
    group = join_group("127.0.0.1", port, 0, 2, "silent", "gloo", "cpu", timeout.total_seconds())
    t.join()
    assert joined["r"][0] == 200, joined
    assert http(server, "/begin_weight_update", {})[0] == 200
    checksum = http(server, "/weights_checksum")[1]["sha256"]
    t0 = time.monotonic()
    status, body = http(server, "/update_weights_from_distributed", {
        "names": ["model.text_model.norm.weight"], "dtypes": ["float32"], "shapes": [[576]],
        "group_name": "silent", "weight_version": "99"})
    assert status == 500 and "time" in body["message"].lower(), body
    assert time.monotonic() - t0 < SYNC_TIMEOUT_S + 30
    assert http(server, "/health")[0] == 200
    assert http(server, "/weights_checksum")[1]["sha256"] == checksum
    assert http(server, "/model_info")[1]["weight_version"] != "99"
    assert len(greedy(server, prompt(adapter, "still there?"), 3)["output_ids"]) == 3
    assert http(server, "/end_weight_update", {})[0] == 200
    assert http(server, "/destroy_weights_update_group", {"group_name": "silent"})[0] == 200
    group.destroy()


@pytest.fixture(scope="module")
def perturbed(default_model_path, tmp_path_factory):
    """A modified copy of the default model saved as an HF folder, and the modified model itself."""
    model = load_model(default_model_path)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    out = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(out)
    return str(out), model, params_checksum(model.named_parameters())


def _teacher_forced(model, prompt_ids, out_ids):
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([prompt_ids + out_ids])).logits[0].float().log_softmax(-1)
    return torch.tensor([float(lp[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(out_ids)])


async def _generate_across_update(server, ids, n, new_path, new_version, abort):
    client = InferenceClient([server], api_key=KEY)
    try:
        task = asyncio.create_task(client.agenerate(ids, None, {"max_new_tokens": n, "temperature": 1.0,
                                                                "ignore_eos": True}, sticky_key="ep"))
        start = (await client.call(server, "/server_info", method="GET"))["stats"]["generated_tokens"]
        deadline = time.monotonic() + 120
        while (await client.call(server, "/server_info", method="GET"))["stats"]["generated_tokens"] < start + 5:
            assert time.monotonic() < deadline, "the request generated no tokens in 120 s"
            await asyncio.sleep(0.05)
        res = await client.aupdate_weights_from_disk(new_path, new_version, abort_all_requests=abort)
        assert res[server]["success"], res
        return await asyncio.wait_for(task, 300)
    finally:
        await client.aclose()


def test_update_from_disk_and_abort_resubmit_keeps_versions_aligned(server, adapter, perturbed, default_model_path):
    path, pmodel, psum = perturbed
    status, body = http(server, "/update_weights_from_disk", {"model_path": path, "weight_version": 10})
    assert status == 200 and body["success"], body
    assert http(server, "/weights_checksum")[1] == {"sha256": psum, "weight_version": "10"}

    ids = prompt(adapter, "Tell me a long story about a browser agent.")
    n = 60
    out = asyncio.run(_generate_across_update(server, ids, n, default_model_path, 11, abort=True))
    assert len(out.output_ids) == len(out.output_logprobs) == len(out.output_versions) == n
    assert out.finish_reason == "length" and out.n_resubmits >= 1
    k = out.output_versions.index(11)
    assert 0 < k < n and out.output_versions == [10] * k + [11] * (n - k)
    # old tokens came from the perturbed weights, new ones from the original: each matches its model
    orig = load_model(default_model_path)
    lp = torch.tensor(out.output_logprobs)
    assert torch.allclose(lp[:k], _teacher_forced(pmodel, ids, out.output_ids)[:k], atol=1e-3)
    assert torch.allclose(lp[k:], _teacher_forced(orig, ids, out.output_ids)[k:], atol=1e-3)
    assert http(server, "/weights_checksum")[1]["sha256"] == params_checksum(orig.named_parameters())

    # without abort_all_requests the request is paused, continues on the new weights, and is not resubmitted
    out2 = asyncio.run(_generate_across_update(server, ids, n, path, 12, abort=False))
    assert out2.n_resubmits == 0 and len(out2.output_ids) == len(out2.output_versions) == n
    k2 = out2.output_versions.index(12)
    assert 0 < k2 < n and out2.output_versions == [11] * k2 + [12] * (n - k2)


def test_update_from_disk_bad_input(server, tmp_path):
    assert http(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})[0] == 400
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    status, body = http(server, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and "safetensors" in body["message"]
    assert http(server, "/health")[0] == 200
