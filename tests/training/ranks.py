"""Start M trainer ranks as local processes (spawn + tcp rendezvous) and collect what each returns: the
tests' way to run real multi-rank FSDP programs (`programs.py`). The product hosts the same per-rank
`FSDPActor` through its scheduler (`scheduling/trainer_host.py`). The target is an importable top-level function
`target(rank, world_size, master_addr, master_port, *args) -> picklable`.

Invariant: `run_ranks` never hangs: it returns every rank's result, or raises with the failing rank's
traceback as soon as one rank fails, or when `timeout_s` passes; every process it started is ended
before it returns.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from asyncwebrl.net import LOOPBACK, free_port


class RankFailed(RuntimeError):
    """A trainer rank raised, died, or did not finish in time."""


def _rank_main(target: Callable[..., Any], rank: int, world_size: int, addr: str, port: int,
               args: tuple, results: Any, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        # plain bytes: tensors put on a queue as-is would share memory with a process about to exit
        buf = io.BytesIO()
        torch.save(target(rank, world_size, addr, port, *args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(target: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float = 600.0,
              master_addr: str = LOOPBACK, threads_per_rank: int | None = None) -> list[Any]:
    """Run `target` on `world_size` fresh processes; results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port(master_addr)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_rank_main, args=(target, r, world_size, master_addr, port, args, results, threads),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty as empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode != 0]
                if dead:
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from empty
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankFailed(f"ranks {missing} not done after {timeout_s:.0f}s") from empty
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]
