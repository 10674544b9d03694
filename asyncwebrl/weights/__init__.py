"""Weights out of the trainer and into the rollout servers (SPEC section 5): the weights box.

- `group`:   the ONE process-group constructor (rendezvous laid out as SGLang's);
- `buckets`: flat buckets (SGLang's `flattened_bucket` layout);
- `sender`:  the trainer's rank-0 side (`WeightSender`);
- `receiver`: the server side, into a mapping of parameters (`WeightReceiver`);
- `disk`:    the disk path (`load_folder`);
- `control`: control calls to every server from synchronous code;
- `bracket`: the ONE refresh bracket (pause gate + servers -> update session -> transfer ->
  version -> continue), used by the trainer loop, the rollout controllers and `bench weightsync`;
- `version`: the ONE owner of the policy weight version (`PolicyVersion`), advanced by the bracket.

Importing the package imports nothing heavy (the rollout side imports `version` without torch);
`WeightSyncError` is loaded from `group` on first use.
"""

from typing import Any

__all__ = ["WeightSyncError"]


def __getattr__(name: str) -> Any:
    if name == "WeightSyncError":
        from asyncwebrl.weights.group import WeightSyncError

        return WeightSyncError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
