"""`asyncwebrl bench weightsync`: the production weight refresh against the physical floor.

For each model size (random-init llama-shaped parameters with HF names), in ONE run:
  refresh          = `RefreshBracket.refresh` around `WeightSender.transfer`, exactly what the trainer
                     loop runs (pause servers -> begin session -> flat-bucket broadcast -> end session
                     + version -> continue), timed on the trainer until every server confirmed and
                     resumed; to real embedded inference servers (`asyncwebrl serve`, one subprocess
                     per server, loaded with a model of the size), or to `servers=URL,...` (key from $ASYNCWEBRL_API_KEY);
  floor            = ONE flat contiguous buffer of the same byte count, broadcast between two
                     barriers over a group of the same shape (trainer + one receiver process per
                     server, each on the server's device), no HTTP: what the link can do;
  per_tensor_floor = the same tensors broadcast one by one between two barriers (the old "floor").
Headline: ratio_over_floor = refresh / floor for the largest size.

`path=same_device` (one GPU, issue 31): the server runs on the trainer's device and the refresh is the
same-device path (`weights/ipc.py`, SGLang's /update_weights_from_tensor, inside the same bracket); the
floor is then ONE device-to-device copy of the same bytes on that device (on a CPU: one memory copy),
timed in the same run. `refresh_s` is the path a single trainer rank takes (`resident`: handles to the
parameters themselves, one call, no packing); the flat-bucket path a sharded rank takes (packed into
reused buffers, one call per bucket) is timed beside it at every `bucket_mb` (`per_bucket_mb`,
`bucket_refresh_s` the fastest one's). `disk=1` also times /update_weights_from_disk
against a plain safetensors read of the same files onto the server's device (hot page cache).

Invariant: every process this module starts is ended before it returns (also on errors).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from asyncwebrl.bench.common import print_table
from asyncwebrl.net import LOOPBACK
from asyncwebrl.results import write_result
from asyncwebrl.weights.bracket import RefreshBracket
from asyncwebrl.weights.control import ControlChannel
from asyncwebrl.weights.group import WeightGroup, join_group
from asyncwebrl.weights.sender import DEFAULT_BUCKET_MB, WeightSender
from asyncwebrl.weights.version import PolicyVersion

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
    "bucket_mb": str(DEFAULT_BUCKET_MB),
    "repeats": 5,
    "timeout_s": 300,
    "servers": "",
    "tokenizer": "default",
    "pause_mode": "in_place",
    "disk": 0,
    "path": "broadcast",
    "out": "weightsync",
}


# ---- floor receivers: the same group shape, no HTTP --------------------------------------------------
def _floor_child(conn: Any, port: int, rank: int, world: int, backend: str, gpu: str | None, threads: int) -> None:
    if gpu is not None:  # as a server is placed: this process sees only its GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    torch.set_num_threads(threads)
    dev = "cuda:0" if gpu is not None else "cpu"
    g = join_group(LOOPBACK, port, rank, world, "awrl_floor", backend, dev, 300.0)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "flat":
                buf = torch.empty(arg, dtype=torch.uint8, device=dev)
                flat_round(g, buf)
                del buf
            elif cmd == "tensors":
                bufs = [torch.empty(shape, dtype=getattr(torch, dt), device=dev) for dt, shape in arg]
                tensors_round(g, bufs)
                del bufs
            conn.send("done")
    finally:
        g.destroy()


def flat_round(g: WeightGroup, buf: torch.Tensor) -> float:
    """barrier, one broadcast of `buf`, barrier (both ends run this); seconds on this rank."""
    g.barrier()
    t0 = time.perf_counter()
    g.wait(g.broadcast(buf))
    g.barrier()
    return time.perf_counter() - t0


def tensors_round(g: WeightGroup, tensors: list[torch.Tensor]) -> float:
    """barrier, one broadcast per tensor (all posted, then waited), barrier; seconds on this rank."""
    g.barrier()
    t0 = time.perf_counter()
    works = [g.broadcast(t) for t in tensors]
    for w in works:
        g.wait(w)
    g.barrier()
    return time.perf_counter() - t0


class FloorGroup:
    """Trainer rank 0 plus one receiver process per server, on the servers' devices."""

    def __init__(self, n: int, backend: str, trainer_dev: str, gpus: list[str] | None):
        from asyncwebrl.net import free_port

        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        try:
            for i in range(n):
                a, b = ctx.Pipe()
                p = ctx.Process(target=_floor_child, args=(b, port, 1 + i, n + 1, backend,
                                                           gpus[i] if gpus else None, 1), daemon=True)
                p.start()
                self.conns.append(a)
                self.procs.append(p)
            self.g = join_group(LOOPBACK, port, 0, n + 1, "awrl_floor", backend, trainer_dev, 300.0)
        except BaseException:
            self.stop()
            raise

    def flat(self, buf: torch.Tensor) -> float:
        for c in self.conns:
            c.send(("flat", buf.numel()))
        s = flat_round(self.g, buf)
        for c in self.conns:
            c.recv()
        return s

    def tensors(self, tensors: list[torch.Tensor]) -> float:
        meta = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in tensors]
        for c in self.conns:
            c.send(("tensors", meta))
        s = tensors_round(self.g, tensors)
        for c in self.conns:
            c.recv()
        return s

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if getattr(self, "g", None) is not None:
            self.g.destroy()


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
    model.to(dtype)  # still on meta: allocated once, in the target dtype (an 8B model never exists in float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.uniform_(-0.02, 0.02)
    model.save_pretrained(out_dir)
    src = Path(resolve_model_path(tokenizer))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        if (src / f).is_file():
            shutil.copyfile(src / f, Path(out_dir) / f)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    with torch.no_grad():  # the trainer's weights differ from what the server loaded
        for _, t in named:
            t.add_(0.001)
    return named


