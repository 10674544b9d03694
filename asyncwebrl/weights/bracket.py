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
  5. POST /end_weight_update, /update_weight_version {new_version} ONCE (the servers report the new
     version only now that every bucket landed) and /flush_cache (not in "in_place" mode: SGLang
     refuses to flush while held requests keep their KV, so the transfer announces flush_cache
     false), together: generation is paused, so they need no order among themselves;
  6. advance the version's owner (`weights.version.PolicyVersion`, +1: the bracket is its only
     caller), publish it to the rollout side (the gate's `publish_version`, which copies it to the
     staleness manager and the executors), POST /continue_generation, resume the gate.

`refresh(transfer, advance=False)` (resume from a checkpoint) moves the checkpoint's weights to the
servers and re-publishes the owner's value without advancing it.

Invariants: the version moves only if the transfer succeeded, and only here; the servers report the
owner's value (as SGLang's `weight_version` string) before the rollout side does; the gate and the
servers are resumed whatever happened (a failed refresh leaves the old weights serving, old
version); every call is bounded by the channel's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

from asyncwebrl.weights.control import ControlChannel
from asyncwebrl.weights.version import PolicyVersion, VersionDrift

PauseMode = Literal["abort", "in_place", "retract"]
PAUSE_MODES: tuple[str, ...] = ("abort", "in_place", "retract")


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

    def _finish(self, ctl: ControlChannel, version: int):
        return _finish_calls(ctl, version, flush=self.pause_mode != "in_place")

    def refresh(self, transfer: Callable[[], Any], advance: bool = True) -> tuple[RefreshReport, Any]:
        """Run the bracket around `transfer()`; returns the report and what `transfer` returned. The
        version becomes `clock.next` (with `advance=False` it stays `clock.value`: resume)."""
        version = self.clock.next if advance else self.clock.value
        rep = RefreshReport(version)
        t0 = time.perf_counter()
        ctl = self.control
        if self.gate is not None:
            self.gate.pause()
        paused = False
        try:
            if ctl is not None:
                answers = ctl.call_all("/pause_generation", {"mode": self.pause_mode})
                paused = True
                rep.interrupted = sum(_running(a) for a in answers.values())
            t1 = time.perf_counter()
            if ctl is not None:
                ctl.call_all("/begin_weight_update", {}, optional=True)
            t2 = time.perf_counter()
            result = transfer()
            t3 = time.perf_counter()
            if ctl is not None:
                ctl.run(self._finish(ctl, version))
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
            try:
                if ctl is not None and paused:
                    ctl.call_all("/continue_generation", {})
            finally:
                if self.gate is not None:
                    self.gate.resume()
            rep.resume_s = time.perf_counter() - t5
            rep.total_s = time.perf_counter() - t0
        return rep, result


async def _finish_calls(ctl: ControlChannel, version: int, flush: bool) -> None:
    """Close the session and set the version (and drop cached prefixes unless requests hold KV):
    generation is paused, so these have no order among themselves and go out together."""
    import asyncio

    calls = [ctl.acall_all("/end_weight_update", {}, optional=True),
             ctl.acall_all("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})]
    if flush:
        calls.append(ctl.acall_all("/flush_cache", {}, optional=True))
    await asyncio.gather(*calls)


def _running(answer: dict[str, Any] | None) -> int:
    """Requests a server held when paused: the embedded server reports `running`; SGLang reports
    nothing (0), and its interruptions are counted by the client's resubmits instead."""
    if not answer:
        return 0
    v = answer.get("running", answer.get("num_paused_requests", 0))
    return int(v) if isinstance(v, (int, float)) else 0
