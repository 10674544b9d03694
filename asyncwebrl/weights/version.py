"""The policy weight version: ONE owner (SPEC sections 4 and 5).

`PolicyVersion` is the only thing that holds the version as a value of its own. It lives in the
controller process (built by `controller.system.build_system`, or by a rollout controller used on its
own) and moves in exactly two ways:

- `advance()`: +1, called only by the refresh bracket (`weights.bracket.RefreshBracket`) once the
  servers hold the new weights and report the new version;
- its start value: 0 for a fresh run, or the version of the checkpoint a run resumes from
  (`controller.main.find_resume` reads it from the checkpoint, once; `build_system` starts the owner
  there). It is never set afterwards.

Everything else reads it or holds a copy that is checked against it:
- the rollout controller and the sync pool read it (`clock.value`), no copy;
- the staleness manager and each executor hold a cached, read-only copy because they may sit across
  a Ray process boundary; the copies move only through the rollout controller's `publish_version`,
  which the bracket calls after each advance (and `start()` once, with the start value);
- the servers report SGLang's `weight_version` string, set by the bracket from this value;
- the trainer (`FSDPActor.version`) holds the version of the weights it trains; every `train_step`
  is told the owner's value and raises `VersionDrift` if its own differs.

Invariant: the value never decreases, and between two refreshes every holder reports it.
"""

from __future__ import annotations

import threading


class VersionDrift(RuntimeError):
    """A holder's copy of the weight version differs from the owner's value (a bug, never tolerated)."""


class PolicyVersion:
    """The weight version of the policy the rollout servers serve. Thread-safe."""

    def __init__(self, start: int = 0):
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"a policy version starts at an integer >= 0, got {start!r}")
        self._value = start
        self._start = start
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        """The version the servers serve now (and the rollout side tags its groups with)."""
        return self._value

    @property
    def next(self) -> int:
        """The version the refresh in progress will publish (what the trainer's weights are, between its
        train step and the refresh)."""
        return self._value + 1

    @property
    def start(self) -> int:
        """Where this run started: 0, or the version of the checkpoint it resumed from."""
        return self._start

    def advance(self) -> int:
        """+1 and the new value. Only the refresh bracket calls this, after the transfer succeeded."""
        with self._lock:
            self._value += 1
            return self._value

    def check(self, held: int, holder: str) -> None:
        """Raise `VersionDrift` unless `holder`'s copy `held` equals the owner's value."""
        if held != self._value:
            raise VersionDrift(f"{holder} holds weight version {held}, but the policy is at version {self._value}")

    def __repr__(self) -> str:
        return f"PolicyVersion({self._value})"


def check_copy_moves_forward(old: int, new: int, holder: str) -> None:
    """A cached copy takes a published value only if it does not move it back (or below 0)."""
    if new < 0:
        raise ValueError(f"{holder}: a weight version is >= 0, got {new}")
    if new < old:
        raise VersionDrift(f"{holder}: weight version would move back from {old} to {new}")
