"""A trainer rank in a process of its own, for the local scheduler (`scheduler.trainer_process`).

Why: under scheduler.type=local the rollout workers are threads of the controller process. With
rollout.mode=async they run while the trainer steps, and a trainer rank hosted in that process shares
one interpreter lock with them: every kernel launch, every torch.compile trace of the trainer waits
behind episode loops, HTTP clients and screenshot encoding. On one GPU (the shared-device layout) that
starves the trainer outright. In its own process the rank has its own interpreter; the controller talks
to it the way it talks to a Ray actor: one call at a time, arguments and answers pickled.

The rank process is started with `spawn` (never `fork`: the parent may hold CUDA and threads). It
serves calls in order until `close`. A call's exception comes back as the same exception, with the
rank's traceback attached as a note; a rank process that dies fails the pending call (and every later
one) with its exit code.

Screenshots: the controller's PixelStore is in-process (local scheduler), so a train step's screenshots
travel with the call as a read-only `PixelView`; the controller frees the batch's references in its own
store once the step returned, exactly as the rank frees them when it shares the store.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import traceback
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""the rank's start-up (imports, model load, optimizer) within this, or the start fails"""
POLL_S = 1.0
CLOSE_TIMEOUT_S = 60.0


class RankProcessDied(RuntimeError):
    """The trainer rank's process exited while (or before) serving a call."""


class PixelView:
    """The screenshots of one batch, read-only: what a rank process reads instead of the controller's
    store. `get` answers the keys it was given (None for others); `free` drops nothing here (the
    controller frees in its store after the step)."""

    def __init__(self, items: dict[str, bytes]):
        self.items = items

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.items.get(k) for k in keys]

    def free(self, keys: Sequence[str]) -> int:
        return 0

    def count_missing(self, keys: Sequence[str]) -> int:
        return sum(k not in self.items for k in keys)


def _serve(conn, cls: type, args: tuple, kwargs: dict) -> None:
    """The rank process: build the rank (`cls`, a TrainerRank), then answer (method, args, kwargs) calls
    until close."""
    try:
        rank = cls(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - every start failure goes back to the controller
        conn.send(("err", _portable(e)))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, a, kw = conn.recv()
        except EOFError:  # the controller went away
            method, a, kw = "close", (), {}
        try:
            out = getattr(rank, method)(*a, **kw)
            reply = ("ok", out)
        except BaseException as e:  # noqa: BLE001
            reply = ("err", _portable(e))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            method = "close"
        except Exception as e:  # an answer that does not pickle
            conn.send(("err", RuntimeError(f"{method} returned an unpicklable {type(reply[1]).__name__}: {e}")))
        if method == "close":
            return


def _portable(e: BaseException) -> BaseException:
    """`e` with the rank's traceback as a note, or a RuntimeError naming it when `e` does not pickle."""
    import pickle

    text = "in the trainer rank process:\n" + "".join(traceback.format_exception(e))
    try:
        e.add_note(text)
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}\n{text}")


class ProcessRank:
    """The controller's handle on a rank (`cls(*args, **kwargs)`, a TrainerRank) served by `_serve` in a
    spawned process. Calls are serialized (one at a time, like an actor's mailbox); attribute access
    gives a callable."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self.process = ctx.Process(target=_serve, args=(child, cls, args, kwargs), name="trainer-rank", daemon=True)
        self.process.start()
        child.close()
        self._closed = False
        with self._lock:
            self._answer("start", START_TIMEOUT_S)

    def _answer(self, method: str, timeout_s: float | None = None) -> Any:
        waited = 0.0
        while not self._conn.poll(POLL_S):
            waited += POLL_S
            if not self.process.is_alive():
                raise RankProcessDied(f"the trainer rank process (pid {self.process.pid}) exited with code "
                                      f"{self.process.exitcode} during {method}")
            if timeout_s is not None and waited >= timeout_s:
                raise TimeoutError(f"the trainer rank process did not answer {method} within {timeout_s:.0f} s")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as e:
            self.process.join(5)
            raise RankProcessDied(f"the trainer rank process exited with code {self.process.exitcode} "
                                  f"during {method}") from e
        if status == "err":
            raise value
        return value

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RankProcessDied(f"{method} on a closed trainer rank process")
            if not self.process.is_alive():
                raise RankProcessDied(f"the trainer rank process exited with code {self.process.exitcode}")
            try:
                self._conn.send((method, args, kwargs))
            except OSError as e:  # the process went between the check and the send
                self.process.join(5)
                raise RankProcessDied(f"the trainer rank process exited with code {self.process.exitcode} "
                                      f"before {method}") from e
            return self._answer(method)

    def train_step(self, groups, pixel_store=None, version: int | None = None) -> dict[str, Any]:
        """The step on the rank, its screenshots carried along; the batch's references are freed in
        `pixel_store` when the step returned (as the rank does when it holds the store itself)."""
        if pixel_store is None:
            return self.call("train_step", groups, None, version)
        from asyncwebrl.training.samples import consumed_pixel_keys

        refs = consumed_pixel_keys(groups)
        keys = sorted(set(refs))
        view = PixelView({k: b for k, b in zip(keys, pixel_store.get(keys), strict=True) if b is not None})
        out = self.call("train_step", groups, view, version)
        if refs:
            pixel_store.free(refs)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.process.is_alive():
                    self._conn.send(("close", (), {}))
                    self._answer("close", CLOSE_TIMEOUT_S)
            except Exception as e:  # closing is best effort: the process is ended below either way
                log.warning("trainer rank process: close failed (%s)", e)
            finally:
                self.process.join(CLOSE_TIMEOUT_S)
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join(5)
                self._conn.close()

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *a, **kw: self.call(method, *a, **kw)
