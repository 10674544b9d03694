"""PixelStore core and the local (non-Ray) store process: the same API, bounded, refcounted."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.pixelstore import make_pixel_store
from asyncwebrl.pixelstore.local_store import (
    LocalPixelStoreClient,
    pack_frames,
    start_local_store,
    unpack_frames,
)
from asyncwebrl.pixelstore.store import PixelStore, PixelStoreFull, key_occurrences


@pytest.fixture(scope="module")
def local_store():
    c = start_local_store(10_000, put_timeout_s=2.0)
    yield c
    c.close()


def stores(local):
    return {"inprocess": PixelStore(10_000, 2.0, prefix="mem"), "local": local}


@pytest.mark.parametrize("kind", ["inprocess", "local"])
def test_put_get_free_refcount(kind, local_store):
    s = stores(local_store)[kind]
    a, b = s.put_batch([b"A" * 100, b"B" * 50])
    c = s.put(b"C")
    assert s.get([b, a, "mem:nope", c]) == [b"B" * 50, b"A" * 100, None, b"C"]
    # a screenshot shared by three per-step samples: three references
    assert s.retain([a, a]) == 2
    assert s.free([a]) == 0 and s.free([a]) == 0
    assert s.get([a]) == [b"A" * 100]
    assert s.free([a]) == 1
    assert s.get([a]) == [None]
    assert s.count_missing([a, b, c]) == 1
    st = s.stats()
    assert st["missing"] >= 2 and st["puts"] >= 3 and st["frees"] >= 1
    s.free([b, c])
    assert s.stats()["items"] == 0 and s.stats()["bytes"] == 0


@pytest.mark.parametrize("kind", ["inprocess", "local"])
def test_back_pressure_blocks_then_proceeds_after_free(kind, local_store):
    s = stores(local_store)[kind]
    big = s.put(b"x" * 9_000)
    done = {}

    def writer():
        t0 = time.monotonic()
        done["key"] = s.put(b"y" * 2_000)
        done["waited"] = time.monotonic() - t0

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.3)
    assert "key" not in done, "put did not block on a full store"
    s.free([big])
    t.join(5)
    assert done["waited"] >= 0.25 and s.get([done["key"]]) == [b"y" * 2_000]
    assert s.stats()["blocked_puts"] >= 1
    s.free([done["key"]])


@pytest.mark.parametrize("kind", ["inprocess", "local"])
def test_full_store_raises_after_timeout_and_oversize_at_once(kind, local_store):
    s = stores(local_store)[kind]
    k = s.put(b"x" * 9_000)
    t0 = time.monotonic()
    with pytest.raises(PixelStoreFull):
        s.put_batch([b"y" * 2_000], timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t0 < 3
    t0 = time.monotonic()
    with pytest.raises(PixelStoreFull, match="can never fit"):
        s.put(b"z" * 20_000)
    assert time.monotonic() - t0 < 1 if kind == "inprocess" else True
    s.free([k])


def test_local_store_restarts_after_kill_and_counts_missing():
    c = start_local_store(10_000, put_timeout_s=1.0)
    try:
        keys = c.put_batch([b"a", b"b"])
        os.kill(c.server.proc.pid, signal.SIGKILL)
        c.server.proc.wait(5)
        t0 = time.monotonic()
        assert c.get(keys) == [None, None]  # lost with the process; no hang
        assert time.monotonic() - t0 < 20
        assert c.server.restarts == 1
        assert c.count_missing(keys) == 2
        k = c.put(b"new")
        assert c.get([k]) == [b"new"]
        assert c.stats()["client_missing"] == 2
    finally:
        c.close()


def test_local_store_rejects_wrong_token_and_bad_bodies(local_store):
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", local_store.server.port, timeout=5)
    conn.request("GET", "/stats", headers={"X-PixelStore-Token": "wrong"})
    r = conn.getresponse()
    assert r.status == 401
    r.read()
    tok = local_store.server.token
    conn.request("POST", "/get", body=json.dumps({"keys": ["a"]}), headers={"X-PixelStore-Token": tok})
    r = conn.getresponse()
    assert r.status == 415  # a body without its declared type (a browser form) is not read
    r.read()
    conn.request("POST", "/get", body=json.dumps({"keys": [1, 2]}),
                 headers={"X-PixelStore-Token": tok, "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 400 and b"keys" in r.read()
    conn.request("POST", "/put_batch", body=b"\x00\x00\x00\x00\x00\x00\x00\x09ab",
                 headers={"X-PixelStore-Token": tok, "Content-Type": "application/octet-stream"})
    r = conn.getresponse()
    assert r.status == 400 and b"truncated" in r.read()
    assert local_store.stats()["items"] >= 0  # still serving


def test_local_client_pickles_to_an_endpoint(local_store):
    k = local_store.put(b"shared")
    other = pickle.loads(pickle.dumps(local_store))
    assert isinstance(other, LocalPixelStoreClient)
    assert other.get([k]) == [b"shared"]
    other.close()  # a copy does not own the server
    assert local_store.get([k]) == [b"shared"]
    local_store.free([k])


def test_frames_roundtrip_and_factory():
    items = [b"", b"abc", None, b"\x00" * 10]
    assert unpack_frames(pack_frames(items)) == items
    assert key_occurrences(["a", "b", "a"]) == {"a": 2, "b": 1}
    cfg = load_run_config(None, ["pixelstore.capacity_mb=1"]).pixelstore
    s = make_pixel_store(cfg, "inprocess", "t")
    assert s.capacity_bytes == 2**20
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_pixel_store(cfg, "slurm", "t")
