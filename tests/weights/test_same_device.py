"""The same-device refresh (trainer and server on one device, no network): SGLang's
/update_weights_from_tensor with handles to the trainer's flat buckets, against a real embedded
server. On a CPU the handles are shared-memory segments. The weights land bit-exactly, inside the one
refresh bracket (pause, session, update, version, continue); a payload the server must not trust, or
one that does not fit, is refused with the old weights and version still serving."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch

from asyncwebrl.inference.engine import params_checksum
from asyncwebrl.models.vlm import load_model
from asyncwebrl.scheduling.servers import launch_server, wait_healthy
from asyncwebrl.weights import ipc
from asyncwebrl.weights.bracket import RefreshBracket
from asyncwebrl.weights.control import ControlChannel
from asyncwebrl.weights.group import WeightSyncError
from asyncwebrl.weights.version import PolicyVersion

pytestmark = pytest.mark.slow
TIMEOUT_S = 30
KEY = "same-device-test-key"


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    p = launch_server(model=tiny, log_path=tmp_path_factory.mktemp("srv") / "s.log", weight_sync_timeout_s=TIMEOUT_S,
                      wait=False, api_key=KEY)
    try:
        wait_healthy(p.address, 300, proc=p, api_key=KEY)
        yield p.address
    finally:
        p.stop()


class Gate:
    def __init__(self, start: int):
        self.events: list[tuple] = []
        self.clock = PolicyVersion(start)

    def pause(self):
        self.events.append(("pause",))

    def resume(self):
        self.events.append(("resume",))

    def publish_version(self):
        self.events.append(("publish_version", self.clock.value))


def perturbed(tiny: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    model = load_model(tiny, "float32", "cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def get(control: ControlChannel, server: str, path: str) -> dict:
    return control.run(control.acall(server, path, None, method="GET"))


def test_same_device_refresh_is_bit_exact_inside_the_bracket(server, tiny):
    named = perturbed(tiny, seed=3)
    sender = ipc.SameDeviceSender(server, KEY, bucket_mb=1, timeout_s=TIMEOUT_S)
    control = ControlChannel([server], KEY, TIMEOUT_S)
    gate = Gate(start=2)
    try:
        sender.init_group()
        mark = len(get(control, server, "/server_info")["control_events"])
        report, transfer = RefreshBracket(gate, control, "in_place").refresh(lambda: sender.transfer(named))
        served = get(control, server, "/weights_checksum")
        assert served["sha256"] == params_checksum(named) and served["weight_version"] == "3"
        events = get(control, server, "/server_info")["control_events"][mark:]
        n = events.count("/update_weights_from_tensor")
        assert n == transfer.n_buckets > 1  # one update per flat bucket, no broadcast group
        assert events[:2] == ["/pause_generation", "/begin_weight_update"]
        assert events[2:2 + n] == ["/update_weights_from_tensor"] * n
        assert set(events[2 + n:-1]) == {"/end_weight_update", "/update_weight_version"}
        assert events[-1] == "/continue_generation"
        assert gate.events == [("pause",), ("publish_version", 3), ("resume",)]
        assert report.bytes == transfer.bytes == sum(t.numel() * t.element_size() for _, t in named)
        # where the transfer went: the trainer's packing and the server's map / copy, each inside its
        # time (they overlap: bucket k+1 is packed while the server copies bucket k)
        server_s = transfer.server.map_s + transfer.server.hold_s + transfer.server.copy_s
        assert transfer.pack_s > 0 and transfer.server.copy_s > 0 and transfer.server.map_s > 0
        assert transfer.pack_s <= transfer.seconds and server_s <= transfer.seconds
        # a second refresh reuses the two shared buffers (the server has their handles cached)
        named2 = perturbed(tiny, seed=4)
        RefreshBracket(gate, control, "in_place").refresh(lambda: sender.transfer(named2))
        assert get(control, server, "/weights_checksum")["sha256"] == params_checksum(named2)
    finally:
        sender.close()
        control.close()


def test_resident_parameters_land_in_one_call_and_the_server_keeps_their_handles(server, tiny):
    """A single rank hands over its parameters' own memory: one update call, no packing. The server keeps
    the mapping, so the next refresh resends the same payload and the server copies what the memory
    holds now (the optimizer changed it in place), mapping nothing."""
    named = perturbed(tiny, seed=5)
    sender = ipc.SameDeviceSender(server, KEY, timeout_s=TIMEOUT_S)
    control = ControlChannel([server], KEY, TIMEOUT_S)
    gate = Gate(start=20)
    try:
        sender.init_group()
        mark = len(get(control, server, "/server_info")["control_events"])
        _, first = RefreshBracket(gate, control, "in_place").refresh(lambda: sender.transfer(named, resident=True))
        events = get(control, server, "/server_info")["control_events"][mark:]
        assert events.count("/update_weights_from_tensor") == first.n_buckets == 1
        assert first.resent == 0 and sender.server_keeps_handles
        assert get(control, server, "/weights_checksum")["sha256"] == params_checksum(named)
        with torch.no_grad():  # an optimizer step: the same memory, new values
            for _, t in named:
                t.mul_(0.5).add_(0.01)
        _, again = RefreshBracket(gate, control, "in_place").refresh(lambda: sender.transfer(named, resident=True))
        served = get(control, server, "/weights_checksum")
        assert served["sha256"] == params_checksum(named) and served["weight_version"] == "22"
        assert again.resent == 1 and again.server.map_s < first.server.map_s
    finally:
        sender.close()
        control.close()


def test_a_bucket_payload_is_resent_only_to_a_server_that_keeps_handles(server, tiny):
    """SGLang maps every payload anew (and counts each opening against the sender's memory), so a sender
    resends a payload string only after the server said it keeps the mapping."""
    named = perturbed(tiny, seed=6)
    sender = ipc.SameDeviceSender(server, KEY, bucket_mb=1, timeout_s=TIMEOUT_S)
    control = ControlChannel([server], KEY, TIMEOUT_S)
    try:
        sender.init_group()
        assert not sender.server_keeps_handles  # nothing heard yet: every payload is fresh
        _, first = RefreshBracket(Gate(30), control, "in_place").refresh(lambda: sender.transfer(named))
        assert first.resent == 0 and sender.server_keeps_handles
        named2 = perturbed(tiny, seed=7)  # other tensors, packed into the same two buffers
        _, again = RefreshBracket(Gate(31), control, "in_place").refresh(lambda: sender.transfer(named2))
        assert again.resent == again.n_buckets > 1
        assert get(control, server, "/weights_checksum")["sha256"] == params_checksum(named2)
    finally:
        sender.close()
        control.close()


def test_unfit_or_untrusted_payload_is_refused_and_old_weights_serve(server, tiny):
    control = ControlChannel([server], KEY, TIMEOUT_S)
    sender = ipc.SameDeviceSender(server, KEY, bucket_mb=1, timeout_s=TIMEOUT_S)
    gate = Gate(start=10)
    try:
        before = get(control, server, "/weights_checksum")
        sender.init_group()
        with pytest.raises(WeightSyncError, match="unknown parameter"):
            RefreshBracket(gate, control).refresh(lambda: sender.transfer([("no.such.parameter", torch.ones(4))]))
        assert gate.clock.value == 10 and gate.events == [("pause",), ("resume",)]
        assert get(control, server, "/weights_checksum") == before

        # a pickle naming any other global (here os.system) is refused before it runs
        class Evil:
            def __reduce__(self):
                import os

                return os.system, ("true",)

        evil = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
        control.call_all("/begin_weight_update", {})
        try:
            with pytest.raises(WeightSyncError, match="refused global"):
                control.call_all("/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
        finally:
            control.call_all("/end_weight_update", {})
        assert get(control, server, "/weights_checksum") == before
    finally:
        sender.close()
        control.close()


def test_payload_names_sglangs_metadata_class():
    """A real SGLang server unpickles the same bytes: the metadata travels under its class's name."""
    flat = torch.arange(8, dtype=torch.uint8)
    ipc.share_cpu_memory()
    flat.share_memory_()
    meta = [ipc.FlatTensorMeta("w", torch.Size([2, 2]), torch.int16, 0, 8, 8)]
    raw = base64.b64decode(ipc.serialize({"flattened_tensor": flat, "metadata": meta}))
    assert b"sglang.srt.weight_sync.tensor_bucket" in raw and b"FlattenedTensorMetadata" in raw
    named = ipc.named_tensors(ipc.deserialize(raw), "flattened_bucket")
    assert named[0][0] == "w" and torch.equal(named[0][1], flat.view(torch.int16).reshape(2, 2))
