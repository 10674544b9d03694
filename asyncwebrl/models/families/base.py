"""What a model family must provide, and the registry families enter by name.

A family is one class in one file of this package: it says which Hugging Face configs it claims, loads
its tokenizer and image processor, expands image placeholders into image tokens, builds the pixel
tensors of a forward pass, and states how decoding positions are laid out. `VLMAdapter`
(models/vlm.py) and the inference engines ask the family object; nothing else compares family names.

Invariants:
- every registered family has a unique `name`, and no two families claim the same config (detection
  refuses an ambiguous config rather than pick one silently);
- `encode_images` and `images_for_ids` of one family produce bit-identical pixel tensors for the same
  images (the server recomputes from ids what the rollout side encoded from text);
- image placeholders are expanded here, on the rollout side, never implicitly by a processor elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image

_REGISTRY: dict[str, type[ModelFamily]] = {}


@dataclass
class Encoded:
    """Model-ready inputs of one sequence: token ids plus image tensors (if any)."""

    input_ids: list[int]
    images: dict[str, torch.Tensor]


def register(cls: type[ModelFamily]) -> type[ModelFamily]:
    """Class decorator: enter a family into the registry under `cls.name`."""
    name = getattr(cls, "name", "")
    if not name:
        raise TypeError(f"{cls.__name__} has no `name`; a family registers under its name")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"model family {name!r} is registered twice ({_REGISTRY[name].__name__} and {cls.__name__})")
    _REGISTRY[name] = cls
    return cls


class ModelFamily:
    """One model family bound to one model folder: its tokenizer, image processor and conventions.

    A subclass sets the class attributes, implements `claims` (or lists `model_types`), loads what it
    needs in `__init__`, and, when it takes images, implements `encode_images`, `images_for_ids` and
    `batch_images`. The checks common to all families (no images given, placeholder without an image)
    stay in `VLMAdapter`, so a family only handles the case it is specific about.
    """

    name: ClassVar[str] = ""
    """registry key, e.g. 'qwen2_vl'"""
    model_types: ClassVar[tuple[str, ...]] = ()
    """the `model_type` values of config.json this family claims"""
    takes_images: ClassVar[bool] = True
    """whether prompts may carry images (a text model drops them: it reads the page as text)"""
    uses_mrope: ClassVar[bool] = False
    """positions are multimodal rotary (M-RoPE): the model caches per-row rope deltas after a prefill,
    which must be reset before the next one, and a decoded token's position ids are `decode_position_ids`"""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.path = path
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        self.processor: Any = None
        """a transformers processor, where the family drives one"""
        self.image_processor: Any = None
        self.image_token: str | None = None
        """the placeholder a chat template writes for one image, before expansion"""

    @property
    def image_token_id(self) -> int | None:
        return None if self.image_token is None else self.tokenizer.convert_tokens_to_ids(self.image_token)

    # ---- detection and loading ----------------------------------------------------------------
    @classmethod
    def claims(cls, config: dict[str, Any]) -> bool:
        """Whether this family serves a model with this config.json content."""
        return config.get("model_type") in cls.model_types

    @classmethod
    def auto_model(cls) -> Any:
        """The transformers Auto class that loads the family's models."""
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    # ---- prompts --------------------------------------------------------------------------------
    def text_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the family's chat template takes them (unchanged unless overridden)."""
        return messages

    def encode_images(self, text: str, images: list[Image.Image]) -> Encoded:
        """Token ids of `text` with each image placeholder expanded, and the images' tensors
        (called with at least one image)."""
        raise NotImplementedError(f"model family {self.name!r} takes no images")

    def images_for_ids(self, input_ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """The images' tensors for already-expanded `input_ids`; ValueError when the number of image
        tokens does not match what the images produce (called with at least one image)."""
        raise ValueError("this model takes no images")

    # ---- forward --------------------------------------------------------------------------------
    def batch_images(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The image entries of a right-padded batch (`images[i]` belongs to row i; {} for a row
        without images; at least one row has images)."""
        raise NotImplementedError(f"model family {self.name!r} takes no images")

    def decode_position_ids(self, positions: torch.Tensor, rope_deltas: list[int]) -> torch.Tensor:
        """Position ids of one decoded token per row: `positions` [B, 1] counts the row's tokens so
        far; `rope_deltas` are the per-row deltas the prefill left (used by M-RoPE families)."""
        return positions

    def host_positions(self, inner_model: Any) -> Any:
        """An `MRopeIndex` computing the prompt's position ids on the host (models/mrope.py), or None
        when the model computes them itself in the prefill."""
        return None
