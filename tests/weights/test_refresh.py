"""The one refresh bracket against real embedded inference servers over gloo: the servers see pause,
the update session and continue in order; flat buckets land bit-exactly on two servers (one
announcement per refresh, and SGLang's one-request-per-bucket form); a refused announcement, an
absent or a dead server is a prompt error that leaves the old weights serving."""

from __future__ import annotations

import time

import pytest
import torch

from asyncwebrl.inference.engine import params_checksum
from asyncwebrl.models.vlm import load_model
from asyncwebrl.scheduling.servers import free_port, launch_server
from asyncwebrl.weights.bracket import RefreshBracket
from asyncwebrl.weights.control import ControlChannel
from asyncwebrl.weights.group import WeightSyncError
from asyncwebrl.weights.sender import WeightSender
from asyncwebrl.weights.version import PolicyVersion

pytestmark = pytest.mark.slow
TIMEOUT_S = 30
KEY = "weights-refresh-test-key"


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("srv")
    procs = [launch_server(model=tiny, log_path=logs / f"s{i}.log", weight_sync_timeout_s=TIMEOUT_S, wait=False,
                           api_key=KEY) for i in range(2)]
    from asyncwebrl.scheduling.servers import wait_healthy

    try:
        for p in procs:
            wait_healthy(p.address, 300, proc=p, api_key=KEY)
        yield [p.address for p in procs]
    finally:
        for p in procs:
            p.stop()


def perturbed(tiny: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    model = load_model(tiny, "float32", "cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return [(n, p.detach()) for n, p in model.named_parameters()]


class RecordingGate:
    """The rollout side's three calls, recorded (the bracket's gate is a RolloutController in a run),
    with the version's owner it reads."""

    def __init__(self, start: int = 0):
        self.events: list[tuple] = []
        self.clock = PolicyVersion(start)

    def pause(self):
        self.events.append(("pause",))

    def resume(self):
        self.events.append(("resume",))

    def publish_version(self):
        self.events.append(("publish_version", self.clock.value))


def info(control: ControlChannel, server: str) -> dict:
    return control.run(control.acall(server, "/server_info", None, method="GET"))


def get(control: ControlChannel, server: str, path: str) -> dict:
    return control.run(control.acall(server, path, None, method="GET"))


@pytest.mark.parametrize("announce_once", [True, False], ids=["one-announcement", "per-bucket"])
def test_bracket_tells_servers_in_order_and_lands_bit_exact_on_two(servers, tiny, announce_once):
    named = perturbed(tiny, seed=1 if announce_once else 2)
    version = 5 if announce_once else 6
    sender = WeightSender(servers, KEY, bucket_mb=1, timeout_s=TIMEOUT_S, announce_once=announce_once)
    control = ControlChannel(servers, KEY, TIMEOUT_S)
    gate = RecordingGate(start=version - 1)
    try:
        sender.init_group()
        marks = [len(info(control, s)["control_events"]) for s in servers]
        report, transfer = RefreshBracket(gate, control, "in_place").refresh(lambda: sender.transfer(named))
        want = params_checksum(named)
        for s, mark in zip(servers, marks, strict=True):
            served = get(control, s, "/weights_checksum")
            assert served["sha256"] == want and served["weight_version"] == str(version)
            events = info(control, s)["control_events"][mark:]
            n_updates = events.count("/update_weights_from_distributed")
            assert n_updates == (1 if announce_once else transfer.n_buckets)
            assert events[:2] == ["/pause_generation", "/begin_weight_update"]
            assert set(events[2 + n_updates:-1]) == {"/end_weight_update", "/update_weight_version"}
            assert events[-1] == "/continue_generation"
        assert transfer.n_buckets > 1 and transfer.n_tensors == len(named)
        assert report.n_buckets == transfer.n_buckets and report.bytes == transfer.bytes
        assert gate.events == [("pause",), ("publish_version", version), ("resume",)]
        assert gate.clock.value == version and report.version == version
        assert report.metrics()["sync_transfer_s"] > 0 and report.total_s >= report.transfer_s
    finally:
        sender.close()
        control.close()
    for s in servers:  # close() tore the group down on the servers
        c = ControlChannel([s], KEY, TIMEOUT_S)
        try:
            assert info(c, s)["weight_update_groups"] == []
        finally:
            c.close()


def test_refused_announcement_is_prompt_and_old_weights_keep_serving(servers, tiny):
    control = ControlChannel(servers, KEY, TIMEOUT_S)
    sender = WeightSender(servers[:1], KEY, bucket_mb=1, timeout_s=TIMEOUT_S)
    gate = RecordingGate(start=8)
    try:
        before = get(control, servers[0], "/weights_checksum")
        sender.init_group()
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="unknown parameter"):
            RefreshBracket(gate, control).refresh(lambda: sender.transfer([("no.such.parameter", torch.ones(4))]))
        assert time.monotonic() - t0 < TIMEOUT_S
        assert gate.events == [("pause",), ("resume",)] and gate.clock.value == 8  # no version moved
        after = get(control, servers[0], "/weights_checksum")
        assert after == before
        assert info(control, servers[0])["control_events"][-1] == "/continue_generation"
        assert info(control, servers[0])["paused"] is False
        with pytest.raises(WeightSyncError, match="init_group"):  # a broken group is never reused
            sender.transfer([("x", torch.ones(1))])
    finally:
        sender.close()
        control.close()


def test_unreachable_server_fails_init_quickly():
    sender = WeightSender([f"http://127.0.0.1:{free_port()}"], None, timeout_s=8)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="failed to join|failed"):
        sender.init_group()
    assert time.monotonic() - t0 < 20
    sender.close()


def test_dead_server_is_an_error_within_the_timeout(tiny, tmp_path):
    srv = launch_server(model=tiny, log_path=tmp_path / "s.log", weight_sync_timeout_s=8, api_key=KEY)
    sender = WeightSender([srv.address], KEY, bucket_mb=1, timeout_s=8)
    try:
        named = perturbed(tiny, seed=3)
        sender.init_group()
        srv.proc.kill()
        srv.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.transfer(named)
        assert time.monotonic() - t0 < 8 + 15
    finally:
        sender.close()
        srv.stop()
