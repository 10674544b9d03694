"""Images prepared in worker processes (ImagePool, what a GPU server uses) equal the in-process path:
bit-identical pixel values and grids, and the same refusal messages for an undecodable image and for
input_ids whose image-token count does not match the image."""

from __future__ import annotations

import base64
import re

import pytest
import torch

from asyncwebrl.bench.inference import build_prompts, screenshot_png
from asyncwebrl.inference.engine import HFEngine
from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.protocol import GenerateRequest, ProtocolError, parse_request


@pytest.fixture(scope="module")
def engines():
    path = resolve_model_path("tiny-qwen2.5-vl")
    pooled = HFEngine(path, cpu_threads=1, image_workers=1)
    pooled.image_pool.warm()
    yield HFEngine(path, cpu_threads=1), pooled
    pooled.image_pool.close()


def _req(ids, png: bytes) -> GenerateRequest:
    return parse_request(GenerateRequest, {"input_ids": ids, "image_data": [base64.b64encode(png).decode()],
                                           "sampling_params": {"max_new_tokens": 4}})


def test_pooled_images_equal_in_process(engines):
    plain, pooled = engines
    ids, pngs = build_prompts(plain.model_path, 3)
    for i, png in zip(ids, pngs, strict=True):
        a, b = plain.prepare(_req(i, png), lambda r: None), pooled.prepare(_req(i, png), lambda r: None)
        assert a.input_ids == b.input_ids and set(a.images) == set(b.images) == {"pixel_values", "image_grid_thw"}
        for k in a.images:
            assert a.images[k].dtype == b.images[k].dtype and torch.equal(a.images[k], b.images[k])


def test_pooled_refusals_match_in_process(engines):
    plain, pooled = engines
    ids, pngs = build_prompts(plain.model_path, 1)
    short = list(ids[0])
    short.remove(plain.adapter.image_token_id)  # one image token fewer than the image needs
    cases = [(ids[0], b"not a png at all"), (short, pngs[0]),
             (ids[0], screenshot_png(5)[:200])]
    for i, png in cases:
        msgs = []
        for eng in (plain, pooled):
            with pytest.raises(ProtocolError) as e:
                eng.prepare(_req(i, png), lambda r: None)
            msgs.append(re.sub(r"0x[0-9a-f]+", "0x..", str(e.value)))  # PIL names a buffer's address
        assert msgs[0] == msgs[1]
