"""The SGLang launch command line (SGLang itself needs CUDA; only the argv is checked here)."""

from __future__ import annotations

import pytest

from asyncwebrl.inference.sglang_launcher import SGLangLaunch, hf_command, sglang_command


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sglang_command_has_what_the_system_needs():
    cmd = sglang_command(SGLangLaunch(model_path="/models/qwen2.5-vl-3b", port=30001, mem_fraction_static=0.7))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/models/qwen2.5-vl-3b" and _flag(cmd, "--port") == "30001"
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--tp-size") == "1"
    assert _flag(cmd, "--mem-fraction-static") == "0.7" and _flag(cmd, "--dtype") == "bfloat16"
    assert "--enable-multimodal" in cmd and "--api-key" not in cmd


def test_keyword_form_key_from_env_and_extras():
    cmd = sglang_command(model_path="m", port=5, host="0.0.0.0", api_key_from_env=True, context_length=8192,
                         weight_version="3", allow_auto_truncate=True, extra_args=["--disable-radix-cache"])
    # the key never appears in argv (world-readable in /proc); a -c shim appends it from the environment
    assert cmd[1] == "-c" and "ASYNCWEBRL_API_KEY" in cmd[2] and "--api-key" not in cmd[3:]
    assert _flag(cmd, "--host") == "0.0.0.0" and "--allow-auto-truncate" in cmd
    assert _flag(cmd, "--context-length") == "8192" and _flag(cmd, "--weight-version") == "3"
    assert cmd[-1] == "--disable-radix-cache"


@pytest.mark.parametrize("bad", [{"port": 0}, {"mem_fraction_static": 1.5}, {"dtype": "fp4"}, {"model_path": ""}])
def test_bad_launch_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        sglang_command(**{"model_path": "m", "port": 1, **bad})


def test_hf_command_matches_the_cli():
    from asyncwebrl.cli import build_parser

    cmd = hf_command("/m", 1234, key_scope="all", max_batch_size=4, weights_roots=["/r"], trainer_addresses=["t1"])
    args = build_parser().parse_args(cmd[3:])
    assert (args.model, args.port, args.host, args.key_scope, args.max_batch_size) == ("/m", 1234, "127.0.0.1", "all", 4)
    assert args.api_key is None and args.weights_root == ["/r"] and args.trainer_address == ["t1"]
