"""The embedded `hf` inference engine: continuous batching of /generate requests over a transformers VLM.

A background thread owns the model. Each iteration it prefills newly admitted requests one by one
(no padding, so the prompt forward is exactly a teacher-forced forward) and merges their KV caches
into the running batch (left-padded to a common length, masked), then decodes every running
sequence together, one token per step. Finished sequences leave the batch at once and waiting
requests take their places: continuous batching.

Invariants:
- every generated token carries the logprob of the temperature-scaled logits (log_softmax(logits / T),
  before top-k/top-p/min-p; raw logits when T is 0 or 1), as SGLang reports it, so the trainer, which
  scales its logits by the same T, computes the same quantity; and the weight version current at the
  step that produced it;
- all model access (forward, weight writes) happens under `self.lock`; `pause()` returns only after
  the step in progress has finished, so a weight update never races a forward pass;
- `prepare` runs in the caller's thread (the server's HTTP threads); with `image_workers` the images of
  an input_ids request are decoded and processed in worker processes (inference/image_pool.py, same
  values and refusals), off the GIL;
- a paused engine keeps its queued and running requests; they continue after `resume()` (on the new
  weights, with their old KV cache), unless aborted, in which case they end with finish_reason abort;
- light clients go first (`light_client_prompts`): a client with at most that many requests in the
  engine is light; while a light client has requests in it, the running rows of heavier clients are
  set aside with their KV cache (not decoded, nothing recomputed) and only light clients' requests
  are admitted; the rows rejoin the batch once no light client has had a request there for
  `LIGHT_GRACE_S`. On a CPU every row adds to
  each step's time, so one client's big batch would otherwise slow every small request by its size.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncwebrl.models.vlm import VLMAdapter, decode_image, load_model
from asyncwebrl.protocol import GenerateRequest, ProtocolError, SamplingParams, finish_reason

log = logging.getLogger(__name__)

LIGHT_GRACE_S = 0.5
"""set-aside rows rejoin the batch once no light client has had a request in the engine for this long:
a light client's next request (an episode's next step) then finds no heavy step in progress"""

IMAGE_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("image_memo", default=None)
"""Set by the server around the prepare of one request: prompts of that request with the same images
and the same image-token count share one decoded and processed copy (a shared image decoded once)."""


@dataclass
class RequestLimits:
    """What one request may cost, checked in `HFEngine.prepare` before the expensive step it guards."""

    max_images_per_prompt: int = 16
    """images per prompt (checked before any image is decoded)"""
    max_image_pixels: int = 4096 * 4096
    """width * height of one image, read from its header before decoding (a small PNG can inflate to GBs)"""
    max_prompt_chars: int = 0
    """characters of a text prompt, checked before tokenizing (0 = 16 x the context length)"""
    allow_auto_truncate: bool = False
    """SGLang's --allow-auto-truncate: clamp max_new_tokens to the room left in the context instead of
    refusing a prompt + max_new_tokens that does not fit"""


@dataclass
class EngineResult:
    """The outcome of one request (what /generate turns into its JSON answer)."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    finish_reason: dict[str, Any]
    weight_version: str
    latency_s: float
    text: str = ""


@dataclass
class EngineRequest:
    """A request inside the engine: validated inputs plus generation state."""

    rid: str
    input_ids: list[int]
    images: dict[str, torch.Tensor]
    sampling: SamplingParams
    max_new_tokens: int
    on_done: Callable[[EngineResult], None]
    on_token: Callable[[EngineRequest], None] | None = None
    client: str = ""
    """who sent it (the server's client key): the engine shares its rows between clients"""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    stop_cut: int | None = None
    """character offset where a matched stop string begins in the decoded text"""
    dev_row: int | None = None
    """GraphEngine: the row of the device's last sampled tokens that holds this request's newest token
    (None: the host's output_ids[-1] is the next input); see inference/decode_pipeline.py"""
    in_flight: int = 0
    """GraphEngine: decode steps launched for this request whose tokens the host has not read yet"""
    mrope: tuple[torch.Tensor, int] | None = None
    """GraphEngine: the prompt's M-RoPE position ids [3, L] and rope delta, computed on the host
    (models/mrope.py); None: the model computes them in the prefill"""


