"""Weight refresh over the broadcast group: bit-exact into a real embedded inference server (which
then generates with the new weights), and a dead, refusing or absent peer is an error, not a hang."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch
from asyncwebrl.training.weight_sync import WeightBroadcaster, WeightSyncError, make_buckets
from programs import TINY, make_samples, train_then_broadcast

from asyncwebrl.bench.weightsync import start_receivers, stop_receivers
from asyncwebrl.inference.engine import params_checksum
from asyncwebrl.models.vlm import encode_image_b64
from asyncwebrl.scheduling.servers import free_port, launch_server
from asyncwebrl.training.config import ActorConfig
from asyncwebrl.training.launcher import run_ranks

SYNC_TIMEOUT_S = 8


def http(addr: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(addr + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    srv = launch_server(model=TINY, log_path=log, weight_sync_timeout_s=SYNC_TIMEOUT_S)
    yield srv.address
    srv.stop()


def test_buckets_respect_the_size_and_keep_order():
    named = [(f"t{i}", torch.zeros(256 * (i + 1))) for i in range(6)]  # 1, 2, ... 6 KiB
    buckets = make_buckets(named, bucket_mb=5 / 1024)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(sum(t.numel() * 4 for _, t in b) <= 5 * 1024 or len(b) == 1 for b in buckets)
    assert len(buckets) == 5  # [1,2] [3] [4] [5] [6]


@pytest.mark.slow
def test_fsdp_gather_and_broadcast_into_server_is_bit_exact_and_served(server):
    from asyncwebrl.training.actor import FSDPActor

    before = http(server, "/weights_checksum")["sha256"]
    cfg = dict(path=TINY, lr=1e-2, mb_max_tokens=200, weight_chunked_mem_mb=1)  # several buckets
    out = run_ranks(train_then_broadcast, 2, (cfg, server, 5), timeout_s=300)[0]
    params, report = out["params"], out["report"]
    assert report.n_buckets > 1 and report.n_tensors == len(params)
    served = http(server, "/weights_checksum")
    assert served["sha256"] == params_checksum(params.items()) != before
    assert served["weight_version"] == "5"
    assert http(server, "/server_info")["weight_update_groups"] == []  # close() tore the group down

    # the server now generates with the trained weights: its logprobs match the trainer's own
    actor = FSDPActor(ActorConfig(path=TINY))
    actor.hf.load_state_dict(params, strict=False)
    sample = make_samples(actor.adapter, 1)[0]
    body = http(server, "/generate", {
        "input_ids": sample.prompt_ids, "image_data": [encode_image_b64(sample.pixels[0])], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert body["meta_info"]["weight_version"] == "5"
    sample.output_ids = body["output_ids"]
    served_lp = torch.tensor([lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]])
    mine = torch.tensor(actor.compute_logprobs([sample])[0])
    assert torch.allclose(served_lp, mine, atol=1e-3), (served_lp, mine)


@pytest.mark.slow
def test_server_refusing_a_bucket_is_an_error_and_it_keeps_serving(server):
    before = http(server, "/weights_checksum")["sha256"]
    bc = WeightBroadcaster([server], None, ActorConfig(weight_update_timeout_s=60))
    bc.init_group()
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="HTTP 4|refused"):
            bc.broadcast([("no.such.parameter", torch.ones(4))], version=9)
        assert time.monotonic() - t0 < 30
        with pytest.raises(WeightSyncError, match="init_group"):
            bc.broadcast([("no.such.parameter", torch.ones(4))], version=9)
    finally:
        bc.close()
    assert http(server, "/weights_checksum")["sha256"] == before
    assert http(server, "/health") is not None


def test_dead_receiver_is_an_error_within_the_timeout():
    urls, procs = start_receivers(1)
    try:
        bc = WeightBroadcaster(urls, None, ActorConfig(weight_update_timeout_s=SYNC_TIMEOUT_S))
        bc.init_group()
        bc.broadcast([("w", torch.arange(10.0))], version=1)  # alive: works
        procs[0].kill()
        procs[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            bc.broadcast([("w", torch.arange(10.0)), ("v", torch.ones(3))], version=2)
        assert time.monotonic() - t0 < SYNC_TIMEOUT_S + 15
        bc.close()
    finally:
        stop_receivers(procs)


def test_unreachable_server_fails_init_quickly():
    bc = WeightBroadcaster([f"http://127.0.0.1:{free_port()}"], None, ActorConfig(weight_update_timeout_s=SYNC_TIMEOUT_S))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="unreachable|failed to join"):
        bc.init_group()
    assert time.monotonic() - t0 < SYNC_TIMEOUT_S + 5
    bc.close()


def test_round_trip_to_two_receivers_is_bit_exact_for_mixed_dtypes():
    from asyncwebrl.bench.weightsync import checksum

    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(300, 7, generator=g)), ("b", torch.randn(1000, generator=g).to(torch.bfloat16)),
             ("c", torch.randn(5, 5, generator=g).to(torch.float16)), ("d", torch.randint(0, 99, (17,), generator=g))]
    urls, procs = start_receivers(2)
    try:
        bc = WeightBroadcaster(urls, None, ActorConfig(weight_chunked_mem_mb=1, weight_update_timeout_s=60))
        bc.init_group()
        rep = bc.broadcast(named, version=3)
        assert rep.bytes == sum(t.numel() * t.element_size() for _, t in named)
        want = checksum(named)
        for u in urls:
            got = http(u, "/weights_checksum")
            assert got["sha256"] == want and got["weight_version"] == "3"
        bc.close()
    finally:
        stop_receivers(procs)


@pytest.mark.slow
def test_checkpoint_is_hot_loadable_by_the_server_from_disk(server, tmp_path):
    """Disk mode (test rollout): the newest complete checkpoint loads via /update_weights_from_disk."""
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.checkpoint import latest_complete_checkpoint

    torch.manual_seed(0)
    actor = FSDPActor(ActorConfig(path=TINY, lr=1e-2))
    actor.train_step(make_samples(actor.adapter, 2))
    actor.save_checkpoint(tmp_path, {"pos": 1})
    path = latest_complete_checkpoint(tmp_path)
    body = http(server, "/update_weights_from_disk", {"model_path": str(path), "weight_version": actor.version})
    assert body["success"], body
    served = http(server, "/weights_checksum")
    assert served["sha256"] == params_checksum(actor.full_named_parameters())
    assert served["weight_version"] == str(actor.version)
