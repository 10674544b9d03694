"""Real Ray clusters started with `ray start` on this machine, for tests and benchmarks of joining a
cluster and of runs that span nodes.

`RayCluster` starts a head node and, optionally, a second node inside a Linux network namespace
joined to the host by a veth pair: the two nodes then have distinct node IPs, and the loopback
address of one is NOT the other (a role that dials 127.0.0.1 to reach the other node fails, as it
would across machines). Needs root for the namespace (`ip netns`, `ip link`).

Invariants: every process it starts runs under its own temp dir and free ports (no collision with
other Ray instances on the machine, no `ray stop`, which would end everyone's); `stop()` ends
exactly the processes it started (the `ray start --block` processes and their descendants, by pid)
and removes the namespace and the veth pair; the token file of its token authentication is its own.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncwebrl.net import LOOPBACK, free_port


@dataclass
class RayNode:
    ip: str
    resources: dict[str, float]
    proc: subprocess.Popen
    netns: str | None = None


@dataclass
class RayCluster:
    """`with RayCluster(...) as c:` then join it at `c.address` (token file `c.token_file`)."""

    head_resources: dict[str, float] = field(default_factory=dict)
    worker_resources: dict[str, float] | None = None
    """resources of a second node in a network namespace; None = a one-node cluster"""
    num_cpus: int = 2
    subnet: int = 0
    """third octet of the 10.231.X.0/24 veth subnet; 0 = the first one free on this host. Runs that share
    the host's network (two test runs, a CI job beside a session) must not share a subnet: the route
    would send one run's packets into the other's veth. A subnet is claimed by the veth's name, which the
    kernel keeps unique, so an explicit subnet already in use is an error, not a silent collision."""
    token_auth: bool = True
    start_niceness: int = 0
    """niceness of the Ray processes while they start (Ray gives a node 30 s to register with the GCS,
    which a crowded machine misses; < 0 needs root); everything is set back to 0 once the nodes are up"""
    start_timeout_s: float = 420.0
    nodes: list[RayNode] = field(default_factory=list)
    address: str = ""
    token_file: Path | None = None
    tmp: Path | None = None
    _netns: str | None = None
    _veth: str | None = None
    _launches: int = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> RayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
        # the machine is shared: Ray's memory monitor would kill our workers for others' memory use
        env.setdefault("RAY_memory_monitor_refresh_ms", "0")
        if self.token_auth and self.token_file is not None:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_file))
        else:
            env["RAY_AUTH_MODE"] = "disabled"
        return env

    def start(self) -> None:
        # short: Ray's unix socket paths live under the temp dir and must stay under 107 characters
        self.tmp = Path(tempfile.mkdtemp(prefix="awrl-ray-", dir="/tmp"))
        if self.token_auth:
            self.token_file = self.tmp / "token"
            self.token_file.write_text(secrets.token_hex(32))
            self.token_file.chmod(0o600)
        head_ip = LOOPBACK
        if self.worker_resources is not None:
            head_ip = self._make_netns()
        port = free_port(head_ip)
        self.address = f"{head_ip}:{port}"
        head_cmd = self._ray_start(head_ip, self.head_resources) + [
            "--head", "--port", str(port), "--temp-dir", str(self.tmp / "head"), "--include-dashboard=false",
            "--ray-client-server-port", str(free_port(head_ip)),
            "--dashboard-agent-listen-port", str(free_port(head_ip)),
        ]
        self._start_node(head_cmd, head_ip, self.head_resources, None, 1)
        if self.worker_resources is not None:
            ip = self._worker_ip
            cmd = ["ip", "netns", "exec", self._netns] + self._ray_start(ip, self.worker_resources) + [
                "--address", self.address, "--dashboard-agent-listen-port", "52365"]
            self._start_node(cmd, ip, self.worker_resources, self._netns, 2)
        if self.start_niceness:
            self._renice(0)

    def _renice(self, niceness: int) -> None:
        import psutil

        for node in self.nodes:
            try:
                root = psutil.Process(node.proc.pid)
                for p in [root] + root.children(recursive=True):
                    p.nice(niceness)
            except psutil.Error:
                pass

    def _start_node(self, cmd: list[str], ip: str, resources: dict[str, float], netns: str | None, n: int,
                    attempts: int = 8) -> None:
        """`ray start` one node and wait for the cluster to list n nodes; a start that dies (Ray gives a
        node 30 s to register, which a loaded machine can miss) is tried again."""
        for attempt in range(attempts):
            self._launch(cmd, ip, resources, netns)
            try:
                self._wait_nodes(n)
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.nodes.pop().proc.wait(30)

    def _ray_start(self, ip: str, resources: dict[str, float]) -> list[str]:
        ray_bin = str(Path(sys.executable).with_name("ray"))
        return [ray_bin, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(self.num_cpus),
                "--num-gpus", "0", "--resources", json.dumps(resources), "--disable-usage-stats",
                "--object-store-memory", str(256 * 2**20)]

    def _launch(self, cmd: list[str], ip: str, resources: dict[str, float], netns: str | None) -> None:
        self._launches += 1
        log = open(self.tmp / f"ray-start-{self._launches}-{ip}.log", "wb")  # noqa: SIM115 (the child owns it)
        try:
            niceness = self.start_niceness
            proc = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=(lambda: os.nice(niceness - os.nice(0))) if niceness else None)
        finally:
            log.close()
        self.nodes.append(RayNode(ip, resources, proc, netns))

    def _wait_nodes(self, n: int) -> None:
        """Until `ray status` against the head lists n alive nodes (raises with the logs if a start died)."""
        deadline = time.monotonic() + self.start_timeout_s
        ray_bin = str(Path(sys.executable).with_name("ray"))
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"`ray start` of node {node.ip} exited: {self.logs()}")
            try:
                out = subprocess.run([ray_bin, "status", "--address", self.address], env=self.env(),
                                     capture_output=True, text=True, timeout=max(10.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue  # a loaded machine: ask again until the deadline
            if out.returncode == 0 and out.stdout.count(" node_") >= n:
                return
            time.sleep(1.0)
        raise TimeoutError(f"Ray cluster at {self.address} has not {n} nodes after {self.start_timeout_s} s: {self.logs()}")

    def logs(self) -> str:
        if self.tmp is None:
            return ""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.tmp.glob("ray-start-*.log")))

    # -- the network namespace of the second node ---------------------------------------------
    def _make_netns(self) -> str:
        self._netns = f"awrl-{secrets.token_hex(3)}"
        r = subprocess.run(["ip", "netns", "add", self._netns], capture_output=True, text=True)
        if r.returncode != 0:
            self._netns = None
            raise RuntimeError(f"ip netns add failed ({r.returncode}): {r.stderr.strip()} "
                               "(the two-node cluster needs root for a network namespace)")
        self.subnet = self._claim_subnet()
        host_ip, self._worker_ip = f"10.231.{self.subnet}.1", f"10.231.{self.subnet}.2"
        for cmd in (
            ["ip", "addr", "add", f"{host_ip}/24", "dev", self._veth + "a"],
            ["ip", "link", "set", self._veth + "a", "up"],
            ["ip", "netns", "exec", self._netns, "ip", "addr", "add", f"{self._worker_ip}/24", "dev", self._veth + "b"],
            ["ip", "netns", "exec", self._netns, "ip", "link", "set", self._veth + "b", "up"],
            ["ip", "netns", "exec", self._netns, "ip", "link", "set", "lo", "up"],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return host_ip

    def _claim_subnet(self) -> int:
        """Create the veth pair named for its subnet (`awrl-s<X>a` here, `awrl-s<X>b` in the namespace):
        the kernel refuses a second link of that name, so two clusters never hold one subnet. Subnets
        that a route already covers (another tool's network) are skipped."""
        routed = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
        in_use = {int(m) for m in re.findall(r"^10\.231\.(\d+)\.0/24 ", routed, flags=re.M)}
        candidates = [self.subnet] if self.subnet else [x for x in range(1, 255) if x not in in_use]
        for x in candidates:
            if x in in_use:
                raise RuntimeError(f"subnet 10.231.{x}.0/24 is in use on this host (ip route: "
                                   f"{routed.strip()!r}); pass subnet=0 to take a free one")
            veth = f"awrl-s{x}"
            r = subprocess.run(["ip", "link", "add", veth + "a", "type", "veth", "peer", "name", veth + "b",
                                "netns", self._netns], capture_output=True, text=True)
            if r.returncode == 0:
                self._veth = veth
                return x
            if "exists" not in r.stderr:
                raise RuntimeError(f"ip link add {veth}a failed ({r.returncode}): {r.stderr.strip()}")
            if self.subnet:
                raise RuntimeError(f"subnet 10.231.{x}.0/24 is held by another cluster on this host "
                                   f"(link {veth}a exists); pass subnet=0 to take a free one")
        raise RuntimeError("no free 10.231.X.0/24 subnet on this host for the second node's veth pair")

    def stop(self) -> None:
        import psutil

        procs: list[psutil.Process] = []
        for node in reversed(self.nodes):
            try:
                root = psutil.Process(node.proc.pid)
                procs += [root] + root.children(recursive=True)
            except psutil.Error:
                pass
        if self._netns:  # everything in the second node's namespace is ours
            r = subprocess.run(["ip", "netns", "pids", self._netns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    p = psutil.Process(int(pid))
                    if p not in procs:
                        procs.append(p)
                except (psutil.Error, ValueError):
                    pass
        if self.tmp is not None:  # raylet workers re-parented away from their `ray start`: found by our temp dir
            mine = str(self.tmp)
            for p in psutil.process_iter(["pid", "cmdline"]):
                try:
                    if p.info["cmdline"] and any(mine in a for a in p.info["cmdline"]) and p not in procs:
                        procs.append(p)
                except psutil.Error:
                    pass
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        self.nodes.clear()
        if self._veth:
            subprocess.run(["ip", "link", "del", self._veth + "a"], capture_output=True)
            self._veth = None
        if self._netns:
            subprocess.run(["ip", "netns", "del", self._netns], capture_output=True)
            self._netns = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
