"""TestRolloutManager: evaluation on checkpoints by a separate inference group (SPEC section 5).

A daemon thread with its own asyncio loop and its own inference server(s). It scans the checkpoint
root for the newest complete checkpoint, hot-loads it with `/update_weights_from_disk`, runs the
fixed evaluation set, and logs eval metrics tagged with the checkpoint's version. With held-out tasks
(tasks the trainer never samples) it runs their fixed set on the same snapshot and adds
`heldout_success_rate` / `heldout_per_task` to the same eval record.

Invariants: it never joins the weight-broadcast group and never blocks training (the trainer only
reads `wants_checkpoint`, a flag, at step boundaries); it only ever evaluates complete checkpoints,
so every evaluation runs on a self-consistent snapshot; a failing evaluation is logged and counted,
and the thread goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncwebrl.evaluation.evaluate import run_eval_episodes
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.training.checkpoint import latest_complete_checkpoint

log = logging.getLogger(__name__)


def checkpoint_version(path: Path) -> int:
    meta = json.loads((path / "trainer_state.json").read_text())
    return int(meta["version"])


class TestRolloutManager:
    __test__ = False  # not a pytest class

    def __init__(self, *, ckpt_root: Path, client, adapter, env_factory, env_cfg, tasks, sampling: dict[str, Any],
                 on_result: Callable[[dict[str, Any]], None], poll_interval_s: float = 2.0,
                 flush_after_s: float | None = 120.0, concurrency: int = 2, store: PixelStore | None = None,
                 heldout_tasks=None):
        self.ckpt_root = Path(ckpt_root)
        self.client = client
        self.adapter = adapter
        self.env_factory = env_factory
        self.env_cfg = env_cfg
        self.tasks = tasks
        self.heldout_tasks = list(heldout_tasks or [])
        self.sampling = sampling
        self.on_result = on_result
        self.poll_interval_s = poll_interval_s
        self.flush_after_s = flush_after_s
        self.concurrency = concurrency
        self.store = store
        self.evaluated: list[int] = []
        self.failures = 0
        self.busy_s = 0.0
        self._want_ckpt = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_new = time.monotonic()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Also hand every evaluation's figures to `listener` (called on the evaluation thread, after
        `on_result`; it must be quick and thread-safe, e.g. a queue's put)."""
        self._listeners.append(listener)

    # ---- what the trainer sees ----------------------------------------------------------------
    @property
    def wants_checkpoint(self) -> bool:
        """True when evaluation has waited long for a new checkpoint; the trainer may write one early."""
        return self._want_ckpt.is_set()

    def checkpoint_written(self) -> None:
        self._want_ckpt.clear()

    # ---- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="test-rollout", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout_s)

    def evaluate_latest_blocking(self, timeout_s: float = 600.0) -> dict[str, Any] | None:
        """Evaluate the newest complete checkpoint now if it is not evaluated yet (end of run)."""
        deadline = time.monotonic() + timeout_s
        ckpt = latest_complete_checkpoint(self.ckpt_root)
        if ckpt is None:
            return None
        v = checkpoint_version(ckpt)
        while v not in self.evaluated and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.5)
        return {"version": v, "evaluated": v in self.evaluated}

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        try:
            await self._poll()
        finally:
            close = getattr(self.client, "aclose", None)
            if close is not None:
                await close()

    async def _poll(self) -> None:
        while not self._stop.is_set():
            ckpt = latest_complete_checkpoint(self.ckpt_root)
            version = checkpoint_version(ckpt) if ckpt else None
            if ckpt is None or version in self.evaluated:
                if self.flush_after_s and time.monotonic() - self._last_new > self.flush_after_s:
                    self._want_ckpt.set()
                await asyncio.sleep(self.poll_interval_s)
                continue
            self._last_new = time.monotonic()
            t0 = time.monotonic()
            try:
                await self.client.aupdate_weights_from_disk(str(ckpt), version)
                figures = await run_eval_episodes(self.tasks, self.env_factory, self.client, self.adapter,
                                                  self.store, self.env_cfg, self.sampling, version,
                                                  concurrency=self.concurrency)
                if self.heldout_tasks:
                    held = await run_eval_episodes(self.heldout_tasks, self.env_factory, self.client, self.adapter,
                                                   self.store, self.env_cfg, self.sampling, version,
                                                   concurrency=self.concurrency)
                    figures["heldout_success_rate"] = held["success_rate"]
                    figures["heldout_n_episodes"] = held["n_episodes"]
                    figures["heldout_invalid_rate"] = held["invalid_rate"]
                    figures["heldout_per_task"] = held["per_task"]
                figures["checkpoint"] = ckpt.name
                figures["eval_time_s"] = time.monotonic() - t0
                self.on_result(figures)
                for listener in self._listeners:
                    listener(figures)
            except Exception as e:
                # the checkpoint may have been pruned under us, or the server restarted: count, go on
                self.failures += 1
                log.warning("evaluation of %s failed: %s", ckpt, e)
            finally:
                self.evaluated.append(version)
                self.busy_s += time.monotonic() - t0
