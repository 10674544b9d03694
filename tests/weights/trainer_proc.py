"""A stand-alone trainer rank 0 for the weight-update tests (run as a separate python process).

It forms rank 0 of a group with the server through the project's one group constructor (the server
joins through POST /init_weights_update_group, issued concurrently, as the real trainer does), opens
an update session (/begin_weight_update), perturbs its copy of the model, and broadcasts every
parameter in SGLang's per-tensor form (load_format null) in two announcements, each HTTP call
running concurrently with its broadcasts. The first tensor is sent as bfloat16 (the server converts).
Prints one JSON line: the sha256 of the weights it sent (asyncwebrl.inference.engine.params_checksum).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import urllib.request

import torch
import torch.distributed as dist

from asyncwebrl.inference.engine import params_checksum
from asyncwebrl.models.vlm import load_model
from asyncwebrl.weights.group import join_group


def post(url: str, body: dict, out: dict) -> None:
    headers = {"Content-Type": "application/json"}
    if os.environ.get("ASYNCWEBRL_API_KEY"):  # the server's key (control endpoints need it)
        headers["Authorization"] = f"Bearer {os.environ['ASYNCWEBRL_API_KEY']}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out.update(json.loads(r.read()), status=r.status)
    except urllib.error.HTTPError as e:
        out.update(json.loads(e.read()), status=e.code)


def in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=post, args=(url, body, out))
    t.start()
    return t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--group", default="weight_update_group")
    ap.add_argument("--version", default="1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--device", default="cpu", help="where the trainer's copy lives (cuda:N for nccl)")
    ap.add_argument("--dtype", default="float32", help="the trainer's parameter dtype (= the server's)")
    args = ap.parse_args()
    t, init = in_thread(f"{args.server}/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1, "world_size": 2,
        "group_name": args.group, "backend": args.backend})
    group = join_group("127.0.0.1", args.port, 0, 2, args.group, args.backend, args.device, 120.0)
    pg = group.pg
    t.join()
    assert init.get("success"), init
    t, begin = in_thread(f"{args.server}/begin_weight_update", {})
    t.join()
    assert begin.get("success"), begin

    model = load_model(args.model, args.dtype, args.device)
    gen = torch.Generator().manual_seed(args.seed)
    params = list(model.named_parameters())
    with torch.no_grad():
        for _, p in params:
            p.add_((torch.randn(p.shape, generator=gen) * 0.02).to(p.device, p.dtype))
        params[0][1].copy_(params[0][1].bfloat16().float())  # exactly representable in bf16
    buckets = [params[: len(params) // 2], params[len(params) // 2:]]
    replies = []
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        dtypes = ["bfloat16" if (i == 0 and j == 0) else str(p.dtype).removeprefix("torch.")
                  for j, (_, p) in enumerate(bucket)]
        body = {"names": [n for n, _ in bucket], "dtypes": dtypes, "shapes": [list(p.shape) for _, p in bucket],
                "group_name": args.group, "flush_cache": True, "abort_all_requests": False}
        if last:
            body["weight_version"] = args.version
        t, reply = in_thread(f"{args.server}/update_weights_from_distributed", body)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for (_, p), dt in zip(bucket, dtypes, strict=True):
            buf = p.detach().to(getattr(torch, dt)).contiguous()
            pg.broadcast([buf], opts).wait()
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        t.join()
        replies.append(reply)
    t, end = in_thread(f"{args.server}/end_weight_update", {})
    t.join()
    assert end.get("success"), end
    t, destroy = in_thread(f"{args.server}/destroy_weights_update_group", {"group_name": args.group})
    t.join()
    print(json.dumps({"checksum": params_checksum(model.named_parameters()), "replies": replies,
                      "destroy": destroy}), flush=True)


if __name__ == "__main__":
    main()