def _measure(named, model_dir: str, n: int, device: str, backend: str, dtype: str, bucket_mbs: list[float],
             repeats: int, timeout_s: float, external: list[str], pause_mode: str, disk: bool,
             api_key: str | None = None) -> dict[str, Any]:
    """Floor, per-tensor floor and the production refresh side by side, alternated, one run."""
    from asyncwebrl.httpguard import new_key
    from asyncwebrl.inference.engine import params_checksum
    from asyncwebrl.scheduling.servers import launch_server, wait_healthy

    trainer_dev = "cuda:0" if device == "cuda" else "cpu"
    gpus = [str(1 + i) for i in range(n)] if device == "cuda" else None
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    servers, floor, sender, control = [], None, None, None
    key = api_key or (None if external else new_key())  # control endpoints need the servers' key
    try:
        if not external:
            for i in range(n):
                servers.append(launch_server(wait=False, model=model_dir, device=f"cuda:{gpus[i]}" if gpus else "cpu",
                                             dtype=dtype, weight_sync_timeout_s=timeout_s, api_key=key,
                                             weights_roots=[model_dir]))
        floor = FloorGroup(n, backend, trainer_dev, gpus)
        for srv in servers:
            wait_healthy(srv.address, timeout_s, proc=srv, api_key=key)
        urls = external or [srv.address for srv in servers]
        sender = WeightSender(urls, key, device=trainer_dev, backend=backend, bucket_mb=bucket_mbs[0],
                              timeout_s=timeout_s)
        sender.init_group()
        control = ControlChannel(urls, key, timeout_s)
        clock = PolicyVersion()  # the version's owner; the bracket advances it once per refresh
        bracket = RefreshBracket(None, control, pause_mode, clock=clock)  # the bench has no rollout gate to pause
        meta = [(k, t.dtype, tuple(t.shape)) for k, t in named]
        flat = torch.empty(nbytes, dtype=torch.uint8, device=trainer_dev)
        tensors = [t for _, t in named]

        def refresh(mb: float):
            sender.bucket_bytes = int(mb * 2**20)
            # one trainer rank: its full parameters are the local ones (FSDP would gather per bucket)
            rep, _ = bracket.refresh(lambda: sender.transfer(iter(named), meta))
            return rep

        floor.flat(flat)
        floor.tensors(tensors)
        for mb in bucket_mbs:
            refresh(mb)  # warm-up: first-touch allocations on both sides
        floors, per_tensor, reps = [], [], {mb: [] for mb in bucket_mbs}
        for _ in range(repeats):
            floors.append(floor.flat(flat))
            per_tensor.append(floor.tensors(tensors))
            for mb in bucket_mbs:
                reps[mb].append(refresh(mb))
        del flat
        want = params_checksum(named)
        exact = all(control.run(control.acall(u, "/weights_checksum", None, method="GET"))["sha256"] == want
                    for u in urls)
        served_version = [control.run(control.acall(u, "/model_info", None, method="GET")).get("weight_version")
                          for u in urls]
        out: dict[str, Any] = {}
        if disk and not external:
            out.update(_disk(control, urls, model_dir, f"cuda:{gpus[0]}" if gpus else "cpu", repeats, timeout_s))
        sender.close()
        sender = None
    finally:
        if sender is not None:
            sender.close()
        if control is not None:
            control.close()
        if floor is not None:
            floor.stop()
        for srv in servers:
            srv.stop()
    best = min(bucket_mbs, key=lambda mb: statistics.median(r.total_s for r in reps[mb]))
    first = reps[best]
    out.update({
        "floor_s": statistics.median(floors), "per_tensor_floor_s": statistics.median(per_tensor),
        "refresh_s": statistics.median(r.total_s for r in first),
        **{f"{k}_s": statistics.median(getattr(r, f"{k}_s") for r in first)
           for k in ("pause", "begin", "transfer", "finish", "resume")},
        "n_buckets": first[0].n_buckets, "bucket_mb": best,
        "per_bucket_mb": {str(mb): statistics.median(r.total_s for r in rs) for mb, rs in reps.items()},
        "bit_exact_server": exact, "served_version": served_version, "expected_version": str(clock.value),
        "floors": floors, "totals": [r.total_s for r in first],
    })
    return out


