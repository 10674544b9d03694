"""SGLang's OWN receiving code behind a minimal HTTP front, for `test_sglang_receiver.py`.

SGLang's server cannot start without CUDA, and importing `sglang` pulls in CUDA-only packages, so
the functions a SGLang server runs to receive weights are read from the released wheel's source and
executed unchanged (nothing of SGLang is copied into this project):
  sglang/srt/utils/common.py                 init_custom_process_group  (the rendezvous)
  sglang/srt/weight_sync/tensor_bucket.py    FlattenedTensorBucket       (the flat layout)
  .../model_runner_components/weight_updater.py
                                             WeightUpdater.receive_weights_from_distributed and
                                             _receive_bucketed_weights_from_distributed (the receive)
The HTTP front maps SGLang's endpoints onto them the way SGLang's http_server -> scheduler does.
Usage: python sglang_side.py WHEEL PORTFILE
"""

from __future__ import annotations

import ast
import asyncio
import sys
import types
import zipfile

import torch
from aiohttp import web

from asyncwebrl.inference.engine import params_checksum

COMMON = "sglang/srt/utils/common.py"
BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"


def load_sglang(wheel: str) -> types.SimpleNamespace:
    with zipfile.ZipFile(wheel) as z:
        common, bucket, updater = (z.read(p).decode() for p in (COMMON, BUCKET, UPDATER))
    tb = types.ModuleType("sglang_tensor_bucket")
    sys.modules[tb.__name__] = tb  # dataclasses look their module up
    exec(compile(bucket, BUCKET, "exec"), tb.__dict__)  # torch + dataclasses only
    ns = {"torch": torch, "torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]),
          "FlattenedTensorBucket": tb.FlattenedTensorBucket, "Optional": __import__("typing").Optional}

    def take(src: str, path: str, names: set[str], cls: str | None = None) -> None:
        tree = ast.parse(src)
        body = tree.body
        if cls is not None:
            body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
        funcs = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
        assert {f.name for f in funcs} == names, f"{path} lacks {names - {f.name for f in funcs}}"
        for f in funcs:
            f.decorator_list = []
        mod = ast.Module(body=funcs, type_ignores=[])
        exec(compile(ast.fix_missing_locations(mod), path, "exec"), ns)

    take(common, COMMON, {"init_custom_process_group"})
    take(updater, UPDATER, {"receive_weights_from_distributed", "_receive_bucketed_weights_from_distributed"},
         cls="WeightUpdater")
    return types.SimpleNamespace(**{k: ns[k] for k in ("init_custom_process_group", "receive_weights_from_distributed",
                                                       "_receive_bucketed_weights_from_distributed")})


def main() -> None:
    wheel, portfile = sys.argv[1], sys.argv[2]
    sg = load_sglang(wheel)
    # what SGLang's WeightUpdater holds: its device and its update groups
    runner = types.SimpleNamespace(device="cpu", _model_update_group={})
    runner._receive_bucketed_weights_from_distributed = (
        lambda **kw: sg._receive_bucketed_weights_from_distributed(runner, **kw))
    received: dict[str, torch.Tensor] = {}
    loop_run = lambda fn: asyncio.get_running_loop().run_in_executor(None, fn)  # noqa: E731

    async def init(request: web.Request) -> web.Response:
        b = await request.json()

        def go():
            runner._model_update_group[b["group_name"]] = sg.init_custom_process_group(
                backend=b.get("backend", "nccl"), init_method=f"tcp://{b['master_address']}:{b['master_port']}",
                world_size=b["world_size"], rank=b["rank_offset"], group_name=b["group_name"])

        await loop_run(go)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update(request: web.Request) -> web.Response:
        b = await request.json()

        def go():
            weights = sg.receive_weights_from_distributed(
                runner, names=b["names"], dtypes=b["dtypes"], shapes=b["shapes"], group_name=b["group_name"],
                load_format=b.get("load_format"))
            for name, t in weights:
                received[name] = t.clone()

        await loop_run(go)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def destroy(request: web.Request) -> web.Response:
        b = await request.json()
        pg = runner._model_update_group.pop(b["group_name"])
        torch.distributed.destroy_process_group(pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def checksum(request: web.Request) -> web.Response:
        return web.json_response({"sha256": params_checksum(received.items()), "names": list(received)})

    app = web.Application(client_max_size=2**28)
    app.router.add_post("/init_weights_update_group", init)
    app.router.add_post("/update_weights_from_distributed", update)
    app.router.add_post("/destroy_weights_update_group", destroy)
    app.router.add_get("/weights_checksum", checksum)

    async def serve():
        runner_ = web.AppRunner(app)
        await runner_.setup()
        site = web.TCPSite(runner_, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        with open(portfile, "w") as f:
            f.write(str(port))
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
