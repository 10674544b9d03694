"""The inference HTTP protocol: SGLang's native API subset that the whole system speaks (SPEC section 3).

This is the ONE schema module shared by the embedded `hf` server, the rollout-side client and the
trainer-side weight sender, so they cannot drift. Request bodies are pydantic v2 models whose field
names are SGLang's exact names: strict types (no "3" for 3, no 1 for true), NaN/inf refused, unknown
fields refused (extra="forbid"). `parse_json(cls, raw)` / `parse_request(cls, obj)` turn untrusted
input into a model or raise `ProtocolError` whose message names the field (the server answers 400).

SGLang conventions kept here (checked against SGLang's own source, sampling_params.py/io_struct.py):
- /generate takes one prompt (`text`: str, `input_ids`: list[int]) or a batch (`text`: list[str],
  `input_ids`: list[list[int]]); for a batch, `image_data` is one entry per prompt (an image, a list
  of images, or null) or one image shared by all, `sampling_params` / `return_logprob` / ... are one
  value for all or a list with one per prompt, `rid` is a list (or a prefix: "rid_0", "rid_1", ...);
  the answer is a list with one result per prompt. `GenerateRequest.split()` yields single requests.
- sampling: a null value means the default; temperature below 1e-6 means greedy (stored as 0);
  top_k -1 means off and 0 is refused; max_new_tokens >= min_new_tokens >= 0; n must be 1.
- errors: `error(message)` is SGLang's `{"error": {"message": ...}}` (plus our `success`/`message`).
Deliberate difference: SGLang ignores unknown top-level /generate fields; we refuse them (a typo
would otherwise silently change an experiment). SGLang fields that the hf backend does not
implement (penalties, grammars, LoRA, hidden states...) are accepted only at their neutral value.

No pickle anywhere: bodies are JSON, tensors travel by torch.distributed broadcast, images as
base64 / data-URI strings.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

ENDPOINTS_POST = (
    "/generate",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/abort_request",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/destroy_weights_update_group",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/begin_weight_update",
    "/end_weight_update",
)
ENDPOINTS_GET = ("/health", "/model_info", "/get_model_info", "/server_info", "/weights_checksum")
CONTROL_ENDPOINTS = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weights_from_disk",
    "/update_weight_version", "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
})
"""endpoints that change what the server does or serves: they always need the server's key"""

TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 512, 4096
"""bounds of the stop conditions of one request (checked at every decode step)"""
MAX_RID_CHARS = 256
GREEDY_BELOW = 1e-6
"""a temperature below this is greedy decoding (SGLang's _SAMPLING_EPS): dividing logits by it overflows"""


class ProtocolError(ValueError):
    """A request that does not follow the protocol (HTTP 400 on the server side)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_default=False)


def _neutral(name: str, value: Any, neutral: Any) -> None:
    if value != neutral:
        raise ValueError(f"{name}={value!r} is not supported by the hf backend (only {neutral!r})")


# ---- request bodies ------------------------------------------------------------------------------


class SamplingParams(_Body):
    """`sampling_params` of /generate (SGLang names and defaults; null = default)."""

    max_new_tokens: int | None = 128
    """most tokens to generate (clamped to the context window)"""
    temperature: float | None = 1.0
    """0 (or below 1e-6) = greedy"""
    top_p: float | None = 1.0
    """nucleus sampling mass, in (0, 1]"""
    top_k: int | None = -1
    """keep the k most likely tokens; -1 = all (0 is refused, as SGLang does)"""
    min_p: float | None = 0.0
    """drop tokens whose probability is below min_p * max probability"""
    stop: str | list[str] | None = None
    """stop strings; the text is cut before the match unless no_stop_trim"""
    stop_token_ids: list[int] | None = None
    """token ids that end generation (the token is kept in output_ids)"""
    ignore_eos: bool | None = False
    """keep generating past the model's end-of-sequence tokens"""
    skip_special_tokens: bool | None = True
    """drop special tokens from the returned text"""
    min_new_tokens: int | None = 0
    """EOS and stop tokens are not honoured before this many tokens"""
    no_stop_trim: bool | None = False
    """keep the matched stop string in the text"""
    n: int | None = 1
    """samples per request (only 1 is supported)"""
    # SGLang fields the hf backend accepts only at their neutral value
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    spaces_between_special_tokens: bool | None = True
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        defaults = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                    "ignore_eos": False, "skip_special_tokens": True, "min_new_tokens": 0, "no_stop_trim": False,
                    "n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "spaces_between_special_tokens": True}
        for k, v in defaults.items():  # SGLang: null means "the default"
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                             f"got {self.min_new_tokens}")
        if self.n != 1:
            raise ValueError("n must be 1 (send several prompts in a batch instead)")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        # every decode step checks each stop string: a request must not buy the others' time with them
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
        if self.stop_token_ids and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("spaces_between_special_tokens", True), ("json_schema", None), ("regex", None),
                              ("ebnf", None), ("stop_regex", None)):
            _neutral(name, getattr(self, name), neutral)
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


