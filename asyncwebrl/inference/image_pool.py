"""Image decoding and preprocessing of /generate requests in worker processes (off the server's GIL).

`HFEngine.prepare` runs in the server's HTTP threads. Decoding a screenshot and transformers' image
processor hold the GIL for a few milliseconds per image; when a rollout step's 64 requests arrive
together that is ~200 ms (measured on an H200 host) during which they are prepared one after another
and the engine thread, which needs the GIL between CUDA calls, is slowed too. `ImagePool` runs the same
calls in spawned processes: the threads only wait (GIL released) and the work is spread over cores.

Invariants: a worker computes exactly what the in-process path computes (`VLMAdapter` of the same
model folder, `decode_image` then `encode_with_images_for_ids`: bit-identical pixel values); a bad
image or a token count that does not match comes back as ValueError with the in-process message.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

_ADAPTER: Any = None


def _init_worker(model_path: str) -> None:
    global _ADAPTER
    from asyncwebrl.models.vlm import VLMAdapter

    torch.set_num_threads(1)
    _ADAPTER = VLMAdapter(model_path)


def _ping(_: int) -> int:
    return 0


def _images_for_ids(ids: list[int], blobs: list[bytes]) -> dict[str, Any]:
    from asyncwebrl.models.vlm import decode_image

    images = []
    for i, data in enumerate(blobs):
        try:
            images.append(decode_image(data))
        except ValueError as e:
            raise ValueError(f"image_data[{i}]: {e}") from None
    out = _ADAPTER.encode_with_images_for_ids(ids, images)
    return {k: v.numpy() for k, v in out.items()}


class ImagePool:
    """`workers` spawned processes holding the model's image processor (see module docstring)."""

    def __init__(self, model_path: str, workers: int):
        if workers < 1:
            raise ValueError(f"an image pool needs at least one worker, not {workers}")
        self.workers = workers
        self._ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_init_worker, initargs=(model_path,))

    def warm(self) -> None:
        """Start the workers now (each loads the processor once), not in the first requests' way."""
        list(self._ex.map(_ping, range(4 * self.workers)))

    def images_for_ids(self, ids: list[int], blobs: list[bytes]) -> dict[str, torch.Tensor]:
        """`VLMAdapter.encode_with_images_for_ids(ids, [decode_image(b) for b in blobs])`, in a worker."""
        out = self._ex.submit(_images_for_ids, list(ids), list(blobs)).result()
        return {k: torch.from_numpy(v) for k, v in out.items()}

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)