def copy_floor(nbytes: int, device: str, repeats: int) -> list[float]:
    """One copy of `nbytes` between two buffers on `device`, synchronized: the same-device floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = []
    for i in range(repeats + 1):
        if src.is_cuda:
            torch.cuda.synchronize(src.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize(src.device)
        if i:  # the first one pays first-touch
            out.append(time.perf_counter() - t0)
    return out


def _measure_same_device(named, model_dir: str, device: str, dtype: str, bucket_mbs: list[float], repeats: int,
                         timeout_s: float, pause_mode: str) -> dict[str, Any]:
    """The same-device refresh to one embedded server on the trainer's device, against one copy."""
    from asyncwebrl.httpguard import new_key
    from asyncwebrl.inference.engine import params_checksum
    from asyncwebrl.scheduling.servers import launch_server
    from asyncwebrl.weights.ipc import SameDeviceSender

    dev = "cuda:0" if device == "cuda" else "cpu"
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    key = new_key()
    srv, sender, control = None, None, None
    try:
        # its log in a scratch folder: a server that dies before it is healthy shows its last lines
        srv = launch_server(model=model_dir, device=dev, dtype=dtype, weight_sync_timeout_s=timeout_s, api_key=key,
                            weights_roots=[model_dir], startup_timeout=timeout_s,
                            log_dir=tempfile.mkdtemp(prefix="awrl-weightsync-"))
        sender = SameDeviceSender(srv.address, key, device=dev, bucket_mb=bucket_mbs[0], timeout_s=timeout_s)
        sender.init_group()
        control = ControlChannel([srv.address], key, timeout_s)
        clock = PolicyVersion()
        bracket = RefreshBracket(None, control, pause_mode, clock=clock)
        meta = [(k, t.dtype, tuple(t.shape)) for k, t in named]

        def refresh(mb: float | None):  # None: the resident path
            if mb is None:
                return bracket.refresh(lambda: sender.transfer(named, resident=True))
            sender.bucket_bytes = int(mb * 2**20)
            return bracket.refresh(lambda: sender.transfer(iter(named), meta))  # (bracket report, transfer report)

        variants: list[float | None] = [None, *bucket_mbs]
        for v in variants:
            refresh(v)  # warm-up: buffers allocated, payloads sent once and kept by the server
        floors, runs = [], {v: [] for v in variants}
        for _ in range(repeats):
            floors += copy_floor(nbytes, dev, 1)
            for v in variants:
                runs[v].append(refresh(v))
        want = params_checksum(named)
        got = control.run(control.acall(srv.address, "/weights_checksum", None, method="GET"))
        served = control.run(control.acall(srv.address, "/model_info", None, method="GET")).get("weight_version")
    finally:
        if sender is not None:
            sender.close()
        if control is not None:
            control.close()
        if srv is not None:
            srv.stop()
    reps = {v: [rep for rep, _ in rs] for v, rs in runs.items()}
    first, moved = reps[None], [m for _, m in runs[None]]
    best = min(bucket_mbs, key=lambda mb: statistics.median(r.total_s for r in reps[mb]))
    return {
        # the transfer's split (median over the repeats): the trainer's side, the server's side
        "pack_s": statistics.median(m.pack_s for m in moved),
        "server_map_s": statistics.median(m.server.map_s for m in moved),
        "server_hold_s": statistics.median(m.server.hold_s for m in moved),
        "server_copy_s": statistics.median(m.server.copy_s for m in moved),
        "server_read_s": statistics.median(m.server.read_s for m in moved),
        "server_handler_s": statistics.median(m.server.handler_s for m in moved),
        "resent_frac": sum(m.resent for m in moved) / sum(m.n_buckets for m in moved),
        "floor_s": statistics.median(floors), "per_tensor_floor_s": statistics.median(floors),
        "refresh_s": statistics.median(r.total_s for r in first),
        **{f"{k}_s": statistics.median(getattr(r, f"{k}_s") for r in first)
           for k in ("pause", "begin", "transfer", "finish", "resume")},
        "n_calls": first[0].n_buckets,
        "bucket_mb": best, "bucket_refresh_s": statistics.median(r.total_s for r in reps[best]),
        "bucket_pack_s": statistics.median(m.pack_s for _, m in runs[best]),
        "bucket_server_copy_s": statistics.median(m.server.copy_s for _, m in runs[best]),
        "per_bucket_mb": {str(mb): statistics.median(r.total_s for r in reps[mb]) for mb in bucket_mbs},
        "bit_exact_server": got["sha256"] == want, "served_version": [served], "expected_version": str(clock.value),
        "floors": floors, "totals": [r.total_s for r in first],
    }