ImageItem = str
"""an image: base64 text or a data URI"""


class GenerateRequest(_Body):
    """Body of POST /generate: one prompt, or a batch (see the module docstring)."""

    text: str | list[str] | None = None
    """prompt text (the server tokenizes and expands image placeholders); a list = a batch"""
    input_ids: list[int] | list[list[int]] | None = None
    """prompt token ids, image placeholders already expanded (VLMAdapter.encode); a list of lists = a batch"""
    image_data: ImageItem | list[ImageItem | list[ImageItem] | None] | None = None
    """single prompt: an image or a list of images (placeholder order); batch: one entry per prompt"""
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    """see SamplingParams; a list = one per prompt of a batch"""
    return_logprob: bool | list[bool] | None = None
    """return meta_info.output_token_logprobs = [[logprob, token_id, null], ...]"""
    logprob_start_len: int | list[int] | None = None
    """accepted for compatibility; prompt logprobs are never returned"""
    top_logprobs_num: int | list[int] | None = None
    """accepted for compatibility; must be 0"""
    return_text_in_logprobs: bool = False
    """accepted for compatibility; the third logprob element is always null"""
    rid: str | list[str] | None = None
    """request id (for /abort_request); generated when absent; a batch takes a list or a prefix"""
    stream: bool = False
    """server-sent events with the cumulative output, ending with 'data: [DONE]' (single prompts)"""
    extra_key: str | list[str] | None = None
    """SGLang's prefix-cache namespace: a prefix cached under one key is never reused under another. The
    client sends `cache_key_of(version)` of the weights an episode started under, so after an in-place
    refresh no new episode reuses KV computed by older weights (SGLang cannot flush while requests are
    held). The hf backend keeps no prefix cache across requests: accepted, nothing to scope"""
    # SGLang fields accepted at their neutral value only
    log_metrics: bool = True
    return_hidden_states: bool = False
    lora_path: None = None
    custom_logit_processor: None = None
    modalities: list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of 'input_ids' or 'text'")
        if self.input_ids is not None and (not self.input_ids or any(isinstance(p, list) and not p
                                                                     for p in self.input_ids)):
            raise ValueError("'input_ids' is empty")
        if self.text is not None and (self.text == "" or self.text == [] or (isinstance(self.text, list)
                                                                             and "" in self.text)):
            raise ValueError("'text' is empty")
        _neutral("return_hidden_states", self.return_hidden_states, False)
        n = self.batch_size
        if self.is_batch:
            if self.stream:
                raise ValueError("stream is supported for a single prompt, not a batch")
            for name in ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid"):
                v = getattr(self, name)
                if isinstance(v, list) and len(v) != n:
                    raise ValueError(f"'{name}' has {len(v)} entries for a batch of {n} prompts")
            if isinstance(self.rid, list) and len(set(self.rid)) != n:
                raise ValueError("duplicate request ids in 'rid'")
            if isinstance(self.image_data, list) and self.image_data and len(self.image_data) != n:
                raise ValueError(f"'image_data' has {len(self.image_data)} entries for a batch of {n} prompts")
        else:
            for name in ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid"):
                if isinstance(getattr(self, name), list):
                    raise ValueError(f"'{name}' is a list but the prompt is not a batch")
            if isinstance(self.image_data, list) and any(not isinstance(i, str) for i in self.image_data):
                raise ValueError("'image_data' of a single prompt is an image or a list of images")
        rids = self.rid if isinstance(self.rid, list) else [self.rid or ""]
        if any(len(r) > MAX_RID_CHARS for r in rids):
            raise ValueError(f"a request id is longer than {MAX_RID_CHARS} characters")
        for tl in (self.top_logprobs_num if isinstance(self.top_logprobs_num, list) else [self.top_logprobs_num]):
            if tl not in (None, 0):
                raise ValueError("top_logprobs_num is not supported (must be 0)")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)

    def prompt_images(self) -> list[list[str]]:
        """The images of each prompt (one list per prompt)."""
        n, im = self.batch_size, self.image_data
        if im is None or im == []:
            return [[] for _ in range(n)]
        if not self.is_batch:
            return [[im] if isinstance(im, str) else list(im)]
        if isinstance(im, str):
            return [[im] for _ in range(n)]
        return [[] if x is None else [x] if isinstance(x, str) else list(x) for x in im]

    def split(self) -> list[GenerateRequest]:
        """One single-prompt request per prompt: image_data a list, sampling_params, rid and
        return_logprob filled in (a batch's string rid becomes 'rid_0', 'rid_1', ...)."""
        n, batch = self.batch_size, self.is_batch

        def pick(v: Any, i: int) -> Any:
            return v[i] if isinstance(v, list) else v

        prompts = (self.text if batch else [self.text]) if self.text is not None else None
        ids = (self.input_ids if batch else [self.input_ids]) if self.input_ids is not None else None
        images = self.prompt_images()
        out = []
        for i in range(n):
            rid = self.rid[i] if isinstance(self.rid, list) else (
                f"{self.rid}_{i}" if batch and self.rid is not None else self.rid)
            out.append(GenerateRequest.model_construct(
                text=prompts[i] if prompts is not None else None,
                input_ids=ids[i] if ids is not None else None,
                image_data=images[i] or None,
                sampling_params=pick(self.sampling_params, i) or SamplingParams(),
                return_logprob=bool(pick(self.return_logprob, i)),
                logprob_start_len=pick(self.logprob_start_len, i),
                top_logprobs_num=0,
                return_text_in_logprobs=self.return_text_in_logprobs,
                rid=rid,
                stream=self.stream,
            ))
        return out


