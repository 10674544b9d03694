"""One contract, every PixelStore: the in-process store (scheduler=local, evaluation) and the Ray
client over per-node actors (scheduler=ray) put, get, retain, free and bound memory the same way
(asyncwebrl/pixelstore/base.py states the contract)."""

from __future__ import annotations

import threading
import time

import pytest

from asyncwebrl.pixelstore.base import PixelStore, PixelStoreFull
from asyncwebrl.pixelstore.store import InProcessPixelStore

CAPACITY = 10_000
IMPLEMENTATIONS = ["inprocess", pytest.param("ray", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(params=IMPLEMENTATIONS)
def store(request):
    if request.param == "inprocess":
        s: PixelStore = InProcessPixelStore("mem", CAPACITY, put_timeout_s=2.0)
    else:
        request.getfixturevalue("ray_session")
        from asyncwebrl.pixelstore.ray_store import PixelStoreClient, launch_ray_stores

        name = f"contract-{request.node.name}".replace("[", "-").replace("]", "")
        s = PixelStoreClient(name, launch_ray_stores(name, CAPACITY, 2.0), put_timeout_s=2.0)
    yield s
    s.close()


def test_is_a_pixel_store(store):
    assert isinstance(store, PixelStore)


def test_put_get_roundtrip_in_order_and_missing_is_none(store):
    a, b = store.put_batch([b"A" * 100, bytearray(b"B" * 50)])
    c = store.put(b"C")
    prefix = a.split(":")[0]
    assert len({a, b, c}) == 3 and all(k.startswith(prefix + ":") for k in (b, c))
    assert store.get([b, a, f"{prefix}:nope", c, "other:x"]) == [b"B" * 50, b"A" * 100, None, b"C", None]
    assert store.count_missing([a, f"{prefix}:nope", "other:x"]) == 2
    assert store.stats()["missing"] >= 1


def test_refcounts_retain_and_free(store):
    a = store.put(b"shot", refs=2)  # two samples use it at put time
    assert store.retain([a, a]) == 2  # two more (a history window reused it twice)
    assert store.retain([f"{a.split(':')[0]}:gone"]) == 0
    for _ in range(3):
        assert store.free([a]) == 0
        assert store.get([a]) == [b"shot"]
    assert store.free([a]) == 1  # the last reference removes it
    assert store.get([a]) == [None]
    assert store.free([a]) == 0 and store.retain([a]) == 0  # gone keys are skipped, not errors
    b, c = store.put_batch([b"b", b"c"])
    assert store.free([b, c, b]) == 2
    st = store.stats()
    assert st["items"] == 0 and st["bytes"] == 0 and st["frees"] >= 3 and st["puts"] >= 3


def test_bad_inputs_are_refused(store):
    with pytest.raises(ValueError, match="not a PixelStore key"):
        store.get(["no-prefix"])
    with pytest.raises(ValueError, match="not a PixelStore key"):
        store.free(["no-prefix"])
    with pytest.raises(ValueError, match="refs"):
        store.put(b"x", refs=0)
    with pytest.raises(TypeError, match="bytes"):
        store.put_batch([b"ok", "text"])
    assert store.stats()["items"] == 0  # all or nothing


def test_full_store_blocks_then_proceeds_after_free(store):
    big = store.put(b"x" * 9_000)
    done: dict = {}

    def writer():
        done["key"] = store.put(b"y" * 2_000)

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 10
    while store.stats()["blocked_puts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats()["blocked_puts"] >= 1 and "key" not in done, "put did not wait for room"
    store.free([big])
    t.join(10)
    assert store.get([done["key"]]) == [b"y" * 2_000]
    assert store.stats()["bytes"] == 2_000


def test_full_store_raises_after_timeout_and_oversize_at_once(store):
    k = store.put(b"x" * 9_000)
    t0 = time.monotonic()
    with pytest.raises(PixelStoreFull):
        store.put_batch([b"y" * 2_000], timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t0
    with pytest.raises(PixelStoreFull, match="can never fit"):
        store.put(b"z" * (CAPACITY + 1))
    assert store.get([k]) == [b"x" * 9_000]  # a refused put touches nothing
    assert store.stats()["items"] == 1