def _disk(control: ControlChannel, urls: list[str], model_dir: str, device: str, repeats: int,  # noqa: ARG001
          timeout_s: float) -> dict[str, Any]:
    """/update_weights_from_disk on the first server vs a plain safetensors read onto its device."""
    import glob

    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    dev = "cuda:0" if device.startswith("cuda") and torch.cuda.device_count() == 1 else device
    raw, upd = [], []
    for _ in range(1):  # one round: an 8B read is seconds, and the page cache is hot either way
        t0 = time.perf_counter()
        for f in files:
            d = load_file(f, device=dev)
            del d
        if dev.startswith("cuda"):
            torch.cuda.synchronize(dev)
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        control.run(control.acall(urls[0], "/update_weights_from_disk", {"model_path": model_dir},
                                  timeout_s=timeout_s), timeout_s)
        upd.append(time.perf_counter() - t0)
    return {"disk_update_s": statistics.median(upd), "disk_raw_read_s": statistics.median(raw)}


def run(knobs: dict[str, Any], on_size=None) -> dict[str, Any]:
    """Every size in turn; `on_size(partial_result)` after each (so a long run keeps what it measured)."""

    sizes = [s.strip() for s in str(knobs["sizes"]).split(",") if s.strip()]
    for s in sizes:
        if s not in SHAPES:
            raise SystemExit(f"unknown size '{s}'; one of {', '.join(SHAPES)}")
    device, backend = knobs["device"], knobs["backend"]
    if backend == "nccl" and device != "cuda":
        raise SystemExit("backend=nccl needs device=cuda")
    try:
        bucket_mbs = [float(x) for x in str(knobs["bucket_mb"]).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"bucket_mb must be a number or a comma list of numbers, got {knobs['bucket_mb']!r}") from None
    dtype = getattr(torch, knobs["dtype"])
    timeout_s = float(knobs["timeout_s"])
    n, repeats = int(knobs["n_servers"]), int(knobs["repeats"])
    external = [u for u in str(knobs["servers"] or "").split(",") if u]
    rows, per_size = [], {}
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix=f"awrl-weightsync-{size}-") as model_dir:
            named = make_model_folder(size, dtype, model_dir, str(knobs["tokenizer"]))
            if device == "cuda":
                named = [(k, t.to("cuda:0")) for k, t in named]
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            if knobs["path"] == "same_device":
                m = _measure_same_device(named, model_dir, device, knobs["dtype"], bucket_mbs, repeats, timeout_s,
                                         str(knobs["pause_mode"]))
            else:
                m = _measure(named, model_dir, n, device, backend, knobs["dtype"], bucket_mbs, repeats, timeout_s,
                             external, str(knobs["pause_mode"]), bool(int(knobs["disk"])),
                             os.environ.get("ASYNCWEBRL_API_KEY") if external else None)
        refresh, floor = m["refresh_s"], m["floor_s"]
        per_size[size] = {
            "params": sum(t.numel() for _, t in named), "bytes": nbytes, "refresh_s": refresh, "floor_s": floor,
            "ratio_over_floor": refresh / floor, "refresh_GBps": nbytes / refresh / 1e9,
            "floor_GBps": nbytes / floor / 1e9, "per_tensor_floor_GBps": nbytes / m["per_tensor_floor_s"] / 1e9,
            **{k: v for k, v in m.items() if k not in ("refresh_s", "floor_s")},
        }
        rows.append({"size": size, "GiB": round(nbytes / 2**30, 2), "refresh_s": refresh, "floor_s": floor,
                     "floor_GBps": nbytes / floor / 1e9, "per_tensor_s": m["per_tensor_floor_s"],
                     "ratio": refresh / floor, "bit_exact": m["bit_exact_server"]})
        del named
        largest = size
        res = {"rows": rows, "per_size": per_size, "largest": largest,
               "ratio_over_floor": per_size[largest]["ratio_over_floor"],
               "floor_GBps": per_size[largest]["floor_GBps"], "complete": size == sizes[-1]}
        if on_size is not None:
            on_size(res)
    return res