class _SGLangReq(_Body):
    """A control body shaped as SGLang's request struct (`io_struct.py`, on its `BaseReq`): every field
    SGLang accepts is accepted, fields the hf backend does not act on are listed in `IGNORED_FIELDS`
    (and in /model_info), and a field SGLang does not know is ignored, as SGLang's validation ignores
    it. `tests/weights/test_sglang_structs.py` checks these models against the structs of the wheel."""

    model_config = ConfigDict(extra="ignore")
    rid: str | None = None
    """SGLang's request id of a control call (accepted, not used)"""
    http_worker_ipc: str | None = None
    """SGLang's internal routing of multi-tokenizer servers (accepted, not used)"""


class PauseGenerationRequest(_SGLangReq):
    """Body of POST /pause_generation."""

    mode: Literal["in_place", "retract", "abort"] = "abort"
    """abort (SGLang's default): running requests end now with finish_reason abort;
    in_place/retract: they are kept and continue after /continue_generation"""


class EmptyRequest(_Body):
    """Body of endpoints that take no parameters (/continue_generation, /flush_cache)."""


class ContinueGenerationRequest(_SGLangReq):
    """Body of POST /continue_generation."""

    torch_empty_cache: bool = True
    """accepted for compatibility (SGLang empties torch's CUDA cache before continuing)"""


class FlushCacheRequest(_SGLangReq):
    """Body of POST /flush_cache (SGLang reads none: its timeout is a query parameter)."""

    timeout_s: float | None = None
    """accepted for compatibility"""


class EndWeightUpdateRequest(_SGLangReq):
    """Body of POST /end_weight_update."""


