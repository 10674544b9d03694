"""A test server that is SGLang where it matters, built from the released wheel's OWN code.

SGLang's server cannot start without CUDA, and importing `sglang` pulls in CUDA-only packages, so the
code a SGLang server runs for the weight refresh is read from the wheel and executed unchanged
(nothing of SGLang is copied into this project), layer by layer as a request travels:

  HTTP        sglang/srt/entrypoints/http_server.py      the route functions of every control route
              (FastAPI, as SGLang serves them: bodies validated by pydantic through SGLang's own
              msgspec->pydantic schema, sglang/srt/utils/msgspec_utils.py; 422 turned into 400)
  structs     sglang/srt/managers/io_struct.py           BaseReq and every *ReqInput/*ReqOutput used
  tokenizer   sglang/srt/managers/tokenizer_control_mixin.py and tokenizer_manager.py
              (pause/continue, the paused-or-writer-lock rule, update session calls, disk update,
              version), sglang/srt/utils/aio_rwlock.py (the model-update lock)
  scheduler   sglang/srt/managers/scheduler_components/weight_updater.py
              SchedulerWeightUpdaterManager (session rules, load, version record, flush-after-update)
              sglang/srt/managers/scheduler.py  flush_cache and is_fully_idle
  executor    sglang/srt/model_executor/model_runner_components/weight_updater.py WeightUpdater
              (group init/destroy, receive, load, disk update with rollback), utils/common.py
              init_custom_process_group, weight_sync/tensor_bucket.py FlattenedTensorBucket

Our own stand-ins are only what needs CUDA or a real model: the model (a dict of parameters with
SGLang's `load_weights` contract), the model loader (safetensors files -> (name, tensor)), the
running batch (requests are placed in it by a test route; retract moves them to the waiting queue),
and `/server_info` (SGLang builds it from its launch arguments). Test-only routes start with `/_test/`:
running requests, failure injection (the next N calls of a route answer as SGLang answers a failure),
the served weights' checksum and the scheduler's state.

Runs under the SGLang test venv (torch 2.14.1, fastapi, msgspec: `make sglang-venv`).
Usage: python sglang_standin.py WHEEL PORTFILE [PARAMS.safetensors]
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import sys
import threading
import types
import typing
import zipfile
from http import HTTPStatus
from typing import Annotated, Any, Optional

import torch
from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import ORJSONResponse, Response

log = logging.getLogger("sglang-standin")

HTTP = "sglang/srt/entrypoints/http_server.py"
IO = "sglang/srt/managers/io_struct.py"
MSGSPEC_UTILS = "sglang/srt/utils/msgspec_utils.py"
TOK_MIXIN = "sglang/srt/managers/tokenizer_control_mixin.py"
TOK = "sglang/srt/managers/tokenizer_manager.py"
RWLOCK = "sglang/srt/utils/aio_rwlock.py"
COMM = "sglang/srt/managers/communicator.py"
SCHED_WU = "sglang/srt/managers/scheduler_components/weight_updater.py"
SCHED = "sglang/srt/managers/scheduler.py"
EXEC_WU = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
COMMON = "sglang/srt/utils/common.py"
BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"

ROUTES = ("/flush_cache", "/update_weights_from_disk", "/init_weights_update_group",
          "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update",
          "/update_weights_from_distributed", "/update_weight_version", "/abort_request",
          "/pause_generation", "/continue_generation", "/model_info", "/get_model_info")
"""routes whose SGLang function is served unchanged"""
IO_CLASSES = ("BaseReq", "FlushCacheReqInput", "FlushCacheReqOutput", "AbortReq", "PauseGenerationReqInput",
              "ContinueGenerationReqInput", "InitWeightsUpdateGroupReqInput", "InitWeightsUpdateGroupReqOutput",
              "DestroyWeightsUpdateGroupReqInput", "DestroyWeightsUpdateGroupReqOutput",
              "UpdateWeightsFromDistributedReqInput", "UpdateWeightsFromDistributedReqOutput",
              "UpdateWeightFromDiskReqInput", "UpdateWeightFromDiskReqOutput", "UpdateWeightVersionReqInput",
              "UpdateWeightVersionReqOutput", "BeginWeightUpdateReqInput", "BeginWeightUpdateReqOutput",
              "EndWeightUpdateReqInput", "EndWeightUpdateReqOutput")


class Wheel:
    """Source files of the wheel, and their top-level definitions picked by name."""

    def __init__(self, path: str):
        self.z = zipfile.ZipFile(path)

    def src(self, path: str) -> str:
        return self.z.read(path).decode()

    def defs(self, path: str, names: set[str] | tuple[str, ...], cls: str | None = None,
             keep_decorators: bool = False) -> list[ast.stmt]:
        body = ast.parse(self.src(path)).body
        if cls is not None:
            body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
        want = set(names)
        got = [n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
               and n.name in want]
        missing = want - {n.name for n in got}
        assert not missing, f"{path} lacks {sorted(missing)}: another SGLang release?"
        if not keep_decorators:
            for n in got:
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                    n.decorator_list = []
        return sorted(got, key=lambda n: [x.name for x in got].index(n.name))

    def run(self, path: str, nodes: list[ast.stmt], ns: dict[str, Any]) -> None:
        mod = ast.Module(body=nodes, type_ignores=[])
        exec(compile(ast.fix_missing_locations(mod), path, "exec"), ns)

    def route_table(self) -> dict[str, set[str]]:
        """Every path of SGLang's HTTP server and its methods, read from the decorators."""
        table: dict[str, set[str]] = {}
        for n in ast.walk(ast.parse(self.src(HTTP))):
            if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for d in n.decorator_list:
                if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                        and isinstance(d.func.value, ast.Name) and d.func.value.id == "app"):
                    continue
                if not d.args or not isinstance(d.args[0], ast.Constant):
                    continue
                path, kind = d.args[0].value, d.func.attr
                if kind in ("get", "post", "put", "delete"):
                    table.setdefault(path, set()).add(kind.upper())
                elif kind == "api_route":
                    methods = next((k.value for k in d.keywords if k.arg == "methods"), None)
                    table.setdefault(path, set()).update(ast.literal_eval(methods) if methods else {"GET"})
        return table


