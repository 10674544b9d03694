"""Bad configs never crash the loader: every input is a valid config or a ConfigError with a message."""

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncwebrl.config import RunConfig, load_run_config
from asyncwebrl.configtree import ConfigError, describe

KEYS = [k for k, *_ in describe(RunConfig)]
VALUES = st.one_of(
    st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True).map(str), st.booleans().map(str),
    st.text(max_size=20), st.sampled_from(["null", "[1, 2]", "{a: 1}", "[", "]: x", "async", "sync", "''"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=30)), VALUES), max_size=4))
def test_random_overrides_give_a_config_or_a_clear_error(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        cfg = load_run_config(None, overrides)
    except ConfigError as e:
        assert str(e).strip()
    else:
        assert isinstance(cfg, RunConfig)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_yaml_files_give_a_config_or_a_clear_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    try:
        load_run_config(path)
    except ConfigError as e:
        assert str(e).strip()
