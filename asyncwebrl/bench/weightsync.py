"""`asyncwebrl bench weightsync`: end-to-end weight refresh vs the raw broadcast of the same bytes.

For each model size (random-init llama-shaped parameters with HF names) and in ONE run:
  refresh = POST /pause_generation -> gather full params -> WeightBroadcaster.broadcast (buckets of
            weight_chunked_mem_mb, one /update_weights_from_distributed per bucket, concurrent with its
            broadcasts) -> POST /continue_generation, timed on the trainer until every server confirmed;
  floor   = the same tensors broadcast over the same group with no HTTP at all, between two barriers.
Headline: ratio_over_floor = refresh / floor for the largest size.

The refresh goes to real embedded inference servers (`asyncwebrl serve`, one subprocess per server,
loaded with a random-init llama model of the size); `servers=URL,URL` points it at running servers
instead (e.g. SGLang on GPUs; they must serve a model of the size's shapes). The floor goes to
`ProtocolReceiver` processes: the same group calls a server makes, receiving into preallocated
tensors, with no HTTP (a server cannot join a broadcast without its HTTP call). Trainer: one rank,
so the gather is a no-op here (FSDP's full_tensor() all-gather is measured in the trainer tests).

Invariant: every process this module starts is ended before it returns (also on errors).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import statistics
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist

from asyncwebrl.bench.common import print_table, write_result
from asyncwebrl.training.config import ActorConfig
from asyncwebrl.training.weight_sync import WeightBroadcaster, post_json

# llama-shaped sizes: (hidden, layers, intermediate, heads, kv_heads, vocab)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "135M": (576, 30, 1536, 9, 3, 49152),
    "500M": (896, 24, 4864, 14, 2, 151936),
    "1.5B": (1536, 28, 8960, 12, 2, 151936),
    "3B": (2048, 36, 11008, 16, 2, 151936),
    "8B": (4096, 32, 14336, 32, 8, 128256),
}

DEFAULTS: dict[str, Any] = {
    "sizes": "135M,500M,1.5B",
    "dtype": "bfloat16",
    "device": "cpu",
    "backend": "gloo",
    "n_servers": 1,
    "bucket_mb": 256,
    "repeats": 5,
    "timeout_s": 300,
    "servers": "",
    "tokenizer": "default",
    "out": "weightsync",
}


def checksum(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over names and raw bytes, in order (bit-exact comparison across processes)."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---- the receiver (server side of the weight protocol) ---------------------------------------------
class ProtocolReceiver:
    """The weight-update half of an inference server: joins the trainer's group and receives."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.pg: Any = None
        self.group_name: str | None = None
        self.rank = -1
        self.tensors: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.version = "0"
        self.paused = False
        self.lock = threading.Lock()

    def init_group(self, b: dict[str, Any]) -> dict[str, Any]:
        timeout = timedelta(seconds=float(b.get("timeout_s", 300)))
        store = dist.TCPStore(b["master_address"], int(b["master_port"]), int(b["world_size"]), is_master=False,
                              timeout=timeout)
        prefix = dist.PrefixStore(b["group_name"], store)
        if b.get("backend", "gloo") == "nccl":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefix, int(b["rank_offset"]), int(b["world_size"]), opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, int(b["rank_offset"]), int(b["world_size"]), timeout)
        self.group_name, self.rank = b["group_name"], int(b["rank_offset"])
        return {"success": True, "message": f"joined {self.group_name} as rank {self.rank}"}

    def _receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        works = []
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            t = self.tensors.get(name)
            if t is None or list(t.shape) != list(shape) or str(t.dtype) != f"torch.{dt}":
                t = torch.empty(shape, dtype=getattr(torch, dt), device=self.device)
                self.tensors[name] = t
                if name not in self.order:
                    self.order.append(name)
            works.append(self.pg.broadcast([t], opts))
        for w in works:
            w.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def update(self, b: dict[str, Any]) -> dict[str, Any]:
        if self.pg is None or b.get("group_name") != self.group_name:
            return {"success": False, "message": f"no weight update group named {b.get('group_name')!r}"}
        if not (len(b["names"]) == len(b["dtypes"]) == len(b["shapes"])):
            return {"success": False, "message": "names, dtypes and shapes must have the same length"}
        with self.lock:
            self._receive(b["names"], b["dtypes"], b["shapes"])
            if b.get("weight_version") is not None:
                self.version = str(b["weight_version"])
        return {"success": True, "message": f"received {len(b['names'])} tensors"}

    def raw(self, b: dict[str, Any]) -> dict[str, Any]:
        """Floor measurement: barrier, receive, barrier (no HTTP inside the timed window)."""
        with self.lock:
            self._barrier()
            self._receive(b["names"], b["dtypes"], b["shapes"])
            self._barrier()
        return {"success": True, "message": "raw receive done"}

    def _barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self.pg.allreduce([t], dist.AllreduceOptions()).wait()

    def destroy(self, b: dict[str, Any]) -> dict[str, Any]:
        if b.get("group_name") != self.group_name:
            return {"success": False, "message": f"no weight update group named {b.get('group_name')!r}"}
        self.pg, self.group_name = None, None
        return {"success": True, "message": "destroyed"}

    def checksum(self) -> dict[str, Any]:
        with self.lock:
            return {"success": True, "sha256": checksum([(n, self.tensors[n]) for n in self.order]),
                    "weight_version": self.version, "n_tensors": len(self.order)}


