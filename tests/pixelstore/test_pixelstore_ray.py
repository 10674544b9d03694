"""The PixelStore as named, restartable Ray actors: API, back-pressure, actor death mid-run."""

from __future__ import annotations

import os
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from asyncwebrl.pixelstore.base import PixelStoreFull, PixelStoreUnavailable  # noqa: E402
from asyncwebrl.pixelstore.ray_store import PixelStoreClient, actor_name, launch_ray_stores  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_named_per_run_routed_by_node_prefix(ray_session):
    handles = launch_ray_stores("runA", 10_000, 1.0)
    c = PixelStoreClient("runA", handles, put_timeout_s=1.0)
    try:
        (prefix,) = handles
        assert ray.get_actor(actor_name("runA", prefix)) is not None
        keys = c.put_batch([b"one", b"two"])
        assert all(k.startswith(prefix + ":") for k in keys)
        assert c.get(keys + ["nzzz:1"]) == [b"one", b"two", None]

        @ray.remote(num_cpus=0)
        def worker_side(client, ks):
            return client.get(ks), client.put(b"from a worker")

        got, k3 = ray.get(worker_side.remote(c, keys), timeout=60)
        assert got == [b"one", b"two"] and c.get([k3]) == [b"from a worker"]
        assert c.retain([k3]) == 1 and c.free([k3]) == 0 and c.free([k3]) == 1
        assert c.count_missing(keys + [k3]) == 1
        st = c.stats()
        assert st["items"] == 2 and st["bytes"] == 6 and st["stores"][prefix]["puts"] == 3
        # a second run gets its own store
        other = PixelStoreClient("runB", launch_ray_stores("runB", 10_000, 1.0))
        assert other.get(keys) == [None, None]
        other.kill_all()
    finally:
        c.kill_all()


def test_back_pressure_through_the_actor(ray_session):
    handles = launch_ray_stores("runBP", 10_000, 5.0)
    c = PixelStoreClient("runBP", handles, put_timeout_s=5.0)
    try:
        big = c.put(b"x" * 9_000)
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("k", c.put(b"y" * 5_000)))
        t.start()
        time.sleep(0.5)
        assert "k" not in done
        c.free([big])
        t.join(10)
        assert c.get([done["k"]]) == [b"y" * 5_000]
        with pytest.raises(PixelStoreFull):
            c.put_batch([b"z" * 9_000], timeout_s=0.3)
    finally:
        c.kill_all()


def test_killed_actor_restarts_missing_counted_no_hang(ray_session):
    handles = launch_ray_stores("runKill", 1 << 20, 2.0)
    c = PixelStoreClient("runKill", handles, put_timeout_s=2.0, retry_deadline_s=60)
    (prefix,) = handles
    errors: list[Exception] = []
    put_keys: list[str] = []
    stop = threading.Event()

    def rollout_side():  # keeps putting screenshots while the actor dies under it
        while not stop.is_set():
            try:
                put_keys.append(c.put(os.urandom(500)))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            time.sleep(0.01)

    t = threading.Thread(target=rollout_side)
    t.start()
    try:
        time.sleep(0.5)
        before = list(put_keys)
        pid = ray.get(handles[prefix].__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        os.kill(pid, 9)
        t0 = time.monotonic()
        got = c.get(before)  # the trainer's fetch: retried after the restart, never hangs
        assert time.monotonic() - t0 < 60
        lost = sum(v is None for v in got)
        assert lost == len(before) > 0
        # Keys put between the snapshot and the kill died with the old actor; only puts that start
        # after the fetch saw the new actor must land. Wait for three of them (bounded), then check.
        restarted_at = len(put_keys)
        deadline = time.monotonic() + 60
        while len(put_keys) < restarted_at + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        t.join(70)
        after = put_keys[restarted_at + 1:]  # +1: a put in flight across the restart may be either
        assert len(after) >= 3, f"puts did not resume after the restart ({len(after)} in 60 s)"
        assert all(v is not None for v in c.get(after[-3:]))  # puts resumed on the new actor
        st = c.stats()
        assert st["missing"] >= lost and c.missing_seen >= lost
        assert c.retries >= 1
        assert not [e for e in errors if not isinstance(e, PixelStoreUnavailable)]
    finally:
        stop.set()
        t.join(5)
        c.kill_all()


def test_bad_input_is_a_clear_error_not_a_retry_loop(ray_session):
    handles = launch_ray_stores("runBad", 10_000, 1.0)
    c = PixelStoreClient("runBad", handles, retry_deadline_s=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError):
            c.put(b"x", refs=0)
        with pytest.raises(TypeError):
            c.put_batch(["not bytes"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="not a PixelStore key"):
            c.get(["no-prefix"])
        assert time.monotonic() - t0 < 5
    finally:
        c.kill_all()
