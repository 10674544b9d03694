"""Text-only causal language models (any config without a vision tower).

A text policy reads the page as text: the image parts of a chat message are dropped, and images
passed to `encode` are ignored; image tensors for ids are refused.
"""

from __future__ import annotations

from typing import Any

from asyncwebrl.models.families.base import ModelFamily, register


@register
class TextFamily(ModelFamily):
    """A causal LM: plain-string chat contents, no images, 1-D positions."""

    name = "text"
    takes_images = False

    @classmethod
    def claims(cls, config: dict[str, Any]) -> bool:
        # no vision tower, and (if the config names its architectures) a causal LM: an unknown
        # vision-language model is refused rather than loaded as text
        archs = config.get("architectures") or []
        return (bool(config.get("model_type")) and "vision_config" not in config
                and all(a.endswith("ForCausalLM") for a in archs))

    @classmethod
    def auto_model(cls) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def text_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {**m, "content": m["content"] if isinstance(m["content"], str)
             else "".join(p.get("text", "") for p in m["content"])}
            for m in messages
        ]
