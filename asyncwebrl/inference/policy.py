"""Who may do what on one inference server: its key and key scope, the Host names it serves, the
folders it may load weights from, the trainer hosts it may dial, and its body limits — and how a
server started from the command line gets them (flags, environment, a 0600 key file).

Invariants: a policy always holds a key (a fresh random one when none is given); the control
endpoints (`protocol.CONTROL_ENDPOINTS`) always need it; a key never comes from argv unless a person
typed `--api-key` (launchers use $ASYNCWEBRL_API_KEY); a disk path is judged by its real path (links
resolved) against the real paths of the roots; a trainer host is judged by every address it resolves to.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from asyncwebrl import httpguard, net
from asyncwebrl.protocol import CONTROL_ENDPOINTS, ProtocolError

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Does binding `host` listen on loopback only?"""
    addrs = httpguard.resolve_all(host)
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)
KEY_ENV = "ASYNCWEBRL_API_KEY"
WEIGHT_ROOTS_ENV = "ASYNCWEBRL_WEIGHTS_ROOTS"
TRAINER_ADDRESSES_ENV = "ASYNCWEBRL_TRAINER_ADDRESSES"
LOOPBACK = (net.LOOPBACK, "::1", "localhost")


@dataclass
class ServerPolicy:
    """Who may do what on one server (see the module docstring)."""

    api_key: str = field(default_factory=httpguard.new_key, repr=False)
    """the credential; control endpoints always need it"""
    key_scope: str = "control"
    """'control': only control endpoints need the key; 'all': every endpoint but /health"""
    host_names: set[str] = field(default_factory=httpguard.served_names)
    """Host header names served besides IP literals"""
    weight_roots: list[str] = field(default_factory=list)
    """update_weights_from_disk loads only from folders under these (none: refuses every disk load)"""
    trainer_addresses: list[str] = field(default_factory=lambda: list(LOOPBACK))
    """init_weights_update_group dials only these hosts (names are resolved on both sides)"""
    max_body_bytes: int = 32 * 2**20
    """largest /generate body"""
    max_control_body_bytes: int = 2**20
    """largest body of any other endpoint"""

    def needs_key(self, path: str) -> bool:
        if path in ("/health", "/health_generate"):
            return False
        return self.key_scope == "all" or path in CONTROL_ENDPOINTS

    def check_weight_path(self, path: str) -> None:
        if not self.weight_roots:
            raise ProtocolError("this server loads weights from disk only under its weight roots, and none is "
                                f"configured (--weights-root / ${WEIGHT_ROOTS_ENV})")
        real = os.path.realpath(path)
        for root in self.weight_roots:
            r = os.path.realpath(root)
            if real == r or real.startswith(r.rstrip(os.sep) + os.sep):
                return
        raise ProtocolError(f"model_path '{path}' is outside the server's weight roots")

    def check_trainer_address(self, host: str) -> None:
        got = httpguard.resolve_all(host)
        allowed: set[str] = set()
        for a in self.trainer_addresses:
            allowed |= httpguard.resolve_all(a)
        if not got or not got <= allowed:
            raise ProtocolError(f"master_address '{host}' is not a trainer address this server may dial "
                                f"(--trainer-address / ${TRAINER_ADDRESSES_ENV})")


def policy_from_args(args: argparse.Namespace, port: int) -> tuple[ServerPolicy, str | None]:
    """The server's policy from its flags and environment; also the key file written (if any).
    Key: --api-key-file, else $ASYNCWEBRL_API_KEY, else --api-key (argv: visible to every local user,
    for hand use only), else a fresh one written to a 0600 file."""
    key_file = getattr(args, "api_key_file", None)
    key = None
    if key_file:
        key = httpguard.read_key_file(key_file)
    elif os.environ.get(KEY_ENV):
        key = os.environ[KEY_ENV]
    elif getattr(args, "api_key", None):
        log.warning("--api-key puts the key in the process list; prefer $%s or --api-key-file", KEY_ENV)
        key = args.api_key
    written = None
    scope = getattr(args, "key_scope", None)
    if key is None:
        key = httpguard.new_key()
        base = os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache/asyncwebrl")
        written = str(httpguard.write_key_file(Path(base) / "keys" / f"server-{port}.key", key))
        # generation stays open without a key only to this machine's own programs
        scope = scope or ("control" if is_loopback(args.host) else "all")
    roots = list(getattr(args, "weights_root", None) or [])
    roots += [r for r in os.environ.get(WEIGHT_ROOTS_ENV, "").split(os.pathsep) if r]
    trainers = list(getattr(args, "trainer_address", None) or [])
    trainers += [t for t in os.environ.get(TRAINER_ADDRESSES_ENV, "").split(",") if t]
    policy = ServerPolicy(
        api_key=key, key_scope=scope or "all",
        host_names=httpguard.served_names([args.host] + list(getattr(args, "allowed_host", None) or [])),
        weight_roots=roots, trainer_addresses=list(LOOPBACK) + trainers,
        max_body_bytes=int(getattr(args, "max_body_mb", 32) * 2**20),
    )
    return policy, written
