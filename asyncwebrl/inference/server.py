"""The embedded `hf` inference server: SGLang's native HTTP API (SPEC section 3) over `HFEngine`.

`asyncwebrl serve --backend hf --model PATH --host 127.0.0.1 --port N` runs it; tests and other
components start it with `scheduling.servers.launch_server(...)`, or in-process with
`launch_in_thread(...)`.

Invariants (see `asyncwebrl.httpguard` for the gate every request passes first):
- binds 127.0.0.1 unless told otherwise; refuses requests from web browsers (Origin / Sec-Fetch-*),
  a Host that is not one it serves, non-JSON bodies, and bodies over the limit (from Content-Length,
  before reading);
- the server always has a key: the control endpoints (`protocol.CONTROL_ENDPOINTS`: weights, groups,
  pause/continue, version, flush, abort) need `Authorization: Bearer KEY`; with `key_scope="all"` every
  endpoint but /health does. Launchers hand the key over in $ASYNCWEBRL_API_KEY or a 0600 file; a
  server started by hand without one makes its own and writes it to a 0600 file it names;
- `update_weights_from_disk` loads only from folders under its weight roots; `init_weights_update_group`
  dials only its configured trainer addresses (loopback by default);
- a malformed request gets HTTP 400 `{"error": {"message"}, "success": false, "message"}` (SGLang's
  shape plus ours) and the server keeps serving; bodies are parsed off the event loop, so /health
  answers while a large request is being read or parsed;
- weight operations are serialized with each other and run with generation paused
  (engine.exclusive), never concurrently with a forward pass;
- /generate passes the cost model (inference/admission.py) before any image is decoded; its prompts
  are prepared on the server's own preparation threads, one prompt of a client at a time, round-robin
  over clients, and reach the engine round-robin over clients;
- an abort of all requests (pause in abort mode, abort_all, a version or weight update that aborts)
  also ends the requests still being prepared or queued: each of their prompts answers with
  finish_reason abort. A pause in place holds them; they run after /continue_generation.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from asyncwebrl import httpguard, net
from asyncwebrl.inference.admission import (
    COST_ENV,
    CostLimits,
    FairQueue,
    MemoryBudget,
    Refused,
    assess,
    image_token_counter,
)
from asyncwebrl.inference.engine import (
    IMAGE_MEMO,
    EngineRequest,
    EngineResult,
    HFEngine,
    RequestLimits,
    image_bytes,
    image_size,
)
from asyncwebrl.inference.policy import ServerPolicy, policy_from_args
from asyncwebrl.loop_thread import LoopThread
from asyncwebrl.net import free_port
from asyncwebrl.protocol import (
    IGNORED_FIELDS,
    REQUEST_TYPES,
    GenerateRequest,
    ProtocolError,
    TensorUpdateReply,
    error,
    finish_reason,
    ok,
    parse_generate_bounded,
    parse_json,
)
from asyncwebrl.weights.disk import load_folder
from asyncwebrl.weights.group import WeightSyncError
from asyncwebrl.weights.receiver import AnnouncementRejected, WeightReceiver
from asyncwebrl.weights.sender import EXTENSION_BUCKET_SIZES

log = logging.getLogger(__name__)
PARSE_INLINE_BYTES = 256 * 1024
"""bodies above this are parsed off the event loop (/generate: in a worker process)"""


class PreparationAborted(Exception):
    """The prompts of a request were still being prepared when all requests were aborted."""


@dataclass(eq=False)
class _PrepJob:
    """One prompt's preparation, waiting for a preparation thread."""

    client: str
    run: Callable[[], EngineRequest]
    done: asyncio.Future