class AbortRequest(_SGLangReq):
    """Body of POST /abort_request. Neither `rid` nor `abort_all`: nothing is aborted (SGLang: 200)."""

    rid: str | None = None
    """request id to abort (every request whose id starts with it)"""
    abort_all: bool = False
    """abort every queued and running request"""
    finished_reason: dict[str, Any] | None = None
    """accepted for compatibility"""
    abort_message: str | None = None
    """accepted for compatibility"""
    weight_versions: Any = None
    """accepted for compatibility"""


class InitWeightsUpdateGroupRequest(_SGLangReq):
    """Body of POST /init_weights_update_group."""

    master_address: str
    """host of the trainer's rank 0 (the TCPStore master); must be one the server is configured to dial"""
    master_port: int
    """TCPStore port on the trainer's rank 0"""
    rank_offset: int
    """this server's rank in the group (1 + server index for tp=1)"""
    world_size: int
    """trainer rank 0 + every server"""
    group_name: str = "weight_update_group"
    """store prefix and name of the group"""
    backend: Literal["gloo", "nccl"] = "nccl"
    """gloo on CPU, nccl on GPU"""

    @model_validator(mode="after")
    def _check(self) -> InitWeightsUpdateGroupRequest:
        if not 0 < self.master_port < 65536:
            raise ValueError("master_port must be in 1..65535")
        if self.world_size < 2:
            raise ValueError("world_size must be >= 2 (trainer rank 0 + servers)")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError("rank_offset must be in 1..world_size-1 (rank 0 is the trainer)")
        return self


def _version_str(v: Any) -> Any:
    return None if v is None else str(v)


class UpdateWeightsFromDistributedRequest(_SGLangReq):
    """Body of POST /update_weights_from_distributed (inside a /begin_weight_update session)."""

    names: list[str]
    """parameter names (the model's named_parameters()), in broadcast order"""
    dtypes: list[str]
    """torch dtype names without 'torch.' (e.g. 'bfloat16'), one per name"""
    shapes: list[list[int]]
    """tensor shapes, one per name"""
    group_name: str = "weight_update_group"
    """the group formed by /init_weights_update_group"""
    flush_cache: bool = True
    """drop cached prefixes afterwards"""
    abort_all_requests: bool = False
    """end in-flight requests with finish_reason abort instead of pausing them"""
    weight_version: str | int | None = None
    """new weight version once this announcement is in (the refresh bracket sets it once, at the end)"""
    load_format: Literal["flattened_bucket"] | None = None
    """null: one broadcast per tensor; "flattened_bucket": one broadcast of the tensors' bytes laid end to end"""
    bucket_sizes: list[int] | None = None
    """extension (hf backend, advertised in /server_info weight_update_extensions): tensors per
    flattened bucket, so one announcement covers every bucket of a refresh"""
    selector: Literal["target", "draft", "all"] = "all"
    """accepted for compatibility (no draft model here)"""
    torch_empty_cache: bool = False
    """accepted for compatibility"""

    _v = field_validator("weight_version")(classmethod(lambda cls, v: _version_str(v)))

    @model_validator(mode="after")
    def _check(self) -> UpdateWeightsFromDistributedRequest:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        for d in self.dtypes:
            if d.removeprefix("torch.") not in TORCH_DTYPES:
                raise ValueError(f"unknown dtype '{d}'; one of {', '.join(TORCH_DTYPES)}")
        for s in self.shapes:
            if any(x < 0 for x in s):
                raise ValueError(f"negative dimension in shape {s}")
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be unique within one announcement")
        if self.bucket_sizes is not None:
            if self.load_format != "flattened_bucket":
                raise ValueError("bucket_sizes needs load_format 'flattened_bucket'")
            if any(n <= 0 for n in self.bucket_sizes) or sum(self.bucket_sizes) != len(self.names):
                raise ValueError("bucket_sizes must be positive and add up to the number of names")
        return self


