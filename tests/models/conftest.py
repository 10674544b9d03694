"""Fixtures of the model-family tests: screenshots, and transformers' own Qwen processors as the
reference an adapter's encoding is compared with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from PIL import Image


def _page(w: int, h: int, color: tuple[int, int, int]) -> Image.Image:
    img = Image.new("RGB", (w, h), (240, 240, 240))
    img.paste(color, (10, 20, w // 2, h // 2))
    return img


@pytest.fixture(scope="session")
def screenshots() -> list[Image.Image]:
    """Two screenshots of different sizes (so their image grids differ)."""
    return [_page(160, 210, (30, 90, 200)), _page(333, 120, (200, 10, 10))]


@pytest.fixture(scope="session")
def two_image_chat() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Answer as click [N]."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Before;"},
                                         {"type": "image"}, {"type": "text", "text": "after. Click OK."}]}]


@pytest.fixture(scope="session")
def qwen_reference_processor() -> Callable[[type, str], Any]:
    """transformers' Qwen processor of a model folder, for still images only: the stock constructor
    insists on a video processor (torchvision), which screenshots never use."""

    def make(processor_cls: type, path: str) -> Any:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        class ImagesOnly(processor_cls):
            def check_argument_for_proper_class(self, argument_name, argument):
                return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

        return ImagesOnly(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                          tokenizer=AutoTokenizer.from_pretrained(path), video_processor=None)

    return make
