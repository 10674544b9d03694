"""Control endpoints are not open doors: the inference server listens on loopback only by default and refuse requests without the right key/token; the network code paths hold
no unpickling of received data. (Origin confinement of the agent is tested in tests/web/test_safety.py.)"""

from __future__ import annotations

import ast
import http.client
import socket
from pathlib import Path

import psutil
import pytest

PKG = Path(__file__).resolve().parents[2] / "asyncwebrl"


def _listening_addrs(pid: int) -> list[tuple[str, int]]:
    return [c.laddr for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def _lan_ip() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_inference_server_binds_loopback_by_default(tmp_path):
    from asyncwebrl.inference.config import InferenceConfig
    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.net import LOOPBACK, bind_address
    from asyncwebrl.scheduling.servers import launch_server

    # 'node': this node's address, which on a single box (no multi-node Ray cluster) is loopback
    assert bind_address(InferenceConfig().host, multi_node=False) == LOOPBACK == "127.0.0.1"
    srv = launch_server(model=resolve_model_path("tiny-qwen2.5-vl"), api_key="k3y", log_dir=tmp_path,
                        startup_timeout=300)
    try:
        pids = [srv.proc.pid] + [c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True)]
        addrs = [a for p in pids for a in _listening_addrs(p)]
        assert addrs and all(a.ip == "127.0.0.1" for a in addrs), addrs
        port = int(srv.address.rsplit(":", 1)[1])
        assert _post(port, "/update_weight_version", b'{"weight_version": "9"}', {})[0] == 401
        assert _post(port, "/update_weights_from_disk", b'{"model_path": "/"}', {"Authorization": "Bearer no"})[0] == 401
        status, body = _post(port, "/update_weight_version", b'{"weight_version": "9"}',
                             {"Authorization": "Bearer k3y", "Content-Type": "application/json"})
        assert status in (200, 400) and b"API key" not in body  # with the key the request is heard
    finally:
        srv.stop()


# Modules that receive bytes from a network peer (HTTP bodies, PixelStore frames, rollout records).
NETWORK_MODULES = ["inference/server.py", "inference/client.py", "protocol.py",
                   "pixelstore/store.py", "pixelstore/ray_store.py",
                   "weights/sender.py", "weights/receiver.py", "weights/control.py", "weights/group.py",
                   "web/webgym.py", "web/browser.py", "rollout/workflow.py"]
UNSAFE = {("pickle", "loads"), ("pickle", "load"), ("cloudpickle", "loads"), ("torch", "load"), ("dill", "loads"),
          ("marshal", "loads"), ("yaml", "load"), ("numpy", "load"), ("np", "load")}


def test_network_code_paths_never_unpickle():
    found = []
    for rel in NETWORK_MODULES:
        tree = ast.parse((PKG / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in UNSAFE:
                found.append(f"{rel}:{node.lineno} {node.func.value.id}.{node.func.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{rel}:{node.lineno} import {n}" for n in names if n in ("pickle", "cloudpickle", "dill")]
    assert not found, found