class TensorUpdateTimes(BaseModel):
    """Where one `/update_weights_from_tensor` call spent its time on the server (our reply adds these
    to SGLang's {success, message}; a client that does not know them ignores them)."""

    model_config = ConfigDict(extra="ignore")

    map_s: float = 0.0
    """reading the payload and mapping the sender's memory (CUDA IPC / shared-memory handles)"""
    hold_s: float = 0.0
    """waiting for the model (generation paused between decode steps)"""
    copy_s: float = 0.0
    """the copy into the live parameters, synchronized"""
    read_s: float = 0.0
    """reading and parsing the request's body"""
    handler_s: float = 0.0
    """the whole call on the server, from reading the body to the reply (all of the above and the
    hand-off to the worker thread and back); the caller's round trip less this is the transport"""

    def __add__(self, other: TensorUpdateTimes) -> TensorUpdateTimes:
        return TensorUpdateTimes(map_s=self.map_s + other.map_s, hold_s=self.hold_s + other.hold_s,
                                 copy_s=self.copy_s + other.copy_s, read_s=self.read_s + other.read_s,
                                 handler_s=self.handler_s + other.handler_s)


class TensorUpdateReply(TensorUpdateTimes):
    """Our reply to `/update_weights_from_tensor` beyond SGLang's {success, message}: the times, and
    whether the server keeps the mapped payload (then the sender may send the same string again and
    the server copies without mapping; SGLang maps every payload anew, so a sender resends only when
    this is true)."""

    handles_kept: bool = False


class UpdateWeightsFromTensorRequest(_Body):
    """Body of POST /update_weights_from_tensor (SGLang's same-machine refresh: handles to the sender's
    memory, no network; `weights/ipc.py` writes and reads the payload)."""

    serialized_named_tensors: list[str]
    """base64 of one pickle per tensor-parallel rank (here: one): a flattened bucket
    {'flattened_tensor', 'metadata'} or a list of (name, tensor), tensors as CUDA IPC / shared-memory handles"""
    load_format: Literal["flattened_bucket"] | None = None
    """"flattened_bucket": one flat uint8 tensor and its metadata; null: a list of (name, tensor)"""
    flush_cache: bool = True
    """drop cached prefixes afterwards"""
    abort_all_requests: bool = False
    """end in-flight requests with finish_reason abort instead of pausing them"""
    weight_version: str | int | None = None
    """new weight version once this update is in (the refresh bracket sets it once, at the end)"""
    selector: Literal["target", "draft", "all"] = "all"
    """accepted for compatibility (no draft model here)"""
    torch_empty_cache: bool = False
    """accepted for compatibility"""

    _v = field_validator("weight_version")(classmethod(lambda cls, v: _version_str(v)))

    @model_validator(mode="after")
    def _check(self) -> UpdateWeightsFromTensorRequest:
        if len(self.serialized_named_tensors) != 1:
            raise ValueError("serialized_named_tensors holds one payload per tensor-parallel rank; "
                             "this server runs tp=1")
        return self


class BeginWeightUpdateRequest(_SGLangReq):
    """Body of POST /begin_weight_update (opens the update session SGLang 0.5.x requires)."""

    selector: Literal["target", "draft", "all"] = "all"
    """accepted for compatibility (no draft model here)"""


class DestroyWeightsUpdateGroupRequest(_SGLangReq):
    """Body of POST /destroy_weights_update_group."""

    group_name: str = "weight_update_group"
    """the group to tear down"""


class UpdateWeightsFromDiskRequest(_SGLangReq):
    """Body of POST /update_weights_from_disk."""

    model_path: str
    """HF model folder with safetensors weights, inside one of the server's weight roots"""
    weight_version: str | int | None = None
    """new weight version once loaded"""
    abort_all_requests: bool = False
    """end in-flight requests with finish_reason abort instead of pausing them"""
    load_format: str | None = None
    """accepted for compatibility; must be null"""
    flush_cache: bool = True
    """drop cached prefixes afterwards (the hf engine keeps none beyond running requests' own KV)"""
    is_async: bool = False
    """accepted for compatibility"""
    torch_empty_cache: bool = False
    """accepted for compatibility"""
    keep_pause: bool = False
    """accepted for compatibility"""
    recapture_cuda_graph: bool = False
    """accepted for compatibility"""
    token_step: int = 0
    """accepted for compatibility"""
    manifest: dict[str, Any] | None = None
    """accepted for compatibility"""

    _v = field_validator("weight_version")(classmethod(lambda cls, v: _version_str(v)))

    @model_validator(mode="after")
    def _check(self) -> UpdateWeightsFromDiskRequest:
        if self.load_format is not None:
            raise ValueError("load_format is not supported by the hf backend")
        return self


