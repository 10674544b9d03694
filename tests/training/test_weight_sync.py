"""Weight refresh from FSDP trainer ranks (gathered bucket by bucket) into a real embedded inference
server, bit-exact, which then generates with the new weights; and the disk path of a checkpoint.
(The sender, receiver and bracket on their own: tests/weights/.)"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from programs import TINY, make_samples, train_then_broadcast
from ranks import run_ranks

from asyncwebrl.inference.engine import params_checksum
from asyncwebrl.models.vlm import encode_image_b64
from asyncwebrl.scheduling.servers import launch_server
from asyncwebrl.training.config import ActorConfig

SYNC_TIMEOUT_S = 8
KEY = "weight-sync-test-key"


def http(addr: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(addr + path, data=data, headers={"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    srv = launch_server(model=TINY, log_path=log, weight_sync_timeout_s=SYNC_TIMEOUT_S, api_key=KEY,
                        weights_roots=[str(tmp_path_factory.getbasetemp())])
    yield srv.address
    srv.stop()


@pytest.mark.slow
def test_fsdp_gather_and_broadcast_into_server_is_bit_exact_and_served(server):
    from asyncwebrl.training.actor import FSDPActor

    before = http(server, "/weights_checksum")["sha256"]
    cfg = dict(path=TINY, lr=1e-2, mb_max_tokens=200, weight_chunked_mem_mb=1)  # several buckets
    out = run_ranks(train_then_broadcast, 2, (cfg, server, 5, KEY), timeout_s=300)[0]
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
