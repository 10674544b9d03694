"""Benchmark knobs are read by the run config's override parser: the same YAML values and the same
messages for a malformed override; a knob the benchmark does not have is refused by name."""

import pytest

from asyncwebrl.bench.common import parse_overrides

DEFAULTS = {"concurrency": [16, 64], "steps": 4, "model": "default", "record": False}


def test_values_read_as_yaml_like_run_overrides():
    knobs = parse_overrides(["concurrency=[1, 2]", "steps=12", "record=true", "model=tiny-qwen3-vl"], DEFAULTS)
    assert knobs == {"concurrency": [1, 2], "steps": 12, "model": "tiny-qwen3-vl", "record": True}
    assert parse_overrides(None, DEFAULTS) == DEFAULTS


@pytest.mark.parametrize("override, message", [
    ("steps", "must look like key.subkey=value"),
    ("st eps=3", "may hold only letters"),
    ("steps=[1,", "not valid YAML"),
    ("stepz=3", "unknown benchmark knob 'stepz'; valid: concurrency, model, record, steps"),
])
def test_bad_overrides_exit_with_the_reason(override, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_overrides([override], DEFAULTS)