class UpdateWeightVersionRequest(_SGLangReq):
    """Body of POST /update_weight_version."""

    new_version: str | int
    """the version to report from now on"""
    abort_all_requests: bool = True
    """end in-flight requests with finish_reason abort (SGLang's default: send false to keep them)"""

    _v = field_validator("new_version")(classmethod(lambda cls, v: _version_str(v)))


REQUEST_TYPES: dict[str, type[_Body]] = {
    "/generate": GenerateRequest,
    "/pause_generation": PauseGenerationRequest,
    "/continue_generation": ContinueGenerationRequest,
    "/flush_cache": FlushCacheRequest,
    "/abort_request": AbortRequest,
    "/init_weights_update_group": InitWeightsUpdateGroupRequest,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
    "/update_weights_from_tensor": UpdateWeightsFromTensorRequest,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
    "/update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "/update_weight_version": UpdateWeightVersionRequest,
    "/begin_weight_update": BeginWeightUpdateRequest,
    "/end_weight_update": EndWeightUpdateRequest,
}

IGNORED_FIELDS: dict[str, tuple[str, ...]] = {
    path: tuple(f for f in ("rid", "http_worker_ipc", "torch_empty_cache", "timeout_s", "selector", "finished_reason",
                            "abort_message", "weight_versions", "is_async", "keep_pause", "recapture_cuda_graph",
                            "token_step", "manifest") if f in cls.model_fields and (f, path) != ("rid", "/abort_request"))
    for path, cls in REQUEST_TYPES.items() if issubclass(cls, _SGLangReq)
}
"""SGLang's request fields the hf backend accepts and does not act on, per route (shown in /model_info)"""


# ---- parsing -------------------------------------------------------------------------------------

_TYPE_LABEL = re.compile(r"^(str|int|float|bool|none|dict|list|[A-Z]\w*)$|[\[\]-]")


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_LABEL.search(part):  # pydantic names union members ('list[int]', 'SamplingParams')
            out += f".{part}" if out else part
    return out


def _message(e: ValidationError) -> str:
    errs = e.errors(include_url=False)
    best = max(errs, key=lambda x: len(x["loc"]))  # the most specific complaint (unions report every member)
    msg = str(best["msg"]).removeprefix("Value error, ")
    path = _path(best["loc"])
    if best["type"] == "extra_forbidden":
        return f"unknown field '{path}'"
    if best["type"] == "missing":
        return f"missing required field '{path}'"
    if best["type"] == "json_invalid":
        return f"malformed JSON body: {msg.removeprefix('Invalid JSON: ')}"
    if best["type"] == "model_type" and not path:
        return "the body must be a JSON object"
    return f"'{path}': {msg}" if path else msg


