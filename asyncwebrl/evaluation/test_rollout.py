"""TestRolloutManager: evaluation on checkpoints by a separate inference group (SPEC section 5).

A daemon thread with its own asyncio loop and its own inference server(s). It scans the checkpoint
root for the newest complete checkpoint, hot-loads it with `/update_weights_from_disk`, runs the
fixed evaluation set, and logs eval metrics tagged with the checkpoint's version. With held-out tasks
(tasks the trainer never samples) it runs their fixed set on the same snapshot and adds
`heldout_success_rate` / `heldout_per_task` to the same eval record. Beside each set's success it
reports the shortcut baseline (`evaluation.shortcut`: the best constant-action policy on the same
episodes, played once per set) and `gain_over_shortcut`.

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
from asyncwebrl.evaluation.shortcut import ShortcutBaseline, shortcut_baseline, shortcut_figures
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
                 heldout_tasks=None, shortcut: bool = True):
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
        self.shortcut_enabled = shortcut
        """play the constant-action policies once per evaluation set (test_rollout.shortcut_baseline)"""
        self.shortcut: ShortcutBaseline | None = None
        self.heldout_shortcut: ShortcutBaseline | None = None
        self._shortcut_tried = False

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

    async def _shortcut_once(self) -> None:
        """The shortcut baselines of both sets, before the first evaluation (they depend on no version);
        one failed attempt is logged and counted, and the evaluations go on without them."""
        if not self.shortcut_enabled or self._shortcut_tried:
            return
        self._shortcut_tried = True
        try:
            self.shortcut = await shortcut_baseline(self.tasks, self.env_cfg, concurrency=self.concurrency)
            if self.heldout_tasks:
                self.heldout_shortcut = await shortcut_baseline(self.heldout_tasks, self.env_cfg,
                                                                concurrency=self.concurrency)
            log.info("shortcut baseline %.3f (%s) in %.0f s", self.shortcut.success_rate, self.shortcut.policy,
                     self.shortcut.seconds)
        except Exception as e:
            self.failures += 1
            log.warning("the shortcut baseline failed (evaluations are reported without it): %s", e)

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
                await self._shortcut_once()
                figures = await run_eval_episodes(self.tasks, self.env_factory, self.client, self.adapter,
                                                  self.store, self.env_cfg, self.sampling, version,
                                                  concurrency=self.concurrency)
                figures.update(shortcut_figures(figures["success_rate"], self.shortcut))
                if self.heldout_tasks:
                    held = await run_eval_episodes(self.heldout_tasks, self.env_factory, self.client, self.adapter,
                                                   self.store, self.env_cfg, self.sampling, version,
                                                   concurrency=self.concurrency)
                    figures["heldout_success_rate"] = held["success_rate"]
                    figures["heldout_n_episodes"] = held["n_episodes"]
                    figures["heldout_invalid_rate"] = held["invalid_rate"]
                    figures["heldout_per_task"] = held["per_task"]
                    figures.update(shortcut_figures(held["success_rate"], self.heldout_shortcut, "heldout_"))
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