def method_holder(wheel: Wheel, path: str, cls: str, names: tuple[str, ...], ns: dict[str, Any]) -> dict[str, Any]:
    """SGLang's methods `names` of class `cls`, as plain functions to set on a stand-in class."""
    nodes = wheel.defs(path, names, cls=cls)
    local = dict(ns)
    wheel.run(path, nodes, local)
    return {n: local[n] for n in names}


def load_io_structs(wheel: Wheel) -> types.ModuleType:
    import msgspec
    from pydantic_core import core_schema

    mod = types.ModuleType("sglang_io_struct")
    sys.modules[mod.__name__] = mod  # msgspec resolves the string annotations in the module
    ns = mod.__dict__
    ns.update({k: getattr(typing, k) for k in ("Any", "Dict", "List", "Literal", "Optional", "Union", "Tuple")})
    ns.update(msgspec=msgspec, core_schema=core_schema, FinishReasonDict=dict, WeightVersionSpans=Any,
              __name__=mod.__name__)
    wheel.run(MSGSPEC_UTILS, wheel.defs(MSGSPEC_UTILS, {"msgspec_struct_pydantic_core_schema"}), ns)
    wheel.run(IO, wheel.defs(IO, IO_CLASSES), ns)
    return mod


class StandinModel(torch.nn.Module):
    """What needs a real model: parameters with SGLang's `load_weights(iterable of (name, tensor))`
    contract (a name the model lacks is an error)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        super().__init__()
        self.params = {k: v.clone() for k, v in params.items()}

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name not in self.params:
                raise KeyError(f"parameter {name} is not in the model")
            self.params[name].copy_(t.to(self.params[name].dtype).view(self.params[name].shape))

    def checksum(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.params):
            t = self.params[name].contiguous()
            h.update(name.encode())
            h.update(str(t.dtype).encode())
            h.update(bytes(t.clone().view(-1).view(torch.uint8).untyped_storage()))
        return h.hexdigest()


class StandinLoader:
    """SGLang's DefaultModelLoader where it reads files: the safetensors of `model_path`."""

    class Source:
        @staticmethod
        def init_new(config, model):
            return config

    def _get_weights_iterator(self, config):
        import glob
        import os

        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(config.model_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {config.model_path}")
        for f in files:
            yield from load_file(f).items()

    @staticmethod
    def restore_weights_before_loading(model, device) -> None:
        return None

    @staticmethod
    def postprocess_weights(model, device) -> None:
        return None

    def load_weights_and_postprocess(self, model, weights, device) -> None:
        model.load_weights(weights)


def build(wheel_path: str, params: dict[str, torch.Tensor]):
    import msgspec

    wheel = Wheel(wheel_path)
    io = load_io_structs(wheel)
    structs = {k: getattr(io, k) for k in IO_CLASSES}

    # ---- the default process group a SGLang scheduler runs in (its TP group: here tp=1) ----------
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tp_group = dist.group.WORLD
    parallel = types.SimpleNamespace(dp_size=1, num_dp_ranks=1, tp_group=types.SimpleNamespace(cpu_group=tp_group))
    get_parallel = lambda: parallel  # noqa: E731

    # ---- executor: SGLang's WeightUpdater around the stand-in model ------------------------------
    tb = types.ModuleType("sglang_tensor_bucket")
    sys.modules[tb.__name__] = tb
    exec(compile(wheel.src(BUCKET), BUCKET, "exec"), tb.__dict__)
    model = StandinModel(params)
    ns_exec = {"torch": torch, "logger": log, "Optional": Optional, "List": list, "Tuple": tuple, "Union": typing.Union,
               "Callable": typing.Callable, "gc": __import__("gc"),
               "torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]),
               "FlattenedTensorBucket": tb.FlattenedTensorBucket,
               "DefaultModelLoader": StandinLoader,
               "LoadConfig": lambda **kw: types.SimpleNamespace(**kw),
               "get_model_loader": lambda load_config, model_config: StandinLoader(),
               "set_default_torch_dtype": lambda dtype: contextlib.nullcontext(),
               "get_available_gpu_memory": lambda *a, **k: 0.0,
               "get_pp_stage_load_group": lambda: None,
               "get_model": lambda: types.SimpleNamespace(weight_cache_mode="off"),
               "_unsupported_derived_weight_cache_error": lambda m: None,
               "post_load_weights": lambda m: None,
               "current_platform": types.SimpleNamespace(is_out_of_tree=lambda: False),
               "NetworkAddress": lambda host, port: types.SimpleNamespace(to_tcp=lambda: f"tcp://{host}:{port}")}
    wheel.run(COMMON, wheel.defs(COMMON, {"init_custom_process_group"}), ns_exec)
    exec_methods = method_holder(wheel, EXEC_WU, "WeightUpdater", (
        "init_weights_update_group", "destroy_weights_update_group", "update_weights_from_disk",
        "receive_weights_from_distributed", "_receive_bucketed_weights_from_distributed", "begin_weight_update",
        "end_weight_update", "load_weights_from_distributed", "_assert_weight_cache_inactive"), ns_exec)

    served = {"model_path": "standin", "load_format": "auto", "weight_version": "default"}

    class WeightUpdater:
        def __init__(self):
            self.tp_rank, self.device, self.gpu_id = 0, "cpu", 0
            self.model_config = types.SimpleNamespace(model_path="standin", dtype=torch.float32)
            self._model_update_group: dict[str, Any] = {}
            self.get_model = lambda: model

        def update_model_fields(self, model_, **fields):
            served.update({k: v for k, v in fields.items() if k in served})

        def recapture_cuda_graph(self):
            return None

    for k, f in exec_methods.items():
        setattr(WeightUpdater, k, f)
    runner = types.SimpleNamespace(weight_updater=WeightUpdater())

    # ---- scheduler: SGLang's flush rules and weight-update manager --------------------------------
    class Req:
        """A request in the batch (no KV of a PD transfer: `kv.holds_kv` false)."""

        def __init__(self, rid: str):
            self.rid, self.kv = rid, types.SimpleNamespace(holds_kv=False)

    class Batch:
        def __init__(self):
            self.reqs: list[Req] = []

        def is_empty(self) -> bool:
            return not self.reqs

    class Scheduler:
        """The scheduler's state that its flush and session code reads; the batch machinery is ours."""

        def __init__(self):
            self.running_batch, self.waiting_queue = Batch(), []
            self.chunked_req = self.last_batch = self.cur_batch_for_debug = None
            self.enable_overlap, self.result_queue = False, []
            self.dllm_manager = types.SimpleNamespace(any_staging_reqs=lambda: False)
            self._pp_microbatches_drained = lambda: True
            self.grammar_manager = types.SimpleNamespace(grammar_queue=[], clear=lambda: None)
            self.disaggregation_mode = "null"
            self.disagg_decode_prealloc_queue = self.decode_offload_manager = None
            self.enable_hisparse = self.enable_hierarchical_cache = self.enable_lmcache = False
            self.tree_cache = types.SimpleNamespace(reset=self._reset_tree)
            self.req_to_token_pool = types.SimpleNamespace(clear=lambda: None, reset_aux_cache_allocator=lambda: None)
            self.token_to_kv_pool_allocator = types.SimpleNamespace(clear=lambda: None)
            self.metrics_reporter = types.SimpleNamespace(reset_metrics=lambda: None, is_stats_logging_rank=True)
            self.draft_worker = None
            self._engine_paused = False
            self.flushes = 0
            self.cached_prefixes = 0
            self.weight_version = "default"

        def _reset_tree(self):
            self.flushes += 1
            self.cached_prefixes = 0

        # ours: the batch machinery (CUDA in SGLang)
        def pause_generation(self, req):
            assert req.mode in ("in_place", "retract")
            self._engine_paused = True
            if req.mode == "retract":
                self.waiting_queue += self.running_batch.reqs
                self.running_batch.reqs = []

        def continue_generation(self, req):
            self._engine_paused = False

        def abort(self, req):
            if req.abort_all:
                self.running_batch.reqs, self.waiting_queue = [], []
            else:
                self.running_batch.reqs = [r for r in self.running_batch.reqs if not r.rid.startswith(req.rid)]
                self.waiting_queue = [r for r in self.waiting_queue if not r.rid.startswith(req.rid)]

        def record_weight_version_change(self, new_version):
            if new_version is not None:
                self.weight_version = new_version

    sched_ns = {"logging": logging, "logger": log, "current_platform": types.SimpleNamespace(empty_cache=lambda: None),
                "DisaggregationMode": types.SimpleNamespace(DECODE="decode", PREFILL="prefill", NULL="null")}
    for k, f in method_holder(wheel, SCHED, "Scheduler", ("flush_cache", "is_fully_idle"), sched_ns).items():
        setattr(Scheduler, k, f)
    scheduler = Scheduler()

    mgr_ns = {**{k: getattr(typing, k) for k in ("Any", "Callable", "Dict", "Iterator", "List", "Optional",
                                                  "Set", "Tuple")},
              "msgspec": msgspec, "torch": torch, "time": __import__("time"), "logger": log,
              "dataclass": dataclasses.dataclass, "field": dataclasses.field,
              "contextmanager": contextlib.contextmanager, "get_parallel": get_parallel, **structs}
    wheel.run(SCHED_WU, wheel.defs(SCHED_WU, ("_parse_runner_selector", "_WeightUpdateSession",
                                              "SchedulerWeightUpdaterManager"), keep_decorators=True), mgr_ns)
    tp_worker = types.SimpleNamespace(
        model_runner=runner, weight_update_runners=lambda: [("target", runner)],
        init_weights_update_group=lambda r: runner.weight_updater.init_weights_update_group(
            r.master_address, r.master_port, r.rank_offset, r.world_size, r.group_name, r.backend),
        destroy_weights_update_group=lambda r: runner.weight_updater.destroy_weights_update_group(r.group_name))
    manager = mgr_ns["SchedulerWeightUpdaterManager"](
        tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None,
        flush_cache=scheduler.flush_cache, is_fully_idle=scheduler.is_fully_idle, scheduler=scheduler)

    # the scheduler's dispatch: one request type -> one handler, run one at a time (its event loop)
    faults: dict[str, int] = {}
    dispatch = {
        "FlushCacheReqInput": lambda r: structs["FlushCacheReqOutput"](success=scheduler.flush_cache()),
        "InitWeightsUpdateGroupReqInput": manager.init_weights_update_group,
        "DestroyWeightsUpdateGroupReqInput": manager.destroy_weights_update_group,
        "UpdateWeightsFromDistributedReqInput": manager.update_weights_from_distributed,
        "UpdateWeightFromDiskReqInput": manager.update_weights_from_disk,
        "BeginWeightUpdateReqInput": manager.begin_weight_update,
        "EndWeightUpdateReqInput": manager.end_weight_update,
        "UpdateWeightVersionReqInput": lambda r: (scheduler.record_weight_version_change(r.new_version),
                                                  structs["UpdateWeightVersionReqOutput"]())[1],
        "PauseGenerationReqInput": scheduler.pause_generation,
        "ContinueGenerationReqInput": scheduler.continue_generation,
        "AbortReq": scheduler.abort,
    }
    sched_lock = threading.Lock()

    def on_scheduler(req):
        with sched_lock:
            return dispatch[type(req).__name__](req)

    # ---- tokenizer manager: SGLang's control methods ---------------------------------------------
    rw_ns: dict[str, Any] = {}
    exec(compile(wheel.src(RWLOCK), RWLOCK, "exec"), rw_ns)
    comm_ns: dict[str, Any] = {}
    merge = method_holder(wheel, COMM, "FanOutCommunicator", ("merge_results",), comm_ns)["merge_results"]
    tok_ns = {"asyncio": asyncio, "logger": log, "get_parallel": get_parallel, "nullcontext": contextlib.nullcontext,
              "FanOutCommunicator": types.SimpleNamespace(merge_results=merge), **structs,
              **{k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Tuple")}}
    mixin = method_holder(wheel, TOK_MIXIN, "TokenizerControlMixin", (
        "init_weights_update_group", "destroy_weights_update_group", "_weight_update_session_call",
        "begin_weight_update", "end_weight_update", "update_weights_from_distributed", "flush_cache",
        "update_weight_version", "_update_weight_version_if_provided"), tok_ns)
    tok = method_holder(wheel, TOK, "TokenizerManager", (
        "pause_generation", "continue_generation", "update_weights_from_disk", "_wait_for_model_update_from_disk"),
        tok_ns)

    async def in_thread(req):
        return await asyncio.get_running_loop().run_in_executor(None, on_scheduler, req)

    def communicator(name: str):
        async def call(obj):
            return [await in_thread(obj)]
        return call

    class TokenizerManager:
        def __init__(self):
            self.is_pause = False
            self.is_pause_cond = asyncio.Condition()
            self.model_update_lock = rw_ns["RWLock"]()
            self.mm_processor = None
            self.elastic_worker_count = 1
            self.model_path, self.served_model_name, self.is_generation = "standin", "standin", True
            self.model_config = types.SimpleNamespace(is_image_understandable_model=False,
                                                      is_audio_understandable_model=False,
                                                      hf_config=types.SimpleNamespace(model_type="standin",
                                                                                      architectures=["Standin"]))
            for name in ("init_weights_update_group", "destroy_weights_update_group", "begin_weight_update",
                         "end_weight_update", "update_weights_from_distributed", "update_weight_version"):
                setattr(self, f"{name}_communicator", communicator(name))

        def auto_create_handle_loop(self):
            return None

        async def flush_cache_communicator(self, obj):
            return [await in_thread(obj)]

        def abort_request(self, rid: str = "", abort_all: bool = False):
            if not abort_all and not rid:
                return
            on_scheduler(structs["AbortReq"](rid=rid, abort_all=abort_all))

        async def _async_dispatch_to_scheduler(self, obj):
            await in_thread(obj)

        def _dispatch_to_scheduler(self, obj):
            fut = self.model_update_result
            loop = asyncio.get_running_loop()

            async def go():
                try:
                    res = await in_thread(obj)
                except BaseException as e:  # noqa: BLE001 - the caller waits on the future
                    if not fut.done():
                        fut.set_exception(e)
                    raise
                if not fut.done():
                    fut.set_result(res)
            loop.create_task(go())

        def _update_model_path_info(self, model_path, load_format):
            self.model_path = model_path

        def record_config_updates(self, source: str, **fields):
            served.update(fields)

        def config_value(self, name: str):
            return served.get(name)

    for k, f in {**mixin, **tok}.items():
        setattr(TokenizerManager, k, f)

    # ---- HTTP: SGLang's route functions in a FastAPI app ------------------------------------------
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def validation_exception_handler(request: Request, exc: RequestValidationError):
        # SGLang's handler, reduced to the plain-route branch: 400 with its legacy error shape
        return ORJSONResponse(status_code=400, content={"object": "error", "message": str(exc.errors()),
                                                        "type": "Bad Request", "code": 400})

    @app.middleware("http")
    async def inject_faults(request: Request, call_next):
        n = faults.get(request.url.path, 0)
        if n > 0 and request.method == "POST":
            faults[request.url.path] = n - 1
            return ORJSONResponse({"success": False, "message": f"injected failure of {request.url.path}"},
                                  status_code=HTTPStatus.BAD_REQUEST)
        return await call_next(request)

    global_state = types.SimpleNamespace(tokenizer_manager=None)
    http_ns = {"app": app, "Annotated": Annotated, "Body": Body, "Query": Query, "Request": Request,
               "Response": Response, "ORJSONResponse": ORJSONResponse, "HTTPStatus": HTTPStatus, "logger": log,
               "_global_state": global_state, "msgspec_to_builtins": lambda x: x,
               "get_serving": lambda: types.SimpleNamespace(tokenizer_path="standin", preferred_sampling_params=None),
               "List": list, "Dict": dict, "Any": Any, "Optional": Optional, **structs}
    table = wheel.route_table()
    funcs = []
    for n in ast.parse(wheel.src(HTTP)).body:
        if not isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = {d.args[0].value for d in n.decorator_list if isinstance(d, ast.Call) and d.args
                 and isinstance(d.args[0], ast.Constant) and isinstance(d.func, ast.Attribute)
                 and isinstance(d.func.value, ast.Name) and d.func.value.id == "app"}
        if paths & set(ROUTES) or n.name == "_create_error_response":
            n.decorator_list = [d for d in n.decorator_list if not (isinstance(d, ast.Call) and isinstance(
                d.func, ast.Name) and d.func.id == "auth_level")]
            funcs.append(n)
    wheel.run(HTTP, funcs, http_ns)

    @app.get("/server_info")
    async def server_info():
        return {"version": "0.5.23", "frontend": "python", "internal_states": [{}],
                "weight_version": served["weight_version"]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    # ---- test-only routes ---------------------------------------------------------------------------
    @app.post("/_test/running")
    async def t_running(request: Request):
        b = await request.json()
        with sched_lock:
            scheduler.running_batch.reqs += [Req(f"{b.get('rid', 'held')}-{i}") for i in range(int(b["n"]))]
            scheduler.cached_prefixes += int(b.get("cache", 0))
        return {"running": len(scheduler.running_batch.reqs)}

    @app.post("/_test/finish")
    async def t_finish(request: Request):
        with sched_lock:
            n = len(scheduler.running_batch.reqs) + len(scheduler.waiting_queue)
            scheduler.running_batch.reqs, scheduler.waiting_queue = [], []
        return {"finished": n}

    @app.post("/_test/fail")
    async def t_fail(request: Request):
        b = await request.json()
        faults[b["route"]] = int(b.get("times", 1))
        return {"armed": faults}

    @app.get("/_test/state")
    async def t_state():
        tm = global_state.tokenizer_manager
        with sched_lock:
            return {"torch": torch.__version__, "checksum": model.checksum(), "weight_version": served["weight_version"],
                    "scheduler_weight_version": scheduler.weight_version, "paused": tm.is_pause,
                    "engine_paused": scheduler._engine_paused, "session_open": manager._session is not None,
                    "running": [r.rid for r in scheduler.running_batch.reqs],
                    "waiting": [r.rid for r in scheduler.waiting_queue],
                    "flushes": scheduler.flushes, "cached_prefixes": scheduler.cached_prefixes,
                    "groups": sorted(runner.weight_updater._model_update_group)}

    @app.get("/_test/routes")
    async def t_routes():
        return {p: sorted(m) for p, m in table.items()}

    def bind_tokenizer_manager():
        global_state.tokenizer_manager = TokenizerManager()  # its asyncio objects on the serving loop

    return app, bind_tokenizer_manager, table


def main() -> None:
    wheel, portfile = sys.argv[1], sys.argv[2]
    params: dict[str, torch.Tensor] = {}
    if len(sys.argv) > 3:
        from safetensors.torch import load_file

        params = load_file(sys.argv[3])
    import socket

    import uvicorn

    app, bind, _ = build(wheel, params)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30)
    server = uvicorn.Server(config)

    async def serve():
        bind()
        started = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.02)
        with open(portfile + ".tmp", "w") as f:
            f.write(str(port))
        import os

        os.replace(portfile + ".tmp", portfile)
        await started

    asyncio.run(serve())


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message=".*ORJSONResponse is deprecated.*")
    logging.basicConfig(level=logging.INFO)
    main()
