"""The refresh against SGLang's OWN server code (`sglang_standin.py`: the released wheel's routes,
request structs, tokenizer- and scheduler-level update rules and weight updater, run unchanged),
over gloo on CPU, with the receiving side on SGLang's torch (the `make sglang-venv` venv, torch
2.14.1) and our sender on ours: every pause mode with requests held, the disk path, a transfer
outside an update session, and an injected failure at each bracket step all end with one version
meaning one set of weights. The wheel and the venv come from `make setup`."""

from __future__ import annotations

import glob
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from asyncwebrl.weights.bracket import RefreshBracket, StaleServers
from asyncwebrl.weights.control import ControlChannel
from asyncwebrl.weights.group import WeightSyncError
from asyncwebrl.weights.sender import WeightSender
from asyncwebrl.weights.version import PolicyVersion

SGLANG_VERSION = "0.5.23"
SGLANG_TORCH = "2.14.1"
CACHE = Path.home() / ".cache" / "asyncwebrl"
WHEEL_DIR = Path(os.environ.get("ASYNCWEBRL_SGLANG_WHEEL_DIR", CACHE / "sglang-wheel"))
VENV = Path(os.environ.get("ASYNCWEBRL_SGLANG_VENV", CACHE / "sglang-venv"))
TIMEOUT_S = 30


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(300, 32, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(96, 32, generator=g),
            "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).to(torch.float16),
            "lm_head.weight": torch.randn(300, 32, generator=g).to(torch.bfloat16)}


