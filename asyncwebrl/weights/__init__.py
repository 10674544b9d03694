"""Weights out of the trainer and into the rollout servers (SPEC section 5): the weights box.

- `group`:   the ONE process-group constructor (rendezvous laid out as SGLang's);
- `buckets`: flat buckets (SGLang's `flattened_bucket` layout);
- `sender`:  the trainer's rank-0 side (`WeightSender`);
- `receiver`: the server side, into a mapping of parameters (`WeightReceiver`);
- `disk`:    the disk path (`load_folder`);
- `control`: control calls to every server from synchronous code;
- `bracket`: the ONE refresh bracket (pause gate + servers -> update session -> transfer ->
  version -> continue), used by the trainer loop, the rollout controllers and `bench weightsync`.
"""

from asyncwebrl.weights.group import WeightSyncError

__all__ = ["WeightSyncError"]