def _make_handler(rx: ProtocolReceiver):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"success": True})
            if self.path == "/weights_checksum":
                return self._send(200, rx.checksum())
            self._send(404, {"success": False, "message": f"unknown path {self.path}"})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                routes = {
                    "/init_weights_update_group": rx.init_group, "/update_weights_from_distributed": rx.update,
                    "/destroy_weights_update_group": rx.destroy, "/bench_raw_receive": rx.raw,
                    "/pause_generation": lambda b: (setattr(rx, "paused", True), {"success": True})[1],
                    "/continue_generation": lambda b: (setattr(rx, "paused", False), {"success": True})[1],
                }
                if self.path not in routes:
                    return self._send(404, {"success": False, "message": f"unknown path {self.path}"})
                out = routes[self.path](body)
                self._send(200 if out.get("success") else 400, out)
            except (KeyError, TypeError, ValueError) as e:
                self._send(400, {"success": False, "message": f"bad request: {e}"})
            except Exception as e:  # a failed collective: report it, keep serving
                self._send(500, {"success": False, "message": f"{type(e).__name__}: {e}"})

    return Handler


def _serve(port_q: Any, device: str, threads: int) -> None:
    torch.set_num_threads(threads)
    rx = ProtocolReceiver(device)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(rx))
    port_q.put(httpd.server_address[1])
    httpd.serve_forever()


def start_receivers(n: int, devices: list[str] | None = None, threads: int = 1,
                    timeout_s: float = 60.0) -> tuple[list[str], list[mp.Process]]:
    """n receiver processes; returns their base URLs and the processes (end them with stop_receivers)."""
    ctx = mp.get_context("spawn")
    procs, urls = [], []
    try:
        for i in range(n):
            q = ctx.Queue()
            dev = devices[i] if devices else "cpu"
            p = ctx.Process(target=_serve, args=(q, dev, threads), daemon=True)
            p.start()
            procs.append(p)
            urls.append(f"http://127.0.0.1:{q.get(timeout=timeout_s)}")
    except BaseException:
        stop_receivers(procs)
        raise
    return urls, procs


def stop_receivers(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)


# ---- the benchmark -------------------------------------------------------------------------------
def make_model_folder(size: str, dtype: torch.dtype, out_dir: str,
                      tokenizer: str = "default") -> list[tuple[str, torch.Tensor]]:
    """A random-init llama-shaped HF model folder (tokenizer files borrowed from the `tokenizer`
    model folder) that an embedded server can load; returns the model's named parameters."""
    import shutil
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncwebrl.models.prepare import resolve_model_path

    h, n_layers, inter, heads, kv, vocab = SHAPES[size]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=n_layers, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.uniform_(-0.02, 0.02)
    model.to(dtype)
    model.save_pretrained(out_dir)
    src = Path(resolve_model_path(tokenizer))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (src / f).is_file():
            shutil.copyfile(src / f, Path(out_dir) / f)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    with torch.no_grad():  # the trainer's weights differ from what the server loaded
        for _, t in named:
            t.add_(0.001)
    return named


def _raw_floor(bc: WeightBroadcaster, named: list[tuple[str, torch.Tensor]], timeout_s: float) -> float:
    from asyncwebrl.training.weight_sync import _Call

    body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}
    calls = [_Call(post_json, s, "/bench_raw_receive", body, None, timeout_s) for s in bc.servers]
    for c in calls:
        c.start()
    seconds = bc.raw_broadcast([t for _, t in named])
    for c in calls:
        c.join_or_raise(time.monotonic() + timeout_s)
    return seconds


def _refresh(bc: WeightBroadcaster, sharded: list[tuple[str, torch.Tensor]], version: int,
             timeout_s: float) -> dict[str, float]:
    t0 = time.perf_counter()
    for s in bc.servers:
        post_json(s, "/pause_generation", {"mode": "in_place"}, bc.api_key, timeout_s)
    t1 = time.perf_counter()
    # gather: with one trainer rank the full tensors are the local ones (FSDP's full_tensor() would
    # all-gather here); on GPU they already sit on the trainer device
    named = [(n, t.detach()) for n, t in sharded]
    t2 = time.perf_counter()
    bc.broadcast(named, version)
    t3 = time.perf_counter()
    for s in bc.servers:
        post_json(s, "/continue_generation", {}, bc.api_key, timeout_s)
    t4 = time.perf_counter()
    return {"pause_s": t1 - t0, "gather_s": t2 - t1, "broadcast_s": t3 - t2, "resume_s": t4 - t3, "total_s": t4 - t0}


