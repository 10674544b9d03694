"""One adapter per vision-language model family: prompt building, image token expansion, and the
keyword arguments of a forward pass.

The inference server, the episode workflow and the trainer all go through `VLMAdapter`, so the
prompt token ids a server generated from are exactly the ids the trainer recomputes logprobs on
(invariant: `tokenize(messages, images)` is deterministic and image placeholders are expanded here,
on the rollout side, never implicitly by a processor elsewhere).

Families: Idefics3/SmolVLM (the embedded default), Qwen2-VL/Qwen2.5-VL, Qwen3-VL, and text-only
causal LMs. Qwen processors are bypassed (their __init__ needs torchvision for the video path,
which screenshots never use): tokenizer and the PIL image processor are driven directly.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from asyncwebrl.models.prepare import resolve_model_path

IDEFICS3 = "idefics3"
QWEN2VL = "qwen2_vl"  # Qwen2-VL and Qwen2.5-VL share the image path
QWEN3VL = "qwen3_vl"
TEXT = "text"


def decode_image(data: str | bytes | Image.Image) -> Image.Image:
    """A PIL RGB image from raw bytes, base64 text, or a data URI; ValueError when undecodable."""
    if isinstance(data, Image.Image):
        return data.convert("RGB")
    try:
        if isinstance(data, str):
            if data.startswith("data:"):
                data = data.split(",", 1)[1]
            data = base64.b64decode(data, validate=False)
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except Exception as e:  # PIL raises many types for corrupt data
        raise ValueError(f"undecodable image ({type(e).__name__}: {e})") from e


def encode_image_b64(img: Image.Image | bytes, fmt: str = "PNG") -> str:
    if isinstance(img, bytes):
        return base64.b64encode(img).decode()
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def detect_family(path: str) -> str:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(path).model_type
    else:
        model_type = json.loads(cfg_file.read_text()).get("model_type", "")
    if model_type in ("idefics3", "smolvlm"):
        return IDEFICS3
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        return QWEN2VL
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        return QWEN3VL
    return TEXT


@dataclass
class Encoded:
    """Model-ready inputs of one sequence: token ids plus image tensors (if any)."""

    input_ids: list[int]
    images: dict[str, torch.Tensor]


class VLMAdapter:
    """Tokenizer + image processor of a model folder, and the family's forward conventions."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.path = resolve_model_path(path)
        self.family = detect_family(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.image_processor = None
        self.processor = None
        if self.family == IDEFICS3:
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.path)
            self.tokenizer = self.processor.tokenizer
            self.image_processor = self.processor.image_processor
            self.image_token = "<image>"
        elif self.family in (QWEN2VL, QWEN3VL):
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(self.path)
            self.image_token = "<|image_pad|>"
            self.merge = self.image_processor.merge_size
        self.image_token_id = (
            self.tokenizer.convert_tokens_to_ids(self.image_token) if self.family != TEXT else None
        )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    # ---- prompts -------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        for tok in ("<|im_end|>", "<end_of_utterance>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return sorted(i for i in ids if i is not None)

    def chat_text(self, messages: list[dict[str, Any]]) -> str:
        if self.family == TEXT:
            messages = [
                {**m, "content": m["content"] if isinstance(m["content"], str)
                 else "".join(p.get("text", "") for p in m["content"])}
                for m in messages
            ]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def assistant_turn_ids(self, text: str) -> list[int]:
        """The token ids a policy emits to answer `text` in one assistant turn: the text as the chat
        template renders it after the generation prompt, through the first end-of-turn token (the
        token rollout generation stops on, `eos_token_ids`). A template that ends the turn with no such
        token gets the tokenizer's EOS appended; one that does not extend the generation prompt
        (unusual) gives the plain text's tokens plus EOS."""
        probe = [{"role": "user", "content": [{"type": "text", "text": "."}]}]
        turn = probe + [{"role": "assistant", "content": [{"type": "text", "text": text}]}]
        if self.family == TEXT:
            turn = [{**m, "content": "".join(p["text"] for p in m["content"])} for m in turn]
        head = self.chat_text(probe)
        full = self.tokenizer.apply_chat_template(turn, tokenize=False)
        tail = full[len(head):] if full.startswith(head) else text
        ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"]
        stops = set(self.eos_token_ids)
        for i, t in enumerate(ids):
            if t in stops:
                return ids[: i + 1]
        eos = self.tokenizer.eos_token_id
        return ids + [eos if eos is not None else self.eos_token_ids[0]]

    def encode(self, text: str, images: list[Image.Image] | None = None) -> Encoded:
        """Token ids with every image placeholder expanded, and the image tensors for forward."""
        images = images or []
        if self.family == TEXT or not images:
            if self.family != TEXT and self.image_token in text:
                raise ValueError("prompt has image placeholders but no images were given")
            return Encoded(self.tokenizer(text, add_special_tokens=False)["input_ids"], {})
        if self.family == IDEFICS3:
            out = self.processor(text=text, images=[images], return_tensors="pt", add_special_tokens=False)
            return Encoded(
                out["input_ids"][0].tolist(),
                {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]},
            )
        img = self.image_processor(images=images, return_tensors="pt")
        grid = img["image_grid_thw"]
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(images):
            raise ValueError(f"prompt has {len(parts) - 1} image placeholders but {len(images)} images")
        pieces = [parts[0]]
        for g, rest in zip(grid, parts[1:], strict=False):
            pieces.append(self.image_token * int(g.prod() // self.merge**2))
            pieces.append(rest)
        ids = self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]
        return Encoded(ids, {"pixel_values": img["pixel_values"], "image_grid_thw": grid})

    def encode_with_images_for_ids(self, input_ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """Image tensors for already-expanded `input_ids` (the server and trainer path); checks that
        the number of image tokens matches what the images produce."""
        if not images:
            if self.image_token_id is not None and self.image_token_id in input_ids:
                raise ValueError("input_ids contain image tokens but no image_data was given")
            return {}
        if self.family == TEXT:
            raise ValueError("this model takes no images")
        if self.family == IDEFICS3:
            n_img = sum(1 for t in input_ids if t == self.image_token_id)
            per = self.processor.image_seq_len
            if n_img != per * len(images):
                raise ValueError(f"input_ids hold {n_img} image tokens; {len(images)} images need {per * len(images)}")
            out = self.image_processor(images=[images], return_tensors="pt")
            return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}
        img = self.image_processor(images=images, return_tensors="pt")
        need = int(sum(int(g.prod()) // self.merge**2 for g in img["image_grid_thw"]))
        n_img = sum(1 for t in input_ids if t == self.image_token_id)
        if n_img != need:
            raise ValueError(f"input_ids hold {n_img} image tokens; the images need {need}")
        return {"pixel_values": img["pixel_values"], "image_grid_thw": img["image_grid_thw"]}

    # ---- batching ------------------------------------------------------------------------------
    def collate(self, seqs: list[list[int]], images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-padded batch of sequences with their image tensors, ready for `model(**batch)`."""
        pad = self.tokenizer.pad_token_id
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        batch: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
        have = [im for im in images if im]
        if not have:
            return batch
        if self.family == IDEFICS3:
            n_img = max(im["pixel_values"].shape[1] for im in have)
            c, h, w = have[0]["pixel_values"].shape[2:]
            pv = torch.zeros((len(seqs), n_img, c, h, w), dtype=have[0]["pixel_values"].dtype)
            pm = torch.zeros((len(seqs), n_img, h, w), dtype=torch.bool)
            for i, im in enumerate(images):
                if im:
                    k = im["pixel_values"].shape[1]
                    pv[i, :k] = im["pixel_values"][0]
                    pm[i, :k] = im["pixel_attention_mask"][0].bool()
            batch.update(pixel_values=pv, pixel_attention_mask=pm)
        else:
            batch["pixel_values"] = torch.cat([im["pixel_values"] for im in have])
            batch["image_grid_thw"] = torch.cat([im["image_grid_thw"] for im in have])
            batch["mm_token_type_ids"] = (ids == self.image_token_id).long() * mask
        return batch


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """The policy as a transformers model (image-text-to-text, or causal LM for text models)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = resolve_model_path(path)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cls = AutoModelForCausalLM if detect_family(path) == TEXT else AutoModelForImageTextToText
    model = cls.from_pretrained(path, dtype=dt)
    return model.to(device)