def parse_request(cls: type[_Body], body: Any) -> Any:
    """An already-decoded JSON value -> model `cls`; ProtocolError naming the field otherwise."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ProtocolError(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise ProtocolError(_message(e)) from None
    except RecursionError:
        raise ProtocolError("the body is nested too deeply") from None


def parse_json(cls: type[_Body], raw: bytes) -> Any:
    """Raw JSON bytes -> model `cls` (pydantic's own parser: bounded nesting, no Python recursion,
    lone surrogates refused); an empty body is {}."""
    if not raw.strip():
        raw = b"{}"
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        raise ProtocolError(_message(e)) from None


def parse_generate_bounded(raw: bytes, max_prompts: int, max_tokens: int, max_chars: int) -> GenerateRequest:
    """parse_json for /generate plus size bounds (prompts per batch, tokens and characters per prompt),
    so that what a worker process hands back is small. The server runs it in a worker process for
    large bodies: parsing millions of JSON values holds the GIL for seconds."""
    req = parse_json(GenerateRequest, raw)
    if req.batch_size > max_prompts:
        raise ProtocolError(f"a batch of {req.batch_size} prompts exceeds the limit of {max_prompts}")
    if req.input_ids is not None:
        for i, ids in enumerate(req.input_ids if req.is_batch else [req.input_ids]):
            if len(ids) > max_tokens:
                raise ProtocolError(f"{f'prompt {i}: ' if req.is_batch else ''}the input ({len(ids)} tokens) is "
                                    f"longer than the model's context length ({max_tokens} tokens)")
    if req.text is not None:
        for i, t in enumerate(req.text if req.is_batch else [req.text]):
            if len(t) > max_chars:
                raise ProtocolError(f"{f'prompt {i}: ' if req.is_batch else ''}prompt text of {len(t)} characters "
                                    f"exceeds the limit of {max_chars}")
    return req



# ---- responses -----------------------------------------------------------------------------------


def finish_reason(kind: Literal["stop", "length", "abort"], **extra: Any) -> dict[str, Any]:
    """SGLang's finish_reason object: {"type": kind, ...} (matched / length / message)."""
    return {"type": kind, **extra}


def ok(message: str = "", **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def error(message: str, status: int = 400) -> dict[str, Any]:
    """An error body: SGLang's {"error": {"message"}} shape, plus our {"success": false, "message"}."""
    kind = {401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
            413: "PayloadTooLargeError", 415: "UnsupportedMediaTypeError"}.get(status, "BadRequestError")
    if status >= 500:
        kind = "InternalServerError"
    return {"success": False, "message": message, "error": {"message": message, "type": kind, "code": status}}


def error_message(body: Any) -> str:
    """The message of an error answer in any shape a server of this protocol sends: SGLang's
    {"error": {"message"}}, SGLang's 401 {"error": "Unauthorized"}, ours {"message"}, FastAPI's
    {"detail": ...}; else the body itself, shortened."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])[:500]
    return str(body)[:500]


@dataclass
class GenerationOutput:
    """What the client returns for one prompt, after any abort-resubmit rounds.

    Invariant: output_ids, output_logprobs and output_versions have equal length; output_versions[i]
    is the weight version that produced output_ids[i].
    """

    output_ids: list[int]
    """generated token ids (a matched EOS / stop token is included)"""
    output_logprobs: list[float]
    """logprob of each generated token under the raw (temperature 1) distribution that sampled it"""
    output_versions: list[int]
    """weight version that produced each token"""
    text: str
    """decoded text of all generated tokens (stop string trimmed)"""
    finish_reason: Literal["stop", "length"]
    """why generation ended"""
    prompt_tokens: int
    """length of the original prompt"""
    server: str
    """address of the server that finished the request"""
    latency_s: float
    """wall time from the first submission to the final answer"""
    n_resubmits: int = 0
    """how many times the request came back aborted and was resubmitted"""


def cache_key_of(version: int) -> str:
    """The prefix-cache namespace (`extra_key`) of requests made under weight version `version`."""
    return f"weights-v{int(version)}"


def build_generate_payload(
    input_ids: list[int],
    image_data: list[str | bytes] | None,
    sampling: dict[str, Any],
    rid: str | None = None,
    return_logprob: bool = True,
    cache_key: str | None = None,
) -> dict[str, Any]:
    """The JSON body of /generate the client sends; checked against GenerateRequest before sending."""
    images = None
    if image_data:
        images = [base64.b64encode(im).decode() if isinstance(im, bytes) else im for im in image_data]
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": dict(sampling),
        "return_logprob": return_logprob,
    }
    if images:
        body["image_data"] = images
    if rid is not None:
        body["rid"] = rid
    if cache_key is not None:
        body["extra_key"] = cache_key
    parse_request(GenerateRequest, body)  # fail on the client side, with the same message
    return body


def parse_version(v: Any) -> int:
    """SGLang reports weight_version as a string ('default' before any update); ours are integers."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0