def _measure(named, model_dir: str, n: int, device: str, backend: str, dtype: str, cfg: ActorConfig,
             repeats: int, timeout_s: float, external: list[str]) -> dict[str, Any]:
    """Floor and refresh side by side: both groups alive at once, measurements alternated."""
    from asyncwebrl.httpguard import new_key
    from asyncwebrl.inference.engine import params_checksum
    from asyncwebrl.scheduling.servers import launch_server, wait_healthy

    trainer_dev = "cuda:0" if device == "cuda" else "cpu"
    devs = [f"cuda:{1 + i}" for i in range(n)] if device == "cuda" else None
    servers, procs = [], []
    key = None if external else new_key()  # control endpoints need the servers' key
    try:
        rx_urls, procs = start_receivers(n, devs, threads=1)
        if external:
            urls = external
        else:
            for i in range(n):
                servers.append(launch_server(wait=False, model=model_dir, device=devs[i] if devs else "cpu", dtype=dtype,
                                             api_key=key))
            for srv in servers:
                wait_healthy(srv.address, timeout_s, proc=srv, api_key=key)
            urls = [srv.address for srv in servers]
        raw = WeightBroadcaster(rx_urls, None, cfg, backend=backend, device=trainer_dev)
        raw.init_group()
        bc = WeightBroadcaster(urls, key, cfg, backend=backend, device=trainer_dev)
        bc.init_group()
        _raw_floor(raw, named, timeout_s)  # warm-ups: first-touch allocations on both sides
        _refresh(bc, named, 1, timeout_s)
        floors, parts = [], []
        for r in range(repeats):
            floors.append(_raw_floor(raw, named, timeout_s))
            parts.append(_refresh(bc, named, 2 + r, timeout_s))
        exact_floor = all(post_json_get(u, "/weights_checksum", timeout_s)["sha256"] == checksum(named) for u in rx_urls)
        want = params_checksum(named)
        exact = all(post_json_get(u, "/weights_checksum", timeout_s, key)["sha256"] == want for u in urls)
        raw.close()
        bc.close()
    finally:
        for srv in servers:
            srv.stop()
        stop_receivers(procs)
    out = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    out.update(floor_s=statistics.median(floors), bit_exact_server=exact, bit_exact_floor=exact_floor,
               floors=floors, totals=[p["total_s"] for p in parts])
    return out


def run(knobs: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    sizes = [s.strip() for s in str(knobs["sizes"]).split(",") if s.strip()]
    for s in sizes:
        if s not in SHAPES:
            raise SystemExit(f"unknown size '{s}'; one of {', '.join(SHAPES)}")
    device, backend = knobs["device"], knobs["backend"]
    if backend == "nccl" and device != "cuda":
        raise SystemExit("backend=nccl needs device=cuda")
    dtype = getattr(torch, knobs["dtype"])
    timeout_s = float(knobs["timeout_s"])
    n, repeats = int(knobs["n_servers"]), int(knobs["repeats"])
    external = [u for u in str(knobs["servers"] or "").split(",") if u]
    cfg = ActorConfig(weight_chunked_mem_mb=int(knobs["bucket_mb"]), weight_update_timeout_s=timeout_s)
    rows, per_size = [], {}
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix=f"awrl-weightsync-{size}-") as model_dir:
            named = make_model_folder(size, dtype, model_dir, str(knobs["tokenizer"]))
            if device == "cuda":
                named = [(k, t.to("cuda:0")) for k, t in named]
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            m = _measure(named, model_dir, n, device, backend, knobs["dtype"], cfg, repeats, timeout_s, external)
        refresh, floor = m["total_s"], m["floor_s"]
        per_size[size] = {
            "params": sum(t.numel() for _, t in named), "bytes": nbytes, "refresh_s": refresh, "floor_s": floor,
            "ratio_over_floor": refresh / floor, "refresh_GBps": nbytes / refresh / 1e9,
            "floor_GBps": nbytes / floor / 1e9,
            **{k: v for k, v in m.items() if k not in ("total_s", "floor_s")},
        }
        rows.append({"size": size, "GiB": round(nbytes / 2**30, 2), "refresh_s": refresh, "floor_s": floor,
                     "ratio": refresh / floor, "bit_exact": m["bit_exact_server"] and m["bit_exact_floor"]})
        del named
    largest = sizes[-1]
    return {"rows": rows, "per_size": per_size, "largest": largest,
            "ratio_over_floor": per_size[largest]["ratio_over_floor"]}


def post_json_get(base_url: str, path: str, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + path,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def main(overrides: list[str]) -> int:
    from asyncwebrl.bench.common import parse_overrides

    knobs = parse_overrides(overrides, DEFAULTS)
    res = run(knobs)
    config = dict(knobs, refresh_target="external servers" if knobs["servers"] else "embedded hf inference servers",
                  floor_target="ProtocolReceiver processes (pure torch.distributed receive, no HTTP)",
                  trainer_ranks=1, model="random-init LlamaForCausalLM of each size")
    figures = {"ratio_over_floor": res["ratio_over_floor"], "largest": res["largest"], "per_size": res["per_size"]}
    write_result(knobs["out"], config, figures)
    print_table(res["rows"], f"ratio_over_floor ({res['largest']}, {knobs['backend']}, "
                             f"{knobs['n_servers']} server(s)): {res['ratio_over_floor']:.3f}")
    return 0
