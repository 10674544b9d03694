"""The ONE weight-refresh bracket (SPEC section 5): the only window where rollout and training
serialise. Used by the trainer loop (`controller/main.py`), the rollout controllers'
`update_weights` and `bench weightsync`, so the bench times exactly what production does.

  1. pause the rollout gate (no new episode or request starts);
  2. pause every train-rollout server: POST /pause_generation {mode}; SGLang's modes:
       "abort"    in-flight requests end now (finish_reason abort) and the client resubmits them
                  with prompt + tokens so far, keeping per-token logprobs and versions;
       "in_place" they stay in the running batch, KV cache kept, and continue after step 6;
       "retract"  they go back to the waiting queue (KV recomputed) and continue after step 6;
  3. POST /begin_weight_update (the update session SGLang 0.5.x requires; a server without it,
     an older SGLang, answers 404 and is not asked again);
  4. transfer: the caller's function (the NCCL/gloo broadcast from the trainer rank, or a disk load);
  5. on every server POST /end_weight_update, then /flush_cache (not in "in_place" mode: SGLang
     refuses to flush while held requests keep their KV, so the transfer announces flush_cache
     false and in_place requests keep cached prefixes apart by version, see `client.py`); only once
     every server passed both, /update_weight_version {new_version, abort_all_requests: false} ONCE
     (the servers report the new version only now that every bucket landed and the cache the old
     weights made is gone). Each call is retried (`FINISH_ATTEMPTS`) before a server is given up;
  6. advance the version's owner (`weights.version.PolicyVersion`, +1: the bracket is its only
     caller), publish it to the rollout side (the gate's `publish_version`, which copies it to the
     staleness manager and the executors), POST /continue_generation, resume the gate.

`refresh(transfer, advance=False)` (resume from a checkpoint) moves the checkpoint's weights to the
servers and re-publishes the owner's value without advancing it.

Invariants: the version moves only if the transfer succeeded, and only here; the servers report the
owner's value (as SGLang's `weight_version` string) before the rollout side does; one version means
one set of weights. A refresh that fails before any server loaded anything leaves the old weights
serving at the old version, gate and servers resumed. A server that may hold weights its version
does not name (a transfer that failed after it loaded a bucket, or a finish step that failed after
its retries) is stale: it is left paused, so it serves nothing under a wrong version, and the
refresh raises `StaleServers` naming it; the next refresh that succeeds sends it every weight again,
labels it and continues it (or the owner rebuilds it). Every call is bounded by the channel's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

from asyncwebrl.protocol import ProtocolError
from asyncwebrl.weights.control import ControlChannel
from asyncwebrl.weights.group import WeightSyncError
from asyncwebrl.weights.version import PolicyVersion, VersionDrift

PauseMode = Literal["abort", "in_place", "retract"]
PAUSE_MODES: tuple[str, ...] = ("abort", "in_place", "retract")
FINISH_ATTEMPTS = 3
"""tries of each finish call per server (a flush refused while an aborted request drains, a dropped
connection) before the server is given up as stale"""
FINISH_RETRY_S = 0.5


class StaleServers(WeightSyncError):
    """A refresh left servers whose weights their version may not name; they are kept paused.

    `servers`: address -> what failed there."""

    def __init__(self, message: str, servers: dict[str, str]):
        super().__init__(message)
        self.servers = servers


class Gate(Protocol):
    """The rollout side (RolloutController, SyncRolloutPool): it reads `clock`, the version's owner,
    and copies its value to its own holders in `publish_version`."""

    clock: PolicyVersion

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def publish_version(self) -> None: ...


@dataclass
class RefreshReport:
    """One refresh, timed phase by phase on the caller (seconds)."""

    version: int
    pause_s: float = 0.0
    begin_s: float = 0.0
    transfer_s: float = 0.0
    finish_s: float = 0.0
    """end_weight_update + update_weight_version"""
    resume_s: float = 0.0
    total_s: float = 0.0
    interrupted: int = 0
    """requests running on the servers when they were paused (aborted or held, per the mode)"""
    bytes: int = 0
    n_buckets: int = 0
    n_tensors: int = 0

    def metrics(self) -> dict[str, float]:
        """Per-step metrics, `sync_` prefixed (the trainer loop logs them)."""
        return {f"sync_{f.name}": float(getattr(self, f.name)) for f in fields(self) if f.name != "version"}


class RefreshBracket:
    """pause gate + servers -> update session -> transfer -> version -> continue.

    `clock`: the version's owner; by default the gate's (a bracket without a gate needs one)."""

    def __init__(self, gate: Gate | None = None, control: ControlChannel | None = None,
                 pause_mode: PauseMode = "in_place", *, clock: PolicyVersion | None = None):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {pause_mode!r} is not one of {', '.join(PAUSE_MODES)}")
        gate_clock = gate.clock if gate is not None else None
        if clock is None:
            clock = gate_clock
        if clock is None:
            raise ValueError("a refresh bracket needs the version's owner: a gate, or clock=PolicyVersion")
        if gate_clock is not None and gate_clock is not clock:
            raise ValueError("the rollout gate reads another PolicyVersion than the bracket advances")
        self.gate = gate
        self.control = control
        self.pause_mode = pause_mode
        self.clock = clock
        self.stale: dict[str, str] = {}
        """servers the last refresh left stale (paused), address -> what failed"""

    def _finish(self, ctl: ControlChannel, version: int):
        return _finish_calls(ctl, version, flush=self.pause_mode != "in_place")

    def disk_transfer(self, model_path: str | Callable[[], str], timeout_s: float = 600.0) -> Callable[[], Any]:
        """The transfer of the disk path: every server loads `model_path` (or what the callable
        returns, e.g. a checkpoint written on the spot) with `/update_weights_from_disk`. The cache
        and the version are the bracket's (step 5): SGLang's load would otherwise flush while held
        requests run, and answer 400 after it already loaded the weights."""
        ctl = self.control
        if ctl is None:
            raise ValueError("a disk transfer needs the servers' control channel")

        def transfer() -> dict[str, Any]:
            import asyncio

            body = {"model_path": model_path() if callable(model_path) else model_path, "flush_cache": False,
                    "abort_all_requests": False}

            async def load(s: str) -> Any:
                try:
                    return await ctl.acall(s, "/update_weights_from_disk", body, timeout_s=timeout_s)
                except WeightSyncError as e:
                    return e

            async def load_all() -> list[Any]:
                return await asyncio.gather(*(load(s) for s in ctl.servers))

            answers = dict(zip(ctl.servers, ctl.run(load_all(), timeout_s), strict=True))
            failed = {s: a for s, a in answers.items() if isinstance(a, WeightSyncError)}
            if failed:
                err = WeightSyncError(f"update_weights_from_disk failed: {failed}")
                # a refusal loaded nothing (SGLang rolls a failed load back; ours checks before writing)
                err.touched = [s for s in ctl.servers
                               if s not in failed or not isinstance(failed[s].__cause__, ProtocolError)]
                raise err
            return answers
        return transfer

    def refresh(self, transfer: Callable[[], Any], advance: bool = True) -> tuple[RefreshReport, Any]:
        """Run the bracket around `transfer()`; returns the report and what `transfer` returned. The
        version becomes `clock.next` (with `advance=False` it stays `clock.value`: resume)."""
        version = self.clock.next if advance else self.clock.value
        rep = RefreshReport(version)
        t0 = time.perf_counter()
        ctl = self.control
        if self.gate is not None:
            self.gate.pause()
        paused = session = finished = False
        stale: dict[str, str] = {}
        try:
            if ctl is not None:
                paused = True  # continue goes to every server, also when only some of them paused
                answers = ctl.call_all("/pause_generation", {"mode": self.pause_mode})
                rep.interrupted = sum(_running(a) for a in answers.values())
            t1 = time.perf_counter()
            if ctl is not None:
                if self.stale:  # a session a failed finish left open on a stale server
                    _best_effort(ctl, list(self.stale), "/end_weight_update")
                session = True
                ctl.call_all("/begin_weight_update", {}, optional=True)
            t2 = time.perf_counter()
            try:
                result = transfer()
            except BaseException as e:
                if ctl is not None:
                    stale = _touched(e, ctl.servers)
                    if stale:
                        raise StaleServers(f"the transfer failed after servers loaded weights ({e}); "
                                           f"kept paused: {sorted(stale)}", stale) from e
                raise
            t3 = time.perf_counter()
            if ctl is not None:
                finished = True
                stale = self._finish(ctl, version)
            if advance and self.clock.advance() != version:
                raise VersionDrift(f"the version moved under a refresh to {version} (two brackets at once?)")
            if self.gate is not None:
                self.gate.publish_version()
            t4 = time.perf_counter()
            rep.pause_s, rep.begin_s, rep.transfer_s, rep.finish_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
            for k in ("bytes", "n_buckets", "n_tensors"):
                v = getattr(result, k, None)
                if isinstance(v, int):
                    setattr(rep, k, v)
        finally:
            t5 = time.perf_counter()
            self.stale = stale
            if ctl is not None and session and not finished:  # a later refresh must be able to begin
                _best_effort(ctl, ctl.servers, "/end_weight_update")
            try:
                if ctl is not None and paused:
                    _continue(ctl, [s for s in ctl.servers if s not in stale])
            finally:
                if self.gate is not None:
                    self.gate.resume()
            rep.resume_s = time.perf_counter() - t5
            rep.total_s = time.perf_counter() - t0
        if stale:
            raise StaleServers(f"the weights of version {version} landed, but finishing failed on "
                               f"{sorted(stale)} (kept paused): {stale}", stale)
        return rep, result


def _retried(ctl: ControlChannel, server: str, endpoint: str, body: dict[str, Any],
             optional: bool = False) -> WeightSyncError | None:
    """One finish call, tried `FINISH_ATTEMPTS` times; the last error, or None once it succeeded."""
    err: WeightSyncError | None = None
    for attempt in range(FINISH_ATTEMPTS):
        if attempt:
            time.sleep(FINISH_RETRY_S * attempt)
        try:
            ctl.call(server, endpoint, body, optional=optional)
            return None
        except WeightSyncError as e:
            err = e
    return err


def _finish_calls(ctl: ControlChannel, version: int, flush: bool) -> dict[str, str]:
    """Close the session and drop cached prefixes (unless requests hold KV) on every server, then
    set the version on those that passed: a server reports the new version only once nothing of
    the old weights is left there. Returns the servers that failed (address -> error)."""

    def close(s: str) -> WeightSyncError | None:
        err = _retried(ctl, s, "/end_weight_update", {}, optional=True)
        if err is None and flush:
            err = _retried(ctl, s, "/flush_cache", {}, optional=True)
        return err

    stale = {s: str(e) for s, e in zip(ctl.servers, ctl.each(close), strict=True) if e is not None}
    label = [s for s in ctl.servers if s not in stale]
    body = {"new_version": str(version), "abort_all_requests": False}
    errs = ctl.each(lambda s: _retried(ctl, s, "/update_weight_version", body), label)
    stale.update({s: str(e) for s, e in zip(label, errs, strict=True) if e is not None})
    return stale


def _continue(ctl: ControlChannel, servers: list[str]) -> None:
    """/continue_generation to `servers`; every one is tried, the first failure is raised."""
    for e in ctl.each(lambda s: _retried(ctl, s, "/continue_generation", {}), servers):
        if e is not None:
            raise e


def _best_effort(ctl: ControlChannel, servers: list[str], endpoint: str) -> None:
    """`endpoint` once to each of `servers`, errors ignored (closing what may be open)."""

    def once(s: str) -> None:
        try:
            ctl.call(s, endpoint, {}, optional=True)
        except WeightSyncError:
            pass

    ctl.each(once, servers)


def _touched(err: BaseException, servers: list[str]) -> dict[str, str]:
    """Servers a failed transfer may have left with some new weights: those the sender saw load a
    bucket, or, when the transfer does not say (a disk load, a caller's function), every server
    except those that refused it before loading anything."""
    touched = getattr(err, "touched", None)
    if touched is None:
        untouched = getattr(err, "untouched", set())
        touched = [s for s in servers if s not in untouched]
    return {s: f"{type(err).__name__}: {err}" for s in touched}


def _running(answer: dict[str, Any] | None) -> int:
    """Requests a server held when paused: the embedded server reports `running`; SGLang reports
    nothing (0), and its interruptions are counted by the client's resubmits instead."""
    if not answer:
        return 0
    v = answer.get("running", answer.get("num_paused_requests", 0))
    return int(v) if isinstance(v, (int, float)) else 0