class _RunningBatch:
    """KV cache and positions of the sequences decoded together (row i <-> reqs[i])."""

    def __init__(self) -> None:
        self.reqs: list[EngineRequest] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real key, 0 = left pad
        self.positions: list[int] = []  # next position id (the sequence's true length)
        self.rope_deltas: list[int] = []  # Qwen M-RoPE offset per sequence

    def __len__(self) -> int:
        return len(self.reqs)


class HFEngine:
    """A transformers model behind a continuous-batching scheduler (see module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        max_context_len: int = 4096,
        seed: int = 0,
        weight_version: str = "0",
        cpu_threads: int | None = None,
        image_workers: int = 0,
    ):
        if cpu_threads:
            # process-wide: torch's intra-op pool. On a CPU shared with other processes, more threads
            # than free cores make every step wait on descheduled threads (measured 30x slower)
            torch.set_num_threads(cpu_threads)
        self.adapter = VLMAdapter(model_path)
        self.model_path = self.adapter.path
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = load_model(self.model_path, dtype, device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        text_cfg = self.model.config.get_text_config()
        self.vocab_size = int(text_cfg.vocab_size)
        self.context_len = min(max_context_len, int(getattr(text_cfg, "max_position_embeddings", max_context_len)))
        self.limits = RequestLimits()
        self.max_batch_size = max_batch_size
        self.light_client_prompts = 0
        """a client with at most this many requests in the engine goes before heavier ones (0 = off)"""
        self._light_seen = 0.0
        """when a light client last had a request in the engine while a heavy one waited"""
        self.family = self.adapter.model_family
        self.eos_ids = set(self.adapter.eos_token_ids)
        self.weight_version = str(weight_version)
        self.generator = torch.Generator().manual_seed(seed)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

        self.lock = threading.RLock()
        self._cond = threading.Condition()
        self._waiting: list[EngineRequest] = []
        self._batch = _RunningBatch()
        self._aside = _RunningBatch()
        """rows set aside while clients share the engine (KV kept, not decoded)"""
        self._paused = False
        self._stopped = False
        # callers waiting for the model lock (abort, weight access); the loop stands aside for them,
        # because a plain lock lets the loop re-take it step after step and starve them
        self._lock_waiters = 0
        self.preparing = 0
        """requests inside prepare() now (HTTP threads)"""
        self._thread: threading.Thread | None = None
        self.stats = {"steps": 0, "prefills": 0, "generated_tokens": 0, "finished": 0, "aborted": 0, "errors": 0,
                      "malloc_trims": 0, "set_aside": 0}
        self._malloc_trim = _libc_malloc_trim() if self.device.type == "cpu" else None
        self._last_trim = time.monotonic()
        self.image_pool = None
        if image_workers and self.family.takes_images:
            from asyncwebrl.inference.image_pool import ImagePool

            self.image_pool = ImagePool(self.model_path, image_workers)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self.image_pool is not None:
            self.image_pool.warm()
        self._thread = threading.Thread(target=self._loop, name="hf-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.abort(abort_all=True, message="server shutting down")
        if self.image_pool is not None:
            self.image_pool.close()

    # ---- requests ----------------------------------------------------------------------------------
    def prepare(self, req: GenerateRequest, on_done: Callable[[EngineResult], None],
                on_token: Callable[[EngineRequest], None] | None = None) -> EngineRequest:
        """`_prepare`, counted in `preparing` while it runs (a scheduler may wait for a burst to land)."""
        with self._cond:
            self.preparing += 1
        try:
            return self._prepare(req, on_done, on_token)
        finally:
            with self._cond:
                self.preparing -= 1
                self._cond.notify_all()

    def _prepare(self, req: GenerateRequest, on_done: Callable[[EngineResult], None],
                 on_token: Callable[[EngineRequest], None] | None = None) -> EngineRequest:
        """Check limits, decode images, tokenize (one prompt: see GenerateRequest.split); ProtocolError on
        anything the model cannot take. Each limit is checked before the work it bounds."""
        if req.is_batch:
            raise ProtocolError("the engine takes one prompt at a time (GenerateRequest.split)")
        req = req.split()[0]  # normalized: image_data a list, sampling_params set
        lim = self.limits
        raw_images = list(req.image_data or [])
        if len(raw_images) > lim.max_images_per_prompt:
            raise ProtocolError(f"{len(raw_images)} images in one prompt; the limit is {lim.max_images_per_prompt}")
        if req.input_ids is not None and len(req.input_ids) >= self.context_len:
            raise ProtocolError(f"the input ({len(req.input_ids)} tokens) is longer than the model's context "
                                f"length ({self.context_len} tokens)")
        max_chars = lim.max_prompt_chars or 16 * self.context_len
        if req.text is not None and len(req.text) > max_chars:
            raise ProtocolError(f"prompt text of {len(req.text)} characters exceeds the limit of {max_chars} "
                                f"(context length {self.context_len} tokens)")
        images, blobs = [], []
        in_pool = self.image_pool is not None and req.text is None  # decoded and processed in a worker
        memo, memo_key, cached = IMAGE_MEMO.get(), None, None
        if memo is not None and raw_images and req.input_ids is not None:
            memo_key = (tuple(raw_images), sum(1 for t in req.input_ids if t == self.adapter.image_token_id))
            cached = memo.get(memo_key)
        for i, im in enumerate(raw_images if cached is None else []):
            try:
                data = image_bytes(im)
                w, h = image_size(data)
                if w * h > lim.max_image_pixels:
                    raise ProtocolError(f"image_data[{i}]: {w}x{h} pixels exceeds the limit of "
                                        f"{lim.max_image_pixels} pixels")
                if in_pool:
                    blobs.append(data)
                else:
                    images.append(decode_image(data))
            except ValueError as e:
                if isinstance(e, ProtocolError):
                    raise
                raise ProtocolError(f"image_data[{i}]: {e}") from None
        try:
            if req.text is not None:
                enc = self.adapter.encode(req.text, images)
                ids, img = enc.input_ids, enc.images
            else:
                ids = list(req.input_ids or [])
                bad = [t for t in ids if t >= self.vocab_size]
                if bad:
                    raise ProtocolError(f"input_ids hold token id {bad[0]} >= vocab size {self.vocab_size}")
                if cached is not None:
                    img = cached
                elif in_pool and blobs:
                    img = self.image_pool.images_for_ids(ids, blobs)
                else:
                    img = self.adapter.encode_with_images_for_ids(ids, images)
                if memo_key is not None:
                    memo[memo_key] = img
        except ProtocolError:
            raise
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        if len(ids) >= self.context_len:
            raise ProtocolError(f"the input ({len(ids)} tokens) is longer than the model's context length "
                                f"({self.context_len} tokens)")
        want = req.sampling_params.max_new_tokens
        if len(ids) + want > self.context_len and not lim.allow_auto_truncate:
            raise ProtocolError(
                f"requested token count exceeds the model's context length of {self.context_len} tokens: "
                f"{len(ids)} prompt tokens + {want} max_new_tokens (shorten either, or start the server with "
                f"--allow-auto-truncate)")
        max_new = min(want, self.context_len - len(ids))
        return EngineRequest(
            rid=req.rid or uuid.uuid4().hex,
            input_ids=ids,
            images=img,
            sampling=req.sampling_params,
            max_new_tokens=max_new,
            on_done=on_done,
            on_token=on_token,
        )

    def submit(self, r: EngineRequest) -> None:
        if r.max_new_tokens <= 0:
            r.finish = finish_reason("length", length=0)
            self._deliver(r)
            return
        with self._cond:
            self._waiting.append(r)
            self._cond.notify_all()

    def pause(self) -> None:
        """Stop scheduling; returns once the step in progress (if any) has finished."""
        with self._cond:
            self._paused = True
        with self.lock:
            self._settle()

    def try_pause(self) -> bool:
        """`pause` without waiting: True once paused with no step in progress or in flight (the caller
        may hold the model at once, e.g. on an event loop); False when one is (then call `pause`)."""
        with self._cond:
            self._paused = True
        return self.idle()

    def idle(self) -> bool:
        """Paused, the model lock free and nothing launched in flight: holding the model waits for nothing."""
        if not self._paused or not self.lock.acquire(blocking=False):
            return False
        try:
            return self._settled()
        finally:
            self.lock.release()

    def _settled(self) -> bool:
        """Nothing launched is left for `_settle` to finish."""
        return True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @contextmanager
    def _model_lock(self) -> Iterator[None]:
        """The model lock, taken between two scheduler steps without waiting behind many of them."""
        with self._cond:
            self._lock_waiters += 1
        try:
            with self.lock:
                self._settle()
                yield
        finally:
            with self._cond:
                self._lock_waiters -= 1
                self._cond.notify_all()

    def _settle(self) -> None:
        """Called with the model lock held by anyone but the engine loop, before they use the model:
        finish work the loop left in flight (nothing here; GraphEngine reads its launched step)."""

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """End matching queued/running requests with finish_reason abort; returns how many."""
        with self._model_lock(), self._cond:
            hit = [r for r in self._waiting + self._batch.reqs + self._aside.reqs if abort_all or r.rid == rid]
            for r in hit:
                r.finish = finish_reason("abort", message=message)
            self._waiting = [r for r in self._waiting if r.finish is None]
            self._drop_finished()
            self._aside = self._select(self._aside, [i for i, r in enumerate(self._aside.reqs) if r.finish is None])
        for r in hit:
            self.stats["aborted"] += 1
            self._deliver(r)
        return len(hit)

    @contextmanager
    def exclusive(self, abort_all: bool = False, message: str = "aborted for a weight update") -> Iterator[None]:
        """Hold the model with generation paused (weight writes); the prior pause state is restored."""
        was_paused = self._paused
        self.pause()
        try:
            if abort_all:
                self.abort(abort_all=True, message=message)
            with self._model_lock():
                yield
        finally:
            if not was_paused:
                self.resume()

    def load_info(self) -> dict[str, int]:
        running = sum(1 for r in self._batch.reqs + self._aside.reqs if r.finish is None)
        return {"running": running, "waiting": len(self._waiting), "set_aside": len(self._aside)}

    # ---- the scheduler loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stopped and (self._paused or self._lock_waiters or self._idle()):
                    self._cond.wait(timeout=LIGHT_GRACE_S / 2 if self._aside.reqs else 1.0)
                if self._stopped:
                    return
            with self.lock:
                if self._paused:
                    continue
                try:
                    self._share_rows()
                    self._admit()
                    if self._batch.reqs:
                        self._decode_step()
                except Exception as e:  # a failed forward must not kill the server: fail the batch
                    self.stats["errors"] += 1
                    log.exception("engine step failed")
                    failed = list(self._batch.reqs)
                    self._batch = _RunningBatch()
                    for r in failed:
                        r.finish = finish_reason("abort", message=f"engine error: {type(e).__name__}: {e}")
                        self._deliver(r)
                self._maybe_trim()

    def _idle(self) -> bool:
        """Nothing to do now (call with `_cond` held): set-aside rows alone wait out `LIGHT_GRACE_S`."""
        if self._waiting or self._batch.reqs:
            return False
        return not self._aside.reqs or time.monotonic() - self._light_seen <= LIGHT_GRACE_S

    def _maybe_trim(self) -> None:
        """Hand freed heap back to the OS: KV caches of changing shapes leave glibc arenas holding
        hundreds of MB that RSS/PSS keep counting (a soak sees a sawtooth, not a leak). Cheap (ms),
        so done whenever the batch drains, and every 30 s under constant load. CPU servers only."""
        if self._malloc_trim is None:
            return
        now = time.monotonic()
        if now - self._last_trim < (5.0 if not self._batch.reqs else 30.0):
            return
        self._last_trim = now
        self._malloc_trim(0)
        self.stats["malloc_trims"] += 1

    def _heavy_clients(self) -> set[str]:
        """Clients whose rows wait while a light client has requests in the engine: empty when there
        is no light client or no heavy one (call with `_cond` held)."""
        held = collections.Counter(r.client for r in self._batch.reqs)
        held.update(r.client for r in self._aside.reqs)
        held.update(r.client for r in self._waiting)
        heavy = {c for c, n in held.items() if n > self.light_client_prompts}
        return heavy if len(heavy) < len(held) else set()

    def _share_rows(self) -> None:
        """Set aside the running rows of heavy clients while a light client has requests (KV kept);
        let them rejoin the batch once none has."""
        if not self.light_client_prompts or not (self._batch.reqs or self._aside.reqs):
            return
        with self._cond:
            heavy = self._heavy_clients()
        now = time.monotonic()
        if heavy:
            self._light_seen = now
            b = self._batch
            over = [i for i, r in enumerate(b.reqs) if r.client in heavy and r.finish is None]
            if over:
                self._aside = self._concat(self._aside, self._select(b, over))
                self._batch = self._select(b, [i for i in range(len(b)) if i not in set(over)])
                self.stats["set_aside"] += len(over)
        elif self._aside.reqs and len(self._batch) < self.max_batch_size and now - self._light_seen > LIGHT_GRACE_S:
            n = min(len(self._aside), self.max_batch_size - len(self._batch))
            a = self._aside
            self._batch = self._concat(self._batch, self._select(a, list(range(n))))
            self._aside = self._select(a, list(range(n, len(a))))

    def _select(self, b: _RunningBatch, rows: list[int]) -> _RunningBatch:
        """A new batch of rows `rows` of `b` (their KV copied out), all-pad leading columns trimmed."""
        out = _RunningBatch()
        if not rows:
            return out
        if len(rows) == len(b.reqs):
            return b
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = b.mask.index_select(0, idx)
        first = int((mask.sum(0) > 0).nonzero()[0])
        out.cache = copy.copy(b.cache)
        out.cache.layers = [copy.copy(layer) for layer in b.cache.layers]
        for layer in out.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
            layer.values = layer.values.index_select(0, idx)[:, :, first:]
        out.mask = mask[:, first:]
        out.reqs = [b.reqs[i] for i in rows]
        out.positions = [b.positions[i] for i in rows]
        out.rope_deltas = [b.rope_deltas[i] for i in rows]
        return out

    @staticmethod
    def _concat(a: _RunningBatch, b: _RunningBatch) -> _RunningBatch:
        """`a` with the rows of `b` appended (both left-padded to a common length)."""
        if not a.reqs:
            return b
        if not b.reqs:
            return a
        t = max(a.mask.shape[1], b.mask.shape[1])
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            la.keys = torch.cat([_left_pad(la.keys, t), _left_pad(lb.keys, t)], dim=0)
            la.values = torch.cat([_left_pad(la.values, t), _left_pad(lb.values, t)], dim=0)
        a.mask = torch.cat([_left_pad(a.mask, t), _left_pad(b.mask, t)], dim=0)
        a.reqs += b.reqs
        a.positions += b.positions
        a.rope_deltas += b.rope_deltas
        return a

    def _next_waiting(self) -> EngineRequest | None:
        """The waiting request to admit next (call with `_cond` held): the oldest, or, while a light
        client has requests in the engine (`light_client_prompts`), the oldest of a light client."""
        heavy = self._heavy_clients() if self.light_client_prompts else set()
        i = next((i for i, r in enumerate(self._waiting) if r.client not in heavy), None)
        return None if i is None else self._waiting.pop(i)

    def _admit(self) -> None:
        while len(self._batch) < self.max_batch_size:
            with self._cond:
                if not self._waiting or self._paused:
                    return
                r = self._next_waiting()
                if r is None:
                    return
            try:
                self._prefill(r)
            except Exception as e:
                self.stats["errors"] += 1
                log.exception("prefill failed for %s", r.rid)
                r.finish = finish_reason("abort", message=f"prefill failed: {type(e).__name__}: {e}")
                self._deliver(r)

    def _forward(self, **kw: Any) -> torch.Tensor:
        cache = kw.pop("cache")
        out = self.model(**kw, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _prefill_inputs(self, reqs: list[EngineRequest]) -> tuple[dict[str, Any], bool]:
        """The model inputs of a prefill of `reqs` on this engine's device (pixels in the model's dtype),
        and whether the model uses M-RoPE (its cached rope deltas are reset for the new batch)."""
        batch = self.adapter.collate([r.input_ids for r in reqs], [r.images for r in reqs])
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if "pixel_values" in batch:
            batch["pixel_values"] = batch["pixel_values"].to(self.model.dtype)
        uses_mrope = self.family.uses_mrope
        if uses_mrope:
            self.model.model.rope_deltas = None
        return batch, uses_mrope

    def _prefill(self, r: EngineRequest) -> None:
        from transformers import DynamicCache

        batch, uses_mrope = self._prefill_inputs([r])
        cache = DynamicCache()
        logits = self._forward(**batch, cache=cache)
        delta = 0
        if uses_mrope and self.model.model.rope_deltas is not None:
            delta = int(self.model.model.rope_deltas.reshape(-1)[0])
        self.stats["prefills"] += 1
        if not self._append_tokens([r], logits):
            self._merge(r, cache, len(r.input_ids), delta)

    def _merge(self, r: EngineRequest, cache: Any, length: int, delta: int) -> None:
        b = self._batch
        if not b.reqs:
            b.reqs, b.cache, b.positions, b.rope_deltas = [r], cache, [length], [delta]
            b.mask = torch.ones((1, length), dtype=torch.long, device=self.device)
            return
        t_old = b.mask.shape[1]
        t = max(t_old, length)
        for old, new in zip(b.cache.layers, cache.layers, strict=False):
            old.keys = torch.cat([_left_pad(old.keys, t), _left_pad(new.keys, t)], dim=0)
            old.values = torch.cat([_left_pad(old.values, t), _left_pad(new.values, t)], dim=0)
        new_mask = torch.zeros((1, t), dtype=torch.long, device=self.device)
        new_mask[0, t - length:] = 1
        b.mask = torch.cat([_left_pad(b.mask, t), new_mask], dim=0)
        b.reqs.append(r)
        b.positions.append(length)
        b.rope_deltas.append(delta)

    def _decode_step(self) -> None:
        b = self._batch
        ids = torch.tensor([[r.output_ids[-1]] for r in b.reqs], dtype=torch.long, device=self.device)
        mask = torch.cat([b.mask, torch.ones((len(b), 1), dtype=torch.long, device=self.device)], dim=1)
        pos = torch.tensor(b.positions, dtype=torch.long, device=self.device)[:, None]
        position_ids = self.family.decode_position_ids(pos, b.rope_deltas)
        logits = self._forward(input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=b.cache)
        b.mask = mask
        b.positions = [p + 1 for p in b.positions]
        self.stats["steps"] += 1
        self._append_tokens(b.reqs, logits)
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Remove finished rows from the running batch and trim all-pad leading columns."""
        b = self._batch
        keep = [i for i, r in enumerate(b.reqs) if r.finish is None]
        if len(keep) == len(b.reqs):
            return
        self._batch = self._select(b, keep)

    # ---- sampling and stop conditions ------------------------------------------------------------
    def _append_tokens(self, reqs: list[EngineRequest], logits: torch.Tensor) -> bool:
        """Sample one token per row, record logprob + version, deliver finished requests.
        Returns whether the (single) request of a prefill already finished."""
        # sampling runs on the CPU: one transfer per step instead of a device sync per row
        logits = logits.float().cpu()
        temps = torch.tensor([r.sampling.temperature if r.sampling.temperature > 0 else 1.0 for r in reqs])
        logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
        any_done = False
        for i, r in enumerate(reqs):
            try:
                if torch.isnan(logits[i]).any() or not torch.isfinite(logits[i]).any():
                    raise FloatingPointError("the model produced non-finite logits")
                tok = self._sample(logits[i], r)
            except (FloatingPointError, RuntimeError) as e:  # this row alone ends; the batch goes on
                self.stats["errors"] += 1
                r.finish = finish_reason("abort", message=f"sampling failed: {type(e).__name__}: {e}")
                any_done = True
                self._deliver(r)
                continue
            r.output_ids.append(tok)
            r.logprobs.append(float(logprobs[i, tok]))
            r.versions.append(self.weight_version)
            self.stats["generated_tokens"] += 1
            self._check_finish(r)
            if r.on_token is not None:
                r.on_token(r)
            if r.finish is not None:
                any_done = True
                self._deliver(r)
        return any_done

    def _sample(self, row: torch.Tensor, r: EngineRequest) -> int:
        sp = r.sampling
        if len(r.output_ids) < sp.min_new_tokens:
            row = row.clone()
            banned = list((set() if sp.ignore_eos else self.eos_ids) | set(sp.stop_token_ids or []))
            row[[t for t in banned if t < row.shape[0]]] = float("-inf")
        if sp.temperature == 0:
            return int(torch.argmax(row))
        row = row / sp.temperature
        if 0 < sp.top_k < row.shape[0]:
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if sp.min_p > 0:
            probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
        if sp.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=0)
            drop = (cum - sorted_p) > sp.top_p  # keep the smallest prefix reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _check_finish(self, r: EngineRequest) -> None:
        sp = r.sampling
        tok, n = r.output_ids[-1], len(r.output_ids)
        if n >= sp.min_new_tokens:
            if not sp.ignore_eos and tok in self.eos_ids:
                r.finish = finish_reason("stop", matched=tok)
                return
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                r.finish = finish_reason("stop", matched=tok)
                return
            if sp.stop_strings:
                text = self.adapter.tokenizer.decode(r.output_ids, skip_special_tokens=sp.skip_special_tokens)
                hits = [(text.find(s), s) for s in sp.stop_strings if s in text]
                if hits:
                    pos, s = min(hits)
                    r.stop_cut = None if sp.no_stop_trim else pos
                    r.finish = finish_reason("stop", matched=s)
                    return
        if n >= r.max_new_tokens:
            r.finish = finish_reason("length", length=n)

    def _deliver(self, r: EngineRequest) -> None:
        text = self.adapter.tokenizer.decode(r.output_ids, skip_special_tokens=r.sampling.skip_special_tokens)
        if r.stop_cut is not None:
            text = text[: r.stop_cut]
        self.stats["finished"] += 1
        res = EngineResult(
            rid=r.rid,
            prompt_tokens=len(r.input_ids),
            output_ids=list(r.output_ids),
            logprobs=list(r.logprobs),
            versions=list(r.versions),
            finish_reason=r.finish or finish_reason("abort", message="unknown"),
            weight_version=self.weight_version,
            latency_s=time.perf_counter() - r.arrival,
            text=text,
        )
        try:
            r.on_done(res)
        except Exception:
            log.exception("on_done callback of %s failed", r.rid)

    # ---- weights -------------------------------------------------------------------------------------
    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    def weights_checksum(self) -> str:
        with self._model_lock():
            return params_checksum(self.model.named_parameters())


def image_bytes(data: str) -> bytes:
    """The raw bytes of a base64 / data-URI image string; ValueError when it is not base64."""
    import base64
    import binascii

    if data.startswith("data:"):
        data = data.split(",", 1)[-1]
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"not base64 ({e})") from None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image's header, without decoding its pixels; ValueError if unreadable."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:  # lazy: reads the header only
            return im.size
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ValueError(f"undecodable image ({type(e).__name__}: {e})") from None
    except Image.DecompressionBombError as e:
        raise ValueError(str(e)) from None


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def params_checksum(named_params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, raw bytes) of every parameter in order: equal digests = bit-identical weights.
    The trainer computes it on its own model to check what a server serves (GET /weights_checksum)."""
    import hashlib

    h = hashlib.sha256()
    for name, p in named_params:
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _left_pad(x: torch.Tensor, t: int) -> torch.Tensor:
    """Left-pad the sequence axis (-2 for KV [B,H,T,D], -1 for masks [B,T]) with zeros to length t."""
    axis = -1 if x.dim() == 2 else -2
    missing = t - x.shape[axis]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[axis] = missing
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim=axis)