def main(overrides: list[str]) -> int:
    from asyncwebrl.bench.common import parse_overrides

    knobs = parse_overrides(overrides, DEFAULTS)
    if knobs["path"] not in ("broadcast", "same_device"):
        raise SystemExit(f"path must be broadcast or same_device, got {knobs['path']!r}")
    config = dict(knobs, refresh_target="external servers" if knobs["servers"] else "embedded hf inference servers",
                  refresh_path="weights.bracket.RefreshBracket + weights.sender.WeightSender (the trainer loop's)",
                  floor_target="one flat buffer of the same bytes, broadcast between two barriers to one receiver "
                               "process per server (torch.distributed only, no HTTP)",
                  trainer_ranks=1, model="random-init LlamaForCausalLM of each size")
    if knobs["path"] == "same_device":
        config.update(refresh_path="weights.bracket.RefreshBracket + weights.ipc.SameDeviceSender (the trainer "
                                   "rank's in the shared-device layout): /update_weights_from_tensor with handles",
                      refresh_target="one embedded hf inference server on the trainer's device",
                      floor_target="one device-to-device copy of the same bytes on that device (torch copy_, "
                                   "synchronized), no HTTP")

    def record(res: dict[str, Any]) -> None:
        write_result(knobs["out"], config, {"ratio_over_floor": res["ratio_over_floor"], "largest": res["largest"],
                                            "floor_GBps": res["floor_GBps"], "complete": res["complete"],
                                            "per_size": res["per_size"]})

    res = run(knobs, record)
    print_table(res["rows"], f"ratio_over_floor ({res['largest']}, {knobs['path']}, {knobs['backend']}, "
                             f"{knobs['n_servers']} server(s)): {res['ratio_over_floor']:.3f}")
    return 0
