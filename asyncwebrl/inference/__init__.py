"""Inference: the SGLang native HTTP protocol, the embedded `hf` server, and the rollout-side client.

- `protocol`: the one request/response schema shared by server and client (SGLang field names).
- `engine`: `HFEngine`, continuous batching over a transformers VLM (raw-logit logprobs, versions).
- `server`: the aiohttp server (`asyncwebrl serve --backend hf`), subprocess/in-thread launchers.
- `weight_sync`: receiving broadcast weights (TCPStore + ProcessGroupGloo/NCCL) or a disk folder.
- `client`: `InferenceClient` (abort-resubmit, sticky servers, retries, failover).
- `sglang_launcher`: the `python -m sglang.launch_server` command line for GPU nodes.
"""