class InferenceServer:
    """HTTP front of one engine (one server per device, tp=1)."""

    def __init__(self, engine: HFEngine, *, policy: ServerPolicy | None = None, weight_sync_timeout_s: float = 120.0,
                 server_args: dict[str, Any] | None = None, limits: CostLimits | None = None):
        self.engine = engine
        self.limits = limits or CostLimits(max_image_pixels=engine.limits.max_image_pixels)
        """the cost model of /generate (inference/admission.py)"""
        self.limits.validate()
        self.image_budget = MemoryBudget(self.limits.memory_budget_bytes, self.limits.client_budget_share)
        self.fair = FairQueue(engine.submit, self.limits.engine_window or engine.max_batch_size, first_always=True)
        """prepared prompts into the engine, round-robin over clients"""
        engine.light_client_prompts = self.limits.light_client_prompts
        self._prep_threads = ThreadPoolExecutor(self.limits.prep_workers, thread_name_prefix="prepare")
        self.prep = FairQueue(self._start_prep, self.limits.prep_workers, per_client=1)
        """prompts waiting for a preparation thread, one of a client at a time, round-robin over clients"""
        self._abort_epoch = 0
        """counts aborts of all requests: a request prepared across one is answered as aborted"""
        self._tokens_for = image_token_counter(engine)
        self.policy = policy or ServerPolicy()
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.server_args = server_args or {}
        self.receiver = WeightReceiver(engine.named_parameters(), engine.device, weight_sync_timeout_s)
        self.control_events: collections.deque[str] = collections.deque(maxlen=256)
        """control endpoints called, oldest first (shown in /server_info; tests check the refresh order)"""
        self.weight_session = False
        self._kept_handles = None  # weights.ipc.KeptHandles, made on the first same-device update
        """inside /begin_weight_update ... /end_weight_update (SGLang 0.5.x refuses updates outside)"""
        self._weights_lock = asyncio.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self.started = time.time()

    # ---- app ---------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.policy.max_body_bytes)
        post: dict[str, Callable[[Any], Awaitable[web.StreamResponse]]] = {
            "/generate": self.generate,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/flush_cache": self.flush_cache,
            "/abort_request": self.abort_request,
            "/init_weights_update_group": self.init_weights_update_group,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/update_weights_from_tensor": self.update_weights_from_tensor,
            "/destroy_weights_update_group": self.destroy_weights_update_group,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/update_weight_version": self.update_weight_version,
            "/begin_weight_update": self.begin_weight_update,
            "/end_weight_update": self.end_weight_update,
        }
        for path, handler in post.items():
            app.router.add_post(path, self._with_body(path, handler))
        app.router.add_get("/flush_cache", self._with_body("/flush_cache", self.flush_cache))
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/weights_checksum", self.weights_checksum)
        app.on_shutdown.append(self._on_shutdown)
        return app

    @staticmethod
    def _refuse(status: int, message: str) -> web.Response:
        return web.json_response(error(message, status), status=status)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        pol = self.policy
        limit = pol.max_body_bytes if request.path == "/generate" else pol.max_control_body_bytes
        refused = httpguard.refusal(request, names=pol.host_names, max_body=limit)
        if refused is not None:
            return self._refuse(*refused)
        if pol.needs_key(request.path) and not httpguard.keys_equal(
                httpguard.bearer(request.headers.get("Authorization")), pol.api_key):
            return self._refuse(401, "missing or wrong API key (Authorization: Bearer KEY)")
        refused = httpguard.body_type_refusal(request)
        if refused is not None:
            return self._refuse(*refused)
        if request.method == "POST" and request.path != "/generate":
            self.control_events.append(request.path)
        try:
            return await handler(request)
        except Refused as e:
            return self._refuse(e.status, str(e))
        except ProtocolError as e:
            return self._refuse(400, str(e))
        except web.HTTPException as e:
            if e.status >= 400:
                return self._refuse(e.status, f"{e.reason}: {request.method} {request.path}")
            raise
        except Exception as e:  # keep serving; the caller gets the reason
            log.exception("%s failed", request.path)
            return self._refuse(500, f"{type(e).__name__}: {e}")

    def _with_body(self, path: str, handler):
        cls = REQUEST_TYPES[path]

        async def wrapped(request: web.Request) -> web.StreamResponse:
            request["received_at"] = time.perf_counter()
            raw = await request.read()
            if len(raw) <= PARSE_INLINE_BYTES:
                body = parse_json(cls, raw)
            elif path == "/generate":  # a big body: parsed and bounded in the worker process
                e = self.engine
                body = await asyncio.get_running_loop().run_in_executor(
                    self._parse_pool(), parse_generate_bounded, raw, self.limits.max_prompts, e.context_len,
                    e.limits.max_prompt_chars or 16 * e.context_len)
            else:
                body = await asyncio.to_thread(parse_json, cls, raw)
            request["parsed_at"] = time.perf_counter()
            return await handler(body, request)

        return wrapped

    def _parse_pool(self) -> ProcessPoolExecutor:
        """One spawned worker process for parsing large bodies (pydantic holds the GIL while it builds
        millions of values; a thread would stall /health). Started on first use."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _on_shutdown(self, app: web.Application) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._abort_preparing("server shutting down")
        self._prep_threads.shutdown(wait=False, cancel_futures=True)
        await self._run(self.engine.stop)
        self.receiver.close()

    # ---- generation --------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, request: web.Request) -> web.StreamResponse:
        # the cost model first (inference/admission.py): counts, image headers and placeholder counts,
        # no decoding; then the decoded images' memory is reserved against the server-wide budget
        cost = await asyncio.to_thread(
            assess, req, self.limits, image_token_id=self.engine.adapter.image_token_id,
            tokens_for=self._tokens_for, image_size_of=lambda im: image_size(image_bytes(im)))
        client = self._client_of(request)
        self.image_budget.reserve(cost.reserve_bytes, client)
        try:
            return await self._generate(req, request, client)
        finally:
            self.image_budget.release(cost.reserve_bytes, client)

    def _client_of(self, request: web.Request) -> str:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return request.headers.get("X-Client-Id") or (f"{peer[0]}:{peer[1]}" if peer else "?")

    # preparation: each prompt a job on the preparation threads, taken round-robin over clients
    def _start_prep(self, job: _PrepJob) -> None:
        loop = asyncio.get_running_loop()

        def landed(f: Future) -> None:
            if not job.done.done():
                e = f.exception()
                job.done.set_exception(e) if e is not None else job.done.set_result(f.result())
            self.prep.done(job.client)

        try:
            fut = self._prep_threads.submit(job.run)
        except RuntimeError:  # shutting down
            job.done.cancel()
            self.prep.done(job.client)
            return
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(landed, f))

    def _abort_queued(self, message: str) -> None:
        """Before an abort of all requests: prompts still being prepared end as aborted; queued ones
        go into the engine, where the abort finds them."""
        self._abort_preparing(message)
        self.fair.flush()

    def _abort_preparing(self, message: str) -> None:
        """An abort of all requests: requests being prepared are answered as aborted, jobs not started
        are dropped."""
        self._abort_epoch += 1
        for job in self.prep.drop(self.prep.all_pending()):
            if not job.done.done():
                job.done.set_exception(PreparationAborted(message))

    async def _prepare(self, client: str, singles: list[GenerateRequest], dones: list[Callable[[EngineResult], None]],
                       on_token: Callable[[EngineRequest], None] | None, is_batch: bool) -> list[EngineRequest]:
        """Every prompt of a request prepared (all or nothing: a bad prompt drops the rest)."""
        loop = asyncio.get_running_loop()
        memo: dict = {}  # this request only: prompts sharing images share one decoded copy

        def run(one: GenerateRequest, on_done: Callable[[EngineResult], None]) -> EngineRequest:
            token = IMAGE_MEMO.set(memo)
            try:
                er = self.engine.prepare(one, on_done, on_token)
            finally:
                IMAGE_MEMO.reset(token)  # the thread keeps no image of this request
            er.client = client
            return er

        jobs = [_PrepJob(client, functools.partial(run, one, d), loop.create_future())
                for one, d in zip(singles, dones, strict=True)]
        self.prep.push(client, jobs)
        out: list[EngineRequest] = []
        try:
            for i, job in enumerate(jobs):
                try:
                    out.append(await job.done)
                except ProtocolError as e:
                    raise ProtocolError(f"prompt {i}: {e}" if is_batch else str(e)) from None
        finally:
            if len(out) < len(jobs):
                self.prep.drop(jobs)
        return out

    def _aborted_results(self, singles: list[GenerateRequest], message: str) -> list[EngineResult]:
        return [EngineResult(rid=one.rid or "", prompt_tokens=0, output_ids=[], logprobs=[], versions=[],
                             finish_reason=finish_reason("abort", message=message),
                             weight_version=self.engine.weight_version, latency_s=0.0) for one in singles]

    async def _generate(self, req: GenerateRequest, request: web.Request, client: str) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        singles = req.split()
        dones: list[asyncio.Future[EngineResult]] = [loop.create_future() for _ in singles]
        updates: asyncio.Queue[dict[str, Any]] | None = asyncio.Queue() if req.stream else None

        def finished(fut: asyncio.Future[EngineResult], res: EngineResult) -> None:
            self.fair.done(client)  # a window slot is free: the next client's prompt goes in
            if not fut.done():
                fut.set_result(res)

        def on_done_for(fut: asyncio.Future[EngineResult]):
            return lambda res: loop.call_soon_threadsafe(finished, fut, res)

        def on_token(r: EngineRequest) -> None:
            snap = {"output_ids": list(r.output_ids), "logprobs": list(r.logprobs), "versions": list(r.versions)}
            loop.call_soon_threadsafe(updates.put_nowait, snap)

        epoch = self._abort_epoch
        try:
            ereqs = await self._prepare(client, singles, [on_done_for(f) for f in dones],
                                        on_token if req.stream else None, req.is_batch)
            if self._abort_epoch != epoch:
                raise PreparationAborted("aborted while being prepared")
        except PreparationAborted as e:
            results = self._aborted_results(singles, str(e))
            if req.stream:
                return await self._stream_final(request, self._generate_body(singles[0], results[0]))
            bodies = [self._generate_body(one, r) for one, r in zip(singles, results, strict=True)]
            return web.json_response(bodies if req.is_batch else bodies[0])
        self.fair.push(client, ereqs)  # round-robin over clients into the engine
        try:
            if req.stream:
                return await self._stream(singles[0], ereqs[0], request, dones[0], updates)
            results = [self._generate_body(one, await fut) for one, fut in zip(singles, dones, strict=True)]
            return web.json_response(results if req.is_batch else results[0])
        except asyncio.CancelledError:  # the client went away: do not keep generating for nobody
            dropped = {id(er) for er in self.fair.drop(ereqs)}
            for er in [er for er in ereqs if id(er) not in dropped]:
                await self._run(lambda rid=er.rid: self.engine.abort(rid=rid, message="client disconnected"))
            raise

    @staticmethod
    async def _stream_final(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def _stream(self, req, ereq, request, done, updates) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        tok = self.engine.adapter.tokenizer
        while not done.done():
            getter = asyncio.ensure_future(updates.get())
            await asyncio.wait([getter, done], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            snap = getter.result()
            chunk = {
                "text": tok.decode(snap["output_ids"], skip_special_tokens=req.sampling_params.skip_special_tokens),
                "output_ids": snap["output_ids"],
                "meta_info": {"id": ereq.rid, "finish_reason": None, "prompt_tokens": len(ereq.input_ids),
                              "completion_tokens": len(snap["output_ids"]),
                              "weight_version": self.engine.weight_version},
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(f"data: {json.dumps(self._generate_body(req, await done))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _generate_body(req: GenerateRequest, res: EngineResult) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": res.rid,
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": len(res.output_ids),
            "cached_tokens": 0,
            "weight_version": res.weight_version,
            "weight_versions": version_spans(res.versions, res.weight_version),
            "e2e_latency": res.latency_s,
            # extension (real SGLang lacks it): the version that produced each token
            "output_token_versions": res.versions,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res.logprobs, res.output_ids, strict=False)]
        return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}

    async def pause_generation(self, req, request) -> web.Response:
        n = 0
        if req.mode == "abort":
            self._abort_queued("aborted by pause_generation")  # queued prompts are aborted with the rest
            n = await self._run(lambda: self.engine.abort(abort_all=True, message="aborted by pause_generation"))
        if not self.engine.try_pause():  # a step is running: wait for it off the event loop
            await self._run(self.engine.pause)
        return web.json_response(ok(f"paused ({req.mode}); {n} aborted", **self.engine.load_info()))

    async def continue_generation(self, req, request) -> web.Response:
        self.engine.resume()
        return web.json_response(ok("resumed"))

    async def flush_cache(self, req, request) -> web.Response:
        # the hf engine keeps no prefix cache beyond running sequences' own KV: nothing to drop
        return web.json_response(ok("Cache flushed."))

    async def abort_request(self, req, request) -> web.Response:
        if not req.rid and not req.abort_all:  # SGLang ignores it too (200, nothing aborted)
            return web.json_response(ok("no rid and no abort_all: nothing aborted", n_aborted=0))
        if req.abort_all:
            self._abort_queued("aborted by abort_request")
        else:
            self.fair.flush(lambda er: er.rid == req.rid)
        n = await self._run(lambda: self.engine.abort(rid=req.rid or None, abort_all=req.abort_all))
        return web.json_response(ok(f"aborted {n} request(s)", n_aborted=n))

    # ---- weights -----------------------------------------------------------------------------------
    async def init_weights_update_group(self, req, request) -> web.Response:
        await asyncio.to_thread(self.policy.check_trainer_address, req.master_address)
        async with self._weights_lock:
            if req.group_name in self.receiver.groups:
                raise ProtocolError(f"group '{req.group_name}' exists; destroy it first")
            await self._run(lambda: self.receiver.join(req.master_address, req.master_port, req.rank_offset,
                                                       req.world_size, req.group_name, req.backend))
        return web.json_response(ok(f"joined group '{req.group_name}' as rank {req.rank_offset}/{req.world_size}"))

    async def begin_weight_update(self, req, request) -> web.Response:
        if self.weight_session:  # SGLang's scheduler refuses a second session the same way
            raise ProtocolError("a weight-update session is already open; call end_weight_update() first")
        self.weight_session = True
        return web.json_response(ok("weight update session open"))

    async def end_weight_update(self, req, request) -> web.Response:
        if not self.weight_session:
            raise ProtocolError("no weight-update session is open; call /begin_weight_update first")
        self.weight_session = False
        return web.json_response(ok("weight update session closed"))

    async def update_weights_from_distributed(self, req, request) -> web.Response:
        if req.group_name not in self.receiver.groups:
            raise ProtocolError(f"no weight update group '{req.group_name}'; call /init_weights_update_group first")
        if not self.weight_session:
            raise ProtocolError("update_weights_from_distributed must run between /begin_weight_update and "
                                "/end_weight_update")

        def work() -> int:
            with self.engine.exclusive(abort_all=req.abort_all_requests):
                n = self.receiver.receive(req.group_name, req.names, req.dtypes, req.shapes, req.load_format,
                                          req.bucket_sizes)
                if req.weight_version is not None:
                    self.engine.weight_version = req.weight_version
                return n

        async with self._weights_lock:
            if req.abort_all_requests:
                self._abort_queued("aborted for a weight update")
            t0 = time.perf_counter()
            try:
                nbytes = await self._run(work)
            except AnnouncementRejected as e:  # the caller's announcement does not fit: 400
                raise ProtocolError(str(e)) from None
        return web.json_response(ok(
            f"received {len(req.names)} tensors ({nbytes} bytes) in {time.perf_counter() - t0:.3f}s",
            weight_version=self.engine.weight_version,
        ))

    async def update_weights_from_tensor(self, req, request) -> web.Response:
        """SGLang's same-machine refresh: copy from the sender's memory (CUDA IPC or shared-memory
        handles, `weights/ipc.py`) into the live parameters, inside the update session."""
        from asyncwebrl.weights import ipc

        if not self.weight_session:
            raise ProtocolError("update_weights_from_tensor must run between /begin_weight_update and "
                                "/end_weight_update")

        times = TensorUpdateReply(handles_kept=True)
        if self._kept_handles is None:
            self._kept_handles = ipc.KeptHandles()
        kept, data = self._kept_handles, req.serialized_named_tensors[0]

        def work() -> int:
            t0 = time.perf_counter()
            named, memo, _ = kept.named(data, req.load_format)
            t1 = time.perf_counter()
            with self.engine.exclusive(abort_all=req.abort_all_requests):
                t2 = time.perf_counter()
                try:
                    n = ipc.copy_into(self.receiver.params, named, memo)
                except WeightSyncError:
                    kept.drop(data)  # refused: its mapping is not kept
                    raise
                if req.weight_version is not None:
                    self.engine.weight_version = req.weight_version
                times.map_s, times.hold_s, times.copy_s = t1 - t0, t2 - t1, time.perf_counter() - t2
            return n

        async with self._weights_lock:
            if req.abort_all_requests:
                self._abort_queued("aborted for a weight update")
            t0 = time.perf_counter()
            try:
                # a kept payload into a paused, idle model is one replayed copy (milliseconds, nothing
                # to wait for): made here, without the hand-off to a worker thread and back
                if not req.abort_all_requests and kept.has(data) and self.engine.idle():
                    nbytes = work()
                else:
                    nbytes = await self._run(work)
            except WeightSyncError as e:  # the caller's payload does not fit: 400, weights unchanged
                raise ProtocolError(str(e)) from None
        times.read_s = request["parsed_at"] - request["received_at"]
        times.handler_s = time.perf_counter() - request["received_at"]
        return web.json_response(ok(f"copied {nbytes} bytes in {time.perf_counter() - t0:.4f}s",
                                    weight_version=self.engine.weight_version,
                                    **times.model_dump()))

    async def destroy_weights_update_group(self, req, request) -> web.Response:
        async with self._weights_lock:
            if req.group_name not in self.receiver.groups:
                raise ProtocolError(f"no weight update group '{req.group_name}'")
            try:  # the group is dropped either way; a peer that vanished must not hang the call
                await asyncio.wait_for(self._run(lambda: self.receiver.destroy(req.group_name)),
                                       timeout=min(30.0, self.weight_sync_timeout_s))
            except TimeoutError:
                return web.json_response(ok(f"dropped group '{req.group_name}' (its shutdown timed out)"))
        return web.json_response(ok(f"destroyed group '{req.group_name}'"))

    async def update_weights_from_disk(self, req, request) -> web.Response:
        self.policy.check_weight_path(req.model_path)

        def work() -> int:
            with self.engine.exclusive(abort_all=req.abort_all_requests):
                n = self._load_folder(req.model_path)
                if req.weight_version is not None:
                    self.engine.weight_version = req.weight_version
                return n

        async with self._weights_lock:
            if req.abort_all_requests:
                self._abort_queued("aborted for a weight update")
            n = await self._run(work)
        return web.json_response(ok(f"loaded {n} tensors from {req.model_path}",
                                    weight_version=self.engine.weight_version, num_paused_requests=0))

    def _load_folder(self, path: str) -> int:
        from asyncwebrl.models.vlm import load_model

        def by_transformers(p: str):  # checkpoint names the live module spells differently
            return dict(load_model(p, self.engine.model.dtype, "cpu").named_parameters())

        try:
            return load_folder(self.receiver.params, path, by_transformers)
        except WeightSyncError as e:
            raise ProtocolError(str(e)) from None

    async def update_weight_version(self, req, request) -> web.Response:
        if req.abort_all_requests:
            self._abort_queued("aborted by update_weight_version")
            await self._run(lambda: self.engine.abort(abort_all=True, message="aborted by update_weight_version"))
        self.engine.weight_version = req.new_version
        return web.json_response(ok(f"weight version is now {req.new_version}", new_version=req.new_version))

    # ---- info --------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        alive = self.engine._thread is not None and self.engine._thread.is_alive()
        if not alive:
            return web.json_response(error("engine thread is not running", 503), status=503)
        return web.json_response(ok("healthy"))

    async def model_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({
            "model_path": e.model_path,
            "tokenizer_path": e.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": e.weight_version,
            "model_type": e.model.config.model_type,
            "context_length": e.context_len,
            "eos_token_ids": sorted(e.eos_ids),
            "n_parameters": sum(p.numel() for p in e.model.parameters()),
            "ignored_fields": {k: list(v) for k, v in IGNORED_FIELDS.items() if v},
        })

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({
            **self.server_args,
            "backend": "hf",
            "engine": type(e).__name__,
            "version": "asyncwebrl-hf",
            "weight_version": e.weight_version,
            "paused": e.paused,
            "max_batch_size": e.max_batch_size,
            "context_length": e.context_len,
            "weight_update_groups": sorted(self.receiver.groups),
            "weight_update_extensions": [EXTENSION_BUCKET_SIZES],
            "control_events": list(self.control_events),
            "uptime_s": time.time() - self.started,
            **e.load_info(),
            "admission": {"image_budget_bytes": self.image_budget.total, "image_reserved_bytes": self.image_budget.reserved,
                          "image_reserved_peak_bytes": self.image_budget.peak, "refused": self.image_budget.refused,
                          "queued_prompts": self.fair.pending, "engine_window": self.fair.window,
                          "in_engine_prompts": self.fair.in_engine, "preparing_prompts": self.prep.pending + self.prep.in_engine,
                          "client_image_budget_bytes": self.image_budget.client_total,
                          "light_client_prompts": self.engine.light_client_prompts},
            "stats": dict(e.stats),
        })

    async def weights_checksum(self, request: web.Request) -> web.Response:
        digest = await self._run(self.engine.weights_checksum)
        return web.json_response({"sha256": digest, "weight_version": self.engine.weight_version})


def version_spans(versions: list[Any], current: Any) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: runs of output tokens made by one weight version."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        v = str(v)
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": str(current), "start": 0, "end": 0}]


# ---- entry points -----------------------------------------------------------------------------------


def serve_main(args: argparse.Namespace) -> int:
    """`asyncwebrl serve` (blocks until SIGINT/SIGTERM)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if getattr(args, "backend", "hf") != "hf":
        print(f"backend '{args.backend}' is served by its own launcher (see sglang_launcher)", file=sys.stderr)
        return 2
    try:  # before the key or the model: a bad limit costs nothing
        limits = cost_limits(getattr(args, "cost", None) or [], os.environ.get(COST_ENV, ""),
                             max_image_pixels=getattr(args, "max_image_pixels", RequestLimits.max_image_pixels))
    except ValueError as e:
        print(f"bad cost limits: {e}", file=sys.stderr)
        return 2
    try:
        policy, key_file = policy_from_args(args, args.port)
    except (OSError, ValueError) as e:
        print(f"cannot read the API key: {e}", file=sys.stderr)
        return 2
    from asyncwebrl.inference.graph_engine import make_engine

    engine = make_engine(
        args.model,
        device=getattr(args, "device", "cpu"),
        dtype=getattr(args, "dtype", "float32"),
        max_batch_size=getattr(args, "max_batch_size", 32),
        max_context_len=getattr(args, "max_context_len", 4096),
        seed=getattr(args, "seed", 0),
        weight_version=str(getattr(args, "weight_version", "0")),
        cpu_threads=getattr(args, "threads", 0) or default_cpu_threads(getattr(args, "device", "cpu")),
    )
    engine.limits = RequestLimits(allow_auto_truncate=bool(getattr(args, "allow_auto_truncate", False)),
                                  max_images_per_prompt=getattr(args, "max_images", 16),
                                  max_image_pixels=getattr(args, "max_image_pixels", RequestLimits.max_image_pixels))
    engine.start()
    server_args = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "api_key_file")}
    srv = InferenceServer(engine, policy=policy, server_args=server_args, limits=limits,
                          weight_sync_timeout_s=float(getattr(args, "weight_sync_timeout", None)
                                                      or os.environ.get("ASYNCWEBRL_WEIGHT_SYNC_TIMEOUT_S", 120)))
    if getattr(args, "parent_pid", None):
        watch_parent(args.parent_pid)
    if key_file:
        print(f"no API key given: control endpoints need the key written to {key_file}", flush=True)
    print(f"hf server for {engine.model_path} on http://{args.host}:{args.port}", flush=True)
    web.run_app(srv.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


def cost_limits(overrides: list[str], env: str = "", **defaults: Any) -> CostLimits:
    """`CostLimits` from `defaults`, then $ASYNCWEBRL_COST_LIMITS (`env`), then `--cost KEY=VALUE`
    flags; ValueError (naming the key) for an unknown key, a wrong type or an impossible value."""
    from asyncwebrl.configtree import build, parse_override

    data: dict[str, Any] = dict(defaults)
    for text in env.split() + list(overrides):
        key, value = parse_override(text)
        if len(key) != 1:
            raise ValueError(f"cost limit '{text}': give KEY=VALUE with a key of CostLimits")
        data[key[0]] = value
    return build(CostLimits, data, prefix="cost.")


def watch_parent(parent_pid: int, every_s: float = 1.0) -> threading.Thread:
    """Exit (SIGTERM to ourselves, the clean shutdown path) once `parent_pid` is no longer our parent:
    a launcher killed by SIGKILL cannot stop its servers, and they must not outlive it."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        log.warning("launcher %d is gone; shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # a server stuck in shutdown still goes
        os._exit(1)

    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t


def default_cpu_threads(device: str) -> int | None:
    """Torch threads of a CPU server: $ASYNCWEBRL_CPU_THREADS, else torch's own choice when
    $OMP_NUM_THREADS is set, else 1 (servers share the cores with browsers and the trainer)."""
    if not device.startswith("cpu"):
        return None
    if os.environ.get("ASYNCWEBRL_CPU_THREADS"):
        return int(os.environ["ASYNCWEBRL_CPU_THREADS"])
    return None if os.environ.get("OMP_NUM_THREADS") else 1


@dataclass
class ThreadServer:
    """A server running in a background thread of this process (tests, benchmarks)."""

    engine: HFEngine
    address: str
    _loop: LoopThread
    _runner: web.AppRunner
    api_key: str = field(default="", repr=False)
    """the server's key (control endpoints need it)"""

    def stop(self) -> None:
        self._loop.run(self._runner.cleanup(), 30)
        self._loop.stop(30)


def launch_in_thread(engine: HFEngine, port: int = 0, *, host: str = net.LOOPBACK,
                     api_key: str | None = None, policy: ServerPolicy | None = None,
                     limits: CostLimits | None = None) -> ThreadServer:
    """Serve an (already started) engine from a background thread; returns once it accepts requests.
    Without a policy: `api_key` guards every endpoint but /health when given, else a fresh key
    guards the control endpoints (`ThreadServer.api_key`)."""
    port = port or free_port(host)
    if policy is None:
        policy = ServerPolicy(api_key=api_key, key_scope="all") if api_key else ServerPolicy()
    loop = LoopThread("hf-server")
    srv = InferenceServer(engine, policy=policy, limits=limits)
    runner = web.AppRunner(srv.app(), access_log=None)

    async def serve() -> None:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()

    try:
        loop.run(serve(), 60)
    except TimeoutError as e:
        raise RuntimeError("in-thread server did not start") from e
    return ThreadServer(engine, f"http://{host}:{port}", loop, runner, api_key=policy.api_key)
