"""Inference: the embedded `hf` server and the rollout-side client (their shared HTTP schema is
`asyncwebrl.protocol`, imported by both and by the trainer-side sender).

- `engine`: `HFEngine`, continuous batching over a transformers VLM (raw-logit logprobs, versions).
- `server`: the aiohttp server (`asyncwebrl serve --backend hf`), subprocess/in-thread launchers.
- `weight_sync`: receiving broadcast weights (TCPStore + ProcessGroupGloo/NCCL) or a disk folder.
- `client`: `InferenceClient` (abort-resubmit, sticky servers, retries, failover).
- `conformance`: `python -m asyncwebrl.inference.conformance URL` checks a server against SGLang's API.
- `sglang_launcher`: the `python -m sglang.launch_server` command line for GPU nodes.
"""
