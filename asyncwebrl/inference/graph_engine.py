"""The GPU path of the embedded engine: batched prefill + slot-based decoding over a static KV cache.

`GraphEngine` keeps `HFEngine`'s request life cycle (prepare, submit, pause/resume, abort, exclusive
weight access, stop rules, delivery) and replaces how tokens are produced:
- prefill: all admissible waiting requests in one right-padded forward of the transformers model
  (images encoded once, in that forward), then each row's KV is stored in its cache slot and its first
  token sampled from the hidden state of its last prompt token;
- decode: one `StaticDecoder` step for all running sequences (CUDA graphs on a GPU), requests join
  after any step and leave at once (continuous batching); the live rows stay in slots [0, n): a
  finished row's slot is filled by the last live row (its KV prefix copied); step k+1 is launched
  before the host reads step k's tokens (inference/decode_pipeline.py states that path's invariants);
  a prefill first commits the step in flight;
- sampling happens on the device (Gumbel-max at the request's temperature); a request with top-k,
  top-p, min-p or an EOS ban (min_new_tokens) is sampled from its logits row on the CPU by the
  plain engine's sampler, so behaviour is the same as `HFEngine`'s;
- weights: parameters stay in place (fused views); `exclusive()` checks on exit whether any was
  rebound and then rebuilds the fused buffers and graphs;
- prefill batching: with nothing running, waiting requests are prefilled at once (unless others are
  still being prepared: then up to `GATHER_S` is spent gathering them into the same prefill); with sequences
  running, a prefill of fewer requests than are running waits until the decode steps since the last
  prefill took `prefill_duty` times that prefill's time (a prefill has a large fixed cost, so arrivals
  are grouped and decoding is never starved: measured on an H200, back-to-back prefills of a trickle of
  requests left one decode step per ~150 ms); a group at least as large as the running batch goes at once;
- Qwen2.5-VL vision attention runs all windows of a prefill in one SDPA (models/vision_attention.py);
- lean prefill: the model's own forward computes image features and M-RoPE positions, and the text
  decoder inside it is run by `StaticDecoder.prefill_text` (the compiled layer functions, KV written
  into the slots); checked at start against transformers' prefill, with transformers' own
  batch-vs-alone noise as the yardstick (off when farther, see `_check_lean_prefill`);
- Qwen2.5-VL vision tower: static layouts per image grid, replayed from CUDA graphs on a GPU
  (models/vision_graph.py; installed only where it reproduces transformers' tower).

Models the decoder does not support (see static_decode.supported) fall back to the plain engine.
`make_engine` picks the engine: $ASYNCWEBRL_ENGINE = plain | graph | auto (graph on CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncwebrl.inference.decode_pipeline import DecodePipeline, StepRecord
from asyncwebrl.inference.engine import EngineRequest, HFEngine, _RunningBatch
from asyncwebrl.inference.static_decode import StaticDecoder, sample_rows, supported
from asyncwebrl.models.mrope import batch_positions
from asyncwebrl.models.vision_attention import batch_vision_attention
from asyncwebrl.models.vision_graph import VisionRunner, install
from asyncwebrl.protocol import finish_reason

log = logging.getLogger(__name__)

GATHER_S = 0.15
"""with nothing running, a prefill waits up to this long (from its oldest request's arrival) while
other requests are still inside prepare(): a closed loop's wave of 64 otherwise became a prefill of
~14 then one of ~50 (measured on an H200: 169 + 258 ms instead of ~258); a wave of 64 screenshots
landed over ~180 ms on an H200 host, and at 50 ms the split waves never lined up again"""
LEAN_NOISE_FACTOR = 4.0
"""the lean prefill may be this many times farther from transformers' prefill than transformers' padded
batch is from its own single-row forward"""
LEAN_ABS_TOL = 1e-5
"""plus this (1 - cosine): float32 noise, where the reference's own noise can be exactly 0"""
LEAN_KV0_TOL = 1e-3
"""1 - cosine of the first layer's cached keys/values: bf16 rounding of one layer is ~1e-5, a wrong
rotary position ~1e-1"""


class GraphEngine(HFEngine):
    """HFEngine with a static-cache, graph-captured decode path (see module docstring)."""

    def __init__(self, model_path: str, *, use_graphs: bool | None = None, compile_layers: bool | None = None,
                 prefill_tokens: int = 32768, prefill_duty: float = 1.0, lean_prefill: bool = True,
                 image_workers: int | None = None, **kw: Any):
        if image_workers is None:  # a GPU host has cores to spare; a CPU server shares them with browsers
            image_workers = min(8, (os.cpu_count() or 2) // 2) if str(kw.get("device", "cpu")).startswith("cuda") else 0
        super().__init__(model_path, image_workers=image_workers, **kw)
        on_gpu = self.device.type == "cuda"
        self.prefill_tokens = prefill_tokens
        self.prefill_duty = prefill_duty
        self._prefill_end = 0.0
        self._prefill_last_s = 0.0
        self.lean_prefill = lean_prefill
        self.decoder: StaticDecoder | None = None
        self.pipe: DecodePipeline | None = None
        self.vision: VisionRunner | None = None
        reason = supported(self.model)
        if reason:
            log.warning("graph engine unavailable for %s (%s): plain engine", self.model_path, reason)
            return
        self.decoder = StaticDecoder(
            self.model, max_slots=self.max_batch_size, max_len=self.context_len,
            use_graphs=on_gpu if use_graphs is None else use_graphs,
            compile_layers=on_gpu if compile_layers is None else compile_layers,
            generator=None if on_gpu else self.generator, banned_tokens=self._placeholder_ids())
        self.pipe = DecodePipeline(self.decoder)
        self.mrope = self.family.host_positions(self.model.model)
        inner = self.model.model.forward
        self._inner_cache_kw = "cache" if "cache" in inspect.signature(inner).parameters else "past_key_values"
        self.stats.update({"prefill_batches": 0, "graphs": 0, "capture_s": 0.0, "compiled": 0, "prefill_s": 0.0,
                           "decode_s": 0.0, "steps_ahead": 0, "batched_vision_attention": batch_vision_attention(self.model)})
        self.vision = install(
            self.model, use_graphs=on_gpu if use_graphs is None else use_graphs, max_images=self.max_batch_size)
        self.stats["static_vision"] = int(self.vision is not None)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self.decoder is not None:
            with self.lock:
                if self.lean_prefill:
                    with self.vision.eager() if self.vision is not None else contextlib.nullcontext():
                        self.lean_prefill = self._check_lean_prefill()
                self.stats["lean_prefill"] = int(self.lean_prefill)
                self.stats["host_mrope"] = int(self.mrope is not None and self.mrope.available)
                self._capture()
        super().start()

    def stop(self) -> None:
        super().stop()
        log.info("engine stats at stop: %s", {k: round(v, 2) if isinstance(v, float) else v
                                               for k, v in self.stats.items()})

    def _capture(self) -> None:
        dec = self.decoder
        assert dec is not None
        try:
            n = dec.capture_all()
        except Exception:
            if not dec.compiled:
                raise
            log.exception("compiled decode layers failed; capturing the eager layers instead")
            dec._pre, dec._post = dec._layer_fns()
            dec.compiled = False
            dec.reset_graphs()
            n = dec.capture_all()
        self.stats.update(graphs=n, capture_s=round(dec.capture_s, 2), compiled=int(dec.compiled))
        for r in self._batch.reqs:  # capturing overwrote the device's last sampled tokens
            r.dev_row = None
        if n:
            log.info("captured %d decode graphs in %.1f s (compiled layers: %s)", n, dec.capture_s, dec.compiled)

    @contextmanager
    def exclusive(self, abort_all: bool = False, message: str = "aborted for a weight update") -> Iterator[None]:
        with super().exclusive(abort_all=abort_all, message=message):
            yield
            if self.vision is not None and self.vision.aligned is not None:
                self.vision.aligned.refresh()  # padded copies of the vision MLP weights
            dec = self.decoder
            if dec is not None and dec.weights_moved():
                log.warning("parameters were rebound, not written in place: rebuilding fused weights and graphs")
                dec.refuse()
                dec.reset_graphs()
                if self.vision is not None:
                    self.vision.reset()
                self._capture()

    def _prepare(self, req: Any, on_done: Any, on_token: Any = None) -> EngineRequest:
        t0 = time.perf_counter()
        r = super()._prepare(req, on_done, on_token)
        if self.lean_prefill and self.mrope is not None and self.mrope.available:
            try:
                r.mrope = self.mrope(r.input_ids, r.images)
            except Exception as e:  # the model computes them in the prefill instead
                log.warning("host M-RoPE positions failed (%s: %s); the model computes them", type(e).__name__, e)
                self.mrope.reason = f"{type(e).__name__}: {e}"
        _tally(self.stats, "prepare_ms_by_n", 1, time.perf_counter() - t0)
        return r

    def _lean_forward(self, batch: dict[str, torch.Tensor], slots: list[int],
                      positions: torch.Tensor | None = None) -> Any:
        """The model's own prefill (image features, M-RoPE positions, rope deltas; positions given where
        computed on the host) with the text decoder run by `StaticDecoder.prefill_text` (KV into `slots`)."""
        dec = self.decoder
        assert dec is not None
        lm = dec.lm
        lm.forward = functools.partial(dec.prefill_text, slots)
        if positions is not None:
            batch = {**batch, "position_ids": positions}
        try:
            return self.model.model(**batch, use_cache=False)
        finally:
            del lm.forward

    @torch.inference_mode()
    def _check_lean_prefill(self) -> bool:
        """Does the lean prefill compute transformers' prefill here (this transformers version, this model,
        this dtype)? Measured on a padded batch (an image row and a text row), as distances
        1 - min cosine over all real positions:
        - the first layer's keys and values written into the cache against transformers' cache: one
          layer of rounding apart (< `LEAN_KV0_TOL`); positions, rotary or cache-layout faults show here
          at once (final hidden states of a random-weight model hardly depend on positions);
        - the last hidden states against transformers' forward of each row alone, with transformers' own
          noise as the yardstick (its padded-batch forward against the same rows alone, what batching a
          prefill changes anyway): at most `LEAN_NOISE_FACTOR` times that noise plus `LEAN_ABS_TOL`."""
        from PIL import Image

        ad = self.adapter
        img = Image.new("RGB", (56, 84), (40, 140, 220))
        msgs = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click the blue box."}]}],
                [{"role": "user", "content": [{"type": "text", "text": "A longer text-only prompt, padded less."}]}]]
        try:
            encs = [ad.encode(ad.chat_text(m), [img] if i == 0 else []) for i, m in enumerate(msgs)]
        except (ValueError, TypeError, KeyError) as e:  # no chat template, no image processor: nothing to compare
            log.warning("lean prefill off: its check prompts cannot be built for this model (%s)", e)
            return False
        lens = [len(e.input_ids) for e in encs]
        dec = self.decoder
        assert dec is not None

        def inputs(rows: list[int]) -> dict[str, torch.Tensor]:
            batch = ad.collate([encs[i].input_ids for i in rows], [encs[i].images for i in rows])
            batch = {k: v.to(self.device) for k, v in batch.items()}
            if "pixel_values" in batch:
                batch["pixel_values"] = batch["pixel_values"].to(self.model.dtype)
            return batch

        def dist(a: torch.Tensor, b: torch.Tensor) -> float:
            return 1.0 - float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min())

        try:
            ref, cache = self._hf_forward(inputs([0, 1]))
            alone = [self._hf_forward(inputs([i]))[0][0] for i in range(len(encs))]
            self._reset_rope_deltas()
            pos = None
            if self.mrope is not None and self.mrope.available:  # checked here too: the prefill uses them
                pos = batch_positions([self.mrope(e.input_ids, e.images)[0] for e in encs], max(lens))
                pos = pos.to(self.device)
            got = self._lean_forward(inputs([0, 1]), [0, 1], pos).last_hidden_state
            kv0 = max(max(dist(dec.k[0, i, :, :n], cache.layers[0].keys[i, :, :n]),
                          dist(dec.v[0, i, :, :n], cache.layers[0].values[i, :, :n])) for i, n in enumerate(lens))
        except Exception:
            log.warning("lean prefill failed its check; prefill runs transformers' forward", exc_info=True)
            return False
        noise = max(dist(ref[i, :n], alone[i][:n]) for i, n in enumerate(lens))
        far = max(dist(got[i, :n], alone[i][:n]) for i, n in enumerate(lens))
        tol = LEAN_NOISE_FACTOR * noise + LEAN_ABS_TOL
        self.stats.update(lean_prefill_distance=round(far, 7), lean_prefill_reference_noise=round(noise, 7),
                          lean_prefill_kv0_distance=round(kv0, 7), lean_prefill_min_cosine=round(1.0 - far, 6))
        ok = far <= tol and kv0 <= LEAN_KV0_TOL
        msg = (f"1 - cosine of the last hidden states {far:.2e} (transformers' own batch noise {noise:.2e}, "
               f"tolerance {tol:.2e}); of the first layer's KV {kv0:.2e} (tolerance {LEAN_KV0_TOL:.0e})")
        if ok:
            log.info("lean prefill on: %s", msg)
        else:
            log.warning("lean prefill differs from transformers': %s; prefill runs transformers' forward", msg)
        return ok

    def _reset_rope_deltas(self) -> None:
        if self.family.uses_mrope:
            self.model.model.rope_deltas = None

    def _hf_forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Last hidden states and KV cache of transformers' own prefill forward (a fresh DynamicCache)."""
        from transformers import DynamicCache

        self._reset_rope_deltas()
        cache = DynamicCache()
        out = self.model.model(**batch, **{self._inner_cache_kw: cache}, use_cache=True)
        return out.last_hidden_state, cache

    def _placeholder_ids(self) -> list[int]:
        tok = self.adapter.tokenizer
        ids = [self.adapter.image_token_id]
        for t in ("<|video_pad|>", "<|image_pad|>"):
            tid = tok.convert_tokens_to_ids(t)
            if isinstance(tid, int) and tid != tok.unk_token_id:
                ids.append(tid)
        return [i for i in ids if i is not None]

    # ---- prefill -----------------------------------------------------------------------------------
    def _set_aside(self) -> None:
        """Rows stay in their slots under the static decoder (on a GPU a row adds little to a step)."""
        if self.decoder is None:
            super()._set_aside()

    def _admit(self) -> None:
        if self.decoder is None:
            return super()._admit()
        while True:
            with self._cond:
                free = self.max_batch_size - len(self._batch)
                if free <= 0 or not self._waiting or self._paused:
                    return
                running = len(self._batch.reqs)
                if (running and len(self._waiting) < running
                        and time.perf_counter() - self._prefill_end < self.prefill_duty * self._prefill_last_s):
                    return  # decode first: prefills of groups smaller than the running batch take at most
                    # prefill_duty/(1+prefill_duty) of the engine; a larger group stalls fewer than it adds
                if not self._batch.reqs and self.preparing and len(self._waiting) < free and not self._lock_waiters:
                    age = time.perf_counter() - self._waiting[0].arrival
                    if age < GATHER_S:  # a burst is landing: one prefill for it, not a small one and a big one
                        self._cond.wait(timeout=GATHER_S - age)
                        continue
                group: list[EngineRequest] = []
                longest = 0
                while self._waiting and len(group) < free:
                    n = len(self._waiting[0].input_ids)
                    if group and (len(group) + 1) * max(longest, n) > self.prefill_tokens:
                        break
                    longest = max(longest, n)
                    group.append(self._waiting.pop(0))
            try:
                self._prefill_batch(group)
            except Exception as e:
                self.stats["errors"] += 1
                log.exception("batched prefill of %d requests failed", len(group))
                self._batch.reqs = [r for r in self._batch.reqs if r not in group]
                del self._batch.positions[len(self._batch.reqs):]
                del self._batch.rope_deltas[len(self._batch.reqs):]
                for r in group:
                    if r.finish is None:
                        r.finish = finish_reason("abort", message=f"prefill failed: {type(e).__name__}: {e}")
                        self._deliver(r)

    @torch.inference_mode()
    def _prefill_batch(self, group: list[EngineRequest]) -> None:
        from transformers import DynamicCache

        dec = self.decoder
        assert dec is not None
        self._settle()  # the step in flight is committed first (its rows may finish and be compacted)
        t0 = time.perf_counter()
        batch, uses_mrope = self._prefill_inputs(group)
        t_inputs = time.perf_counter()
        b = self._batch
        first = len(b.reqs)
        slots = list(range(first, first + len(group)))
        cache = None
        pos = None
        if self.lean_prefill and all(r.mrope is not None for r in group):
            pos = batch_positions([r.mrope[0] for r in group], batch["input_ids"].shape[1]).to(self.device)
        if self.lean_prefill:
            out = self._lean_forward(batch, slots, pos)
        else:
            cache = DynamicCache()
            out = self.model.model(**batch, **{self._inner_cache_kw: cache}, use_cache=True)
        lens = torch.tensor([len(r.input_ids) for r in group], device=self.device)
        last = out.last_hidden_state[torch.arange(len(group), device=self.device), lens - 1]
        logits = dec.mask_banned(self.model.lm_head(last).float())
        deltas = [0] * len(group)
        if pos is not None:
            deltas = [r.mrope[1] for r in group]
        elif uses_mrope and self.model.model.rope_deltas is not None:
            deltas = [int(d) for d in self.model.model.rope_deltas.reshape(len(group), -1)[:, 0].tolist()]
        temps = torch.tensor([r.sampling.temperature for r in group], dtype=torch.float32, device=self.device)
        tok, lp = sample_rows(logits, temps, dec.generator)
        t_enqueued = time.perf_counter()
        if cache is not None:
            dec.write_prefill(slots, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])
        b.reqs.extend(group)
        b.positions.extend(len(r.input_ids) for r in group)
        b.rope_deltas.extend(deltas)
        self.stats["prefills"] += len(group)
        self.stats["prefill_batches"] += 1
        self._append_sampled(group, tok, lp, logits)
        self._drop_finished()
        self._prefill_end = time.perf_counter()
        self._prefill_last_s = self._prefill_end - t0
        self.stats["prefill_s"] += self._prefill_last_s
        self.stats["queue_s"] = self.stats.get("queue_s", 0.0) + sum(t0 - r.arrival for r in group)
        _tally(self.stats, "prefill_ms_by_n", len(group), self._prefill_last_s)
        _tally(self.stats, "prefill_inputs_ms_by_n", len(group), t_inputs - t0)
        _tally(self.stats, "prefill_enqueue_ms_by_n", len(group), t_enqueued - t_inputs)
        _tally(self.stats, "arrival_spread_ms_by_n", len(group), max(r.arrival for r in group) - min(r.arrival for r in group))
        if self.vision is not None:
            self.stats.update(self.vision.stats)

    # ---- decode ------------------------------------------------------------------------------------
    def _settled(self) -> bool:
        return self.pipe is None or not self.pipe.pending

    def _settle(self) -> None:
        """Commit every launched step (the loop leaves one in flight between its iterations)."""
        if self.pipe is not None:
            while self.pipe.pending:
                self._commit(*self.pipe.pop())

    def _decode_step(self) -> None:
        if self.decoder is None:
            return super()._decode_step()
        pipe = self.pipe
        assert pipe is not None
        t0 = time.perf_counter()
        try:
            if pipe.pending and any(self._needs_cpu(r) for r in self._batch.reqs):
                self._settle()  # the host samples this step's token of some row: it needs the last one
            b = self._batch
            launched = None
            if any(len(r.output_ids) + r.in_flight < r.max_new_tokens for r in b.reqs):
                self.stats["steps_ahead"] += bool(pipe.pending)
                launched = pipe.launch(b.reqs, list(b.positions),
                                       [p + d for p, d in zip(b.positions, b.rope_deltas, strict=True)],
                                       [self._needs_cpu(r) for r in b.reqs], self.weight_version)
                b.positions = [p + 1 for p in b.positions]
                self.stats["steps"] += 1
            keep = 1 if launched is not None and not any(launched.cpu) else 0
            while len(pipe.pending) > keep:
                self._commit(*pipe.pop())
        except Exception:
            pipe.forget()
            raise
        dt = time.perf_counter() - t0
        self.stats["decode_s"] += dt
        self.stats["host_wait_s"] = round(pipe.wait_s, 3)
        _tally(self.stats, "decode_ms_by_n", len(launched.reqs) if launched else 0, dt)

    def _commit(self, rec: StepRecord, toks: list[int], lps: list[float]) -> None:
        """Record a read step's tokens (dropping those of requests that had already finished)."""
        live = [i for i, r in enumerate(rec.reqs) if r.finish is None]
        self._record([rec.reqs[i] for i in live], [toks[i] for i in live], [lps[i] for i in live],
                     rec.logits[live] if any(rec.cpu) else None, [rec.cpu[i] for i in live], rec.version)
        self._drop_finished()

    def _needs_cpu(self, r: EngineRequest) -> bool:
        """Whether the next token launched for r is sampled by the host (filters, or an EOS ban)."""
        sp = r.sampling
        filtered = sp.temperature > 0 and (0 < sp.top_k < self.vocab_size or sp.top_p < 1.0 or sp.min_p > 0)
        banned = (len(r.output_ids) + r.in_flight < sp.min_new_tokens
                  and (not sp.ignore_eos or bool(sp.stop_token_ids)))
        return filtered or banned

    def _append_sampled(self, reqs: list[EngineRequest], tok: torch.Tensor, lp: torch.Tensor,
                        logits: torch.Tensor) -> None:
        """Record one sampled token per request of a prefill (device tensors, read here)."""
        n = len(reqs)
        host = torch.stack([tok[:n].double(), lp[:n].double()]).cpu()
        cpu = [self._needs_cpu(r) for r in reqs]
        self._record(reqs, host[0].long().tolist(), host[1].tolist(), logits, cpu, self.weight_version)

    def _record(self, reqs: list[EngineRequest], toks: list[int], lps: list[float], logits: torch.Tensor | None,
                cpu: list[bool], version: str) -> None:
        """Append one token per request (the host's sampler where cpu[i], from logits row i)."""
        for i, r in enumerate(reqs):
            if cpu[i]:
                assert logits is not None
                row = logits[i].float().cpu()
                t = r.sampling.temperature if r.sampling.temperature > 0 else 1.0
                toks[i] = self._sample(row, r)
                lps[i] = float(torch.log_softmax(row / t, dim=-1)[toks[i]])
                r.dev_row = None  # the device holds another token for this row
            r.output_ids.append(toks[i])
            r.logprobs.append(lps[i])
            r.versions.append(version)
            self.stats["generated_tokens"] += 1
            self._check_finish(r)
            if r.on_token is not None:
                r.on_token(r)
            if r.finish is not None:
                self._deliver(r)

    def _drop_finished(self) -> None:
        """Keep live rows in slots [0, n): each hole is filled by a live row from past n."""
        if self.decoder is None:
            return super()._drop_finished()
        b = self._batch
        live = [r.finish is None for r in b.reqs]
        n = sum(live)
        if n == len(b.reqs):
            return
        if n == 0:
            self._batch = _RunningBatch()
            return
        holes = [i for i in range(n) if not live[i]]
        movers = [i for i in range(n, len(b.reqs)) if live[i]]
        for h, m in zip(holes, movers, strict=True):
            self.decoder.move(m, h, b.positions[m])
            b.reqs[h], b.positions[h], b.rope_deltas[h] = b.reqs[m], b.positions[m], b.rope_deltas[m]
        del b.reqs[n:], b.positions[n:], b.rope_deltas[n:]


def _tally(stats: dict[str, Any], key: str, n: int, seconds: float) -> None:
    """stats[key][bucket] = [count, total ms] with bucket the power of two >= n (as a string: JSON keys).
    New objects each time: a reader copying stats in another thread never sees one change under it."""
    table = dict(stats.get(key, {}))
    bucket = str(1 << max(n - 1, 0).bit_length())
    count, ms = table.get(bucket, (0, 0.0))
    table[bucket] = [count + 1, round(ms + seconds * 1e3, 1)]
    stats[key] = table


def make_engine(model_path: str, *, device: str = "cpu", **kw: Any) -> HFEngine:
    """The engine for a server: GraphEngine on CUDA (or when $ASYNCWEBRL_ENGINE=graph), else HFEngine."""
    choice = os.environ.get("ASYNCWEBRL_ENGINE", "auto")
    if choice not in ("auto", "plain", "graph"):
        raise ValueError(f"ASYNCWEBRL_ENGINE must be auto, plain or graph, not {choice!r}")
    if choice == "graph" or (choice == "auto" and device.startswith("cuda")):
        return GraphEngine(model_path, device=device, **kw)
    return HFEngine(model_path, device=device, **kw)
