"""Decode steps launched one ahead of the host's token read (GraphEngine's decode path).

The host launches step k+1 before it reads step k's tokens: step k+1 takes its input tokens from the
device (`StaticDecoder.last_tok`, see static_decode.py), each step's tokens and logprobs come back by
an asynchronous copy into pinned memory (a CUDA event marks them ready), and the host commits step k
(stop rules, delivery, compaction) while the device computes step k+1. So the device does not wait for
Python between steps. On a CPU the same bookkeeping runs with synchronous copies (the tests run it).

Invariants:
- at most one launched step is unread when the engine loop releases the model lock, and anyone else
  who takes the lock (pause, abort, weight access: `HFEngine._settle`) commits it first, so no step is
  in flight across a weight update or while the engine is paused;
- steps are committed in launch order; a step's row i belongs to the request that held slot i at its
  launch (the record keeps that list), so a compaction after the launch does not change what it reads;
- a request that finished (stop token, stop string, abort) at step k may have been launched again in
  step k+1: that token is dropped (never appended, never counted), so the outputs are those of the
  one-step-at-a-time path; no step is launched when every row has been launched up to its
  max_new_tokens;
- a step runs ahead only when no row needs the host's sampler (top-k/top-p/min-p, an EOS ban before
  min_new_tokens): such a step is committed before the next launch (its token comes from the host);
- `EngineRequest.dev_row` names the row of `last_tok` holding the request's newest token: set at
  launch, valid until the next step or graph capture; None where the host's output_ids[-1] is the next
  input (after a prefill, a host-sampled token, a capture);
- at most two steps are unread at once (one ahead), within the ring of `STAGING` pinned buffers.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from asyncwebrl.inference.engine import EngineRequest
from asyncwebrl.inference.static_decode import STAGING, StaticDecoder


@dataclass
class StepRecord:
    """One launched decode step, until the host commits it."""

    reqs: list[EngineRequest]
    """row i's request at launch"""
    cpu: list[bool]
    """rows whose token the host samples from `logits` (the step is committed before the next launch)"""
    host: torch.Tensor
    """[2, slots] float64: sampled tokens and their logprobs (columns [0, len(reqs))), once `event` has
    completed"""
    event: Any
    """torch.cuda.Event recorded after the copy into `host` (None on a CPU: the copy was synchronous)"""
    logits: torch.Tensor
    """the step's device logits (valid until the next launch)"""
    version: str
    """the weight version the step ran with"""


class DecodePipeline:
    """Launches decode steps ahead of the host's reads and hands them back in order (module docstring)."""

    def __init__(self, decoder: StaticDecoder):
        self.dec = decoder
        on_gpu = decoder.device.type == "cuda"
        self._host = [torch.zeros((2, decoder.max_slots), dtype=torch.float64, pin_memory=on_gpu)
                      for _ in range(STAGING)]
        self._events = [torch.cuda.Event() for _ in range(STAGING)] if on_gpu else None
        self._k = 0
        self.pending: deque[StepRecord] = deque()
        self.wait_s = 0.0
        """host time spent waiting for a step's tokens"""

    @torch.inference_mode()
    def launch(self, reqs: list[EngineRequest], positions: list[int], rope_positions: list[int],
               cpu: list[bool], version: str) -> StepRecord:
        """Enqueue one step for slots [0, len(reqs)) (row i feeds reqs[i]'s newest token at positions[i])."""
        if len(self.pending) >= STAGING - 1:
            raise RuntimeError(f"{len(self.pending)} decode steps unread; the ring holds {STAGING - 1}")
        ids, src = [], []
        for r in reqs:
            if r.dev_row is None:
                ids.append(r.output_ids[-1])
                src.append(-1)
            else:
                ids.append(0)
                src.append(r.dev_row)
        _, _, logits = self.dec.launch(ids, src, positions, rope_positions,
                                       [r.sampling.temperature for r in reqs])
        slot = self._k % STAGING
        self._k += 1
        host = self._host[slot]
        host.copy_(self.dec.out, non_blocking=True)  # whole: a strided copy would wait for the device
        event = None
        if self._events is not None:
            event = self._events[slot]
            event.record()
        for i, r in enumerate(reqs):
            r.dev_row = i
            r.in_flight += 1
        rec = StepRecord(list(reqs), cpu, host, event, logits, version)
        self.pending.append(rec)
        return rec

    def pop(self) -> tuple[StepRecord, list[int], list[float]]:
        """The oldest unread step with its tokens and logprobs (waits for the device)."""
        rec = self.pending.popleft()
        if rec.event is not None:
            t0 = time.perf_counter()
            rec.event.synchronize()
            self.wait_s += time.perf_counter() - t0
        n = len(rec.reqs)
        toks = [int(t) for t in rec.host[0, :n].tolist()]
        lps = rec.host[1, :n].tolist()
        for r in rec.reqs:
            r.in_flight -= 1
        return rec, toks, lps

    def forget(self) -> None:
        """Drop every unread step (after a failed step: its requests are ended by the caller)."""
        for rec in self.pending:
            for r in rec.reqs:
                r.in_flight = 0
        self.pending.clear()
