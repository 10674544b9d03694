import pytest

from asyncwebrl.allocation import AllocationModeError, parse_allocation_mode


def test_disaggregated_example_from_spec():
    m = parse_allocation_mode("sglang[rollout]:d48+fsdp[actor]:d16")
    assert m.total_devices == 64
    assert m.rollout.backend == "sglang" and m.rollout.dp == 48
    assert m.actor.backend == "fsdp" and m.actor.world_size == 16
    assert all(len(c.allocs) == 1 for c in m.components)  # "+": nothing colocated


def test_dims_multiply_and_default_roles():
    m = parse_allocation_mode("hf:d2t2p2+fsdp:d4")
    assert m.rollout.world_size == 8 and (m.rollout.dp, m.rollout.tp, m.rollout.pp) == (2, 2, 2)
    assert m.actor.world_size == 4
    assert m.total_devices == 12


def test_colocation_binds_tighter_than_plus():
    m = parse_allocation_mode("sglang[rollout]:d4|fsdp[actor]:d4+hf[test-rollout]:d1")
    assert [len(c.allocs) for c in m.components] == [2, 1]  # rollout|actor share devices
    assert m.total_devices == 5
    assert m.role("test-rollout").world_size == 1


@pytest.mark.parametrize(
    "text, pos, fragment",
    [
        ("", 0, "empty"),
        ("sglang[rollout]:d4|fsdp[actor]:d2", 0, "different world sizes"),
        ("tgi[rollout]:d1", 0, "unknown backend 'tgi'"),
        ("sglang[rollout]d1", 15, "expects ':'"),
        ("sglang[rollout]:x1", 16, "dim letter"),
        ("sglang[rollout]:d", 17, "integer after 'd'"),
        ("sglang[rollout]:d0", 17, ">= 1"),
        ("sglang[rollout]:d1+", 19, "backend name"),
        ("sglang[rollout:d1", 14, "']'"),
        ("sglang[rollout]:d1 +fsdp:d1", 18, "unexpected character"),
        ("fsdp[rollout]:d1", 5, "inference role"),
        ("sglang[actor]:d1", 7, "training role"),
        ("sglang[rollout]:d1d2", 18, "repeats dim"),
        ("hf[rollout]:d1+sglang[rollout]:d1", 22, "twice"),
    ],
)
def test_errors_point_at_the_offending_position(text, pos, fragment):
    with pytest.raises(AllocationModeError) as ei:
        parse_allocation_mode(text)
    assert ei.value.pos == pos, str(ei.value)
    assert fragment in str(ei.value)
    # the caret line sits under the offending character
    caret_line = str(ei.value).splitlines()[-1]
    assert caret_line.index("^") - 2 == pos