def checksum(named: dict[str, torch.Tensor]) -> str:
    """What the stand-in reports for these weights (sha256 over sorted names, dtype and bytes)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(bytes(t.clone().view(-1).view(torch.uint8).untyped_storage()))
    return h.hexdigest()


@pytest.fixture(scope="module")
def wheel() -> str:
    found = sorted(glob.glob(str(WHEEL_DIR / f"sglang-{SGLANG_VERSION}-*.whl")))
    if not found:
        pytest.fail(f"no sglang-{SGLANG_VERSION} wheel in {WHEEL_DIR}: run `make setup` (it downloads it, no install)")
    return found[-1]


@pytest.fixture(scope="module")
def sglang_python() -> str:
    py = VENV / "bin" / "python"
    if not py.exists():
        pytest.fail(f"no SGLang test venv at {VENV}: run `make setup` (target sglang-venv)")
    return str(py)


class Standin:
    """One stand-in SGLang server process and a control channel to it."""

    def __init__(self, python: str, wheel: str, tmp: Path, start: dict[str, torch.Tensor]):
        from safetensors.torch import save_file

        tmp.mkdir(parents=True, exist_ok=True)
        save_file(start, str(tmp / "start.safetensors"))
        self.portfile = tmp / "port"
        self.log_path = tmp / "standin.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("sglang_standin.py")), wheel,
                                      str(self.portfile), str(tmp / "start.safetensors")],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 120
        while not self.portfile.exists():
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the SGLang stand-in did not start"
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.portfile.read_text()}"
        self.control = ControlChannel([self.url], None, TIMEOUT_S)

    def call(self, path: str, body: dict | None = None, method: str = "POST") -> dict:
        c = self.control
        return c.run(c.acall(self.url, path, body, method=method))

    def state(self) -> dict:
        return self.call("/_test/state", None, "GET")

    def stop(self) -> None:
        self.control.close()
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture()
def standins(sglang_python, wheel, tmp_path):
    made: list[Standin] = []

    def make(n: int = 1, start: dict[str, torch.Tensor] | None = None) -> list[Standin]:
        for _ in range(n):
            made.append(Standin(sglang_python, wheel, tmp_path / f"s{len(made)}", start or weights(0)))
        return made[-n:]
    try:
        yield make
    finally:
        for s in made:
            s.stop()


def bracket_for(servers: list[Standin], mode: str, start: int) -> RefreshBracket:
    return RefreshBracket(None, ControlChannel([s.url for s in servers], None, TIMEOUT_S), mode,
                          clock=PolicyVersion(start))


def one_meaning(servers: list[Standin], clock: PolicyVersion, sums: dict[int, str], stale: set[str] = frozenset()):
    """Every server serves the weights its version names; a stale one is paused (serves nothing)."""
    for s in servers:
        st = s.state()
        if s.url in stale:
            assert st["paused"] and st["engine_paused"], st
            continue
        assert not st["paused"] and not st["session_open"], st
        label = "default" if clock.value == 0 else str(clock.value)  # SGLang's before any update
        assert st["weight_version"] == label == st["scheduler_weight_version"], st
        assert st["checksum"] == sums[clock.value], f"{s.url} serves other weights than version {clock.value}"


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_refresh_with_held_requests_in_every_pause_mode(standins, mode):
    servers = standins(2)
    for s in servers:
        s.call("/_test/running", {"n": 2, "rid": "held"})
    new = weights(1)
    bracket = bracket_for(servers, mode, start=4)
    sender = WeightSender([s.url for s in servers], None, bucket_mb=0.02, timeout_s=TIMEOUT_S)
    try:
        assert sender.master_port == 0
        sender.init_group()  # our rendezvous (torch 2.13) meets SGLang's init_custom_process_group (torch 2.14)
        assert sender.announce_once is False  # /server_info read with GET: SGLang answers POST with 405
        report, transfer = bracket.refresh(lambda: sender.transfer(new))
        assert transfer.n_buckets >= 3 and report.version == 5
    finally:
        sender.close()
        bracket.control.close()
    one_meaning(servers, bracket.clock, {5: checksum(new)})
    for s in servers:
        st = s.state()
        assert st["torch"].startswith(SGLANG_TORCH) and torch.__version__.split("+")[0] != SGLANG_TORCH
        assert st["groups"] == []  # close() destroyed the group on the server
        if mode == "in_place":  # held in the running batch, not aborted by the version update
            assert len(st["running"]) == 2 and st["flushes"] == 0
        elif mode == "retract":  # back in the waiting queue, the old weights' cache flushed
            assert len(st["waiting"]) == 2 and st["flushes"] == 1
        else:
            assert st["running"] == st["waiting"] == [] and st["flushes"] == 1


def test_disk_refresh_with_held_requests(standins, tmp_path):
    from safetensors.torch import save_file

    servers = standins(1)
    servers[0].call("/_test/running", {"n": 2})
    new = weights(2)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(new, str(ckpt / "model.safetensors"))
    bracket = bracket_for(servers, "in_place", start=0)
    try:
        bracket.refresh(bracket.disk_transfer(str(ckpt)))
    finally:
        bracket.control.close()
    one_meaning(servers, bracket.clock, {1: checksum(new)})
    assert len(servers[0].state()["running"]) == 2


def test_transfer_outside_an_update_session_is_refused_and_the_group_torn_down(standins):
    (server,) = standins(1)
    sender = WeightSender([server.url], None, bucket_mb=0.02, timeout_s=TIMEOUT_S)
    try:
        sender.init_group()
        with pytest.raises(WeightSyncError, match="begin_weight_update"):
            sender.transfer(weights(3))
        assert sender.broken and server.state()["groups"] == [sender.group_name]
    finally:
        sender.close()
    assert server.state()["groups"] == []  # a refused transfer does not leave the group on the server
    assert server.state()["checksum"] == checksum(weights(0))


FINISH = ["/end_weight_update", "/flush_cache", "/update_weight_version"]
BEFORE = ["/pause_generation", "/begin_weight_update", "/update_weights_from_distributed"]


@pytest.mark.parametrize("step", BEFORE + FINISH + ["/continue_generation"])
@pytest.mark.parametrize("times", [1, 99], ids=["once", "always"])
def test_injected_failure_at_each_step_keeps_one_version_one_set_of_weights(standins, step, times):
    servers = standins(2)
    sums = {0: checksum(weights(0)), 1: checksum(weights(1)), 2: checksum(weights(2))}
    bracket = bracket_for(servers, "retract", start=0)
    sender = WeightSender([s.url for s in servers], None, bucket_mb=0.02, timeout_s=10)
    try:
        sender.init_group()
        # the transfer is refused by every server (one server refusing leaves the others blocked in
        # a broadcast nobody sends until the group's timeout, in SGLang as here)
        for s in (servers if step == "/update_weights_from_distributed" else servers[1:]):
            s.call("/_test/fail", {"route": step, "times": times})
        try:
            bracket.refresh(lambda: sender.transfer(weights(1)))
            failed = None
        except WeightSyncError as e:
            failed = e
        stale = set(bracket.stale)
        if step in FINISH and times == 1:  # retried
            assert failed is None and bracket.clock.value == 1
        elif step in FINISH:
            assert isinstance(failed, StaleServers) and stale == {servers[1].url}
            assert bracket.clock.value == 1  # the weights landed everywhere: the version names them
        elif step == "/continue_generation":
            assert (failed is None) == (times == 1) and bracket.clock.value == 1
        else:
            assert failed is not None and bracket.clock.value == 0  # old weights, old version
        if step == "/continue_generation" and times > 1:
            stale = {servers[1].url}  # it was told to continue and did not: still paused
        one_meaning(servers, bracket.clock, sums, stale)
        # the next refresh brings every server back to one version, one set of weights
        for s in servers:
            s.call("/_test/fail", {"route": step, "times": 0})
        if sender.broken:
            sender.close()
            sender = WeightSender([s.url for s in servers], None, bucket_mb=0.02, timeout_s=10)
            sender.init_group()
        target = bracket.clock.value + 1
        bracket.refresh(lambda: sender.transfer(weights(target)))
        one_meaning(servers, bracket.clock, sums)
    finally:
        sender.close()
        bracket.control.close()
