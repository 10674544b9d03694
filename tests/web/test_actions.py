"""The action grammar: every documented form parses to the right action, and arbitrary text never
raises (it is an action or None)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncwebrl.web.actions import parse_action


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Click [12, 40]", {"type": "click", "x": 12.0, "y": 40.0}),
        ("click [12]", {"type": "click", "element": 12}),
        ("Action: CLICK [3] because it is the OK button", {"type": "click", "element": 3}),
        ("Type [10, 20] [hello world]", {"type": "type", "x": 10.0, "y": 20.0, "text": "hello world"}),
        ("type [4] [Bob]", {"type": "type", "element": 4, "text": "Bob"}),
        ("Scroll [WINDOW] [down]", {"type": "scroll", "direction": "down"}),
        ("scroll [50, 60] [UP]", {"type": "scroll", "x": 50.0, "y": 60.0, "direction": "up"}),
        ("GoBack", {"type": "go_back"}),
        ("wait", {"type": "wait"}),
        ("ANSWER [$12]", {"type": "answer", "text": "$12"}),
        ("click('12')", {"type": "click", "element": 12}),
        ('fill("7", "some text")', {"type": "type", "element": 7, "text": "some text"}),
        ("mouse_click(33.5, 70)", {"type": "click", "x": 33.5, "y": 70.0}),
        ("scroll(0, 200)", {"type": "scroll", "dx": 0.0, "dy": 200.0}),
        ("send_msg_to_user('It costs $12')", {"type": "answer", "text": "It costs $12"}),
        ("go_back()", {"type": "go_back"}),
        ("select [5] [Dog]", {"type": "select", "element": 5, "option": "Dog"}),
        ("Action: SELECT [2] [ New York ]", {"type": "select", "element": 2, "option": "New York"}),
        ("select_option('12', 'blue')", {"type": "select", "element": 12, "option": "blue"}),
        ("first click [2] then click [5]", {"type": "click", "element": 2}),
    ],
)
def test_documented_forms_parse(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "I would click the button", "click []", "click [a, b]",
                                  "click('abc')", "type [3]", "select [3]", "select_option('x', 'y')", "mouse_click(nan, 1)", "Click [1e999, 2]", None, 42])
def test_non_actions_are_invalid(text):
    assert parse_action(text) is None


def test_canonical_texts_parse_to_their_actions():
    for text, a in [("click [3]", {"type": "click", "element": 3}), ("click [10, 20.5]", {"type": "click", "x": 10.0, "y": 20.5}),
                    ("type [2] [Alice]", {"type": "type", "element": 2, "text": "Alice"}),
                    ("scroll [WINDOW] [up]", {"type": "scroll", "direction": "up"}),
                    ("GoBack", {"type": "go_back"}), ("Wait", {"type": "wait"}), ("ANSWER [42]", {"type": "answer", "text": "42"}),
                    ("scroll(0, 100)", {"type": "scroll", "dx": 0.0, "dy": 100.0}),
                    ("select [4] [Zed]", {"type": "select", "element": 4, "option": "Zed"})]:
        assert parse_action(text) == a, text


_alphabet = st.sampled_from(list("clickCLICKtypefil()[]'\",.0123456789 -_scrollwindowupdownanswer\n\\"))


@settings(max_examples=3000, deadline=None)
@given(st.one_of(st.text(max_size=200), st.text(alphabet=_alphabet, max_size=80)))
def test_fuzz_never_raises(text):
    out = parse_action(text)
    assert out is None or (isinstance(out, dict) and out["type"] in
                           {"click", "type", "select", "scroll", "go_back", "wait", "answer"})


def test_huge_output_is_bounded():
    assert parse_action("x" * 1_000_000 + " click [1]") is None
    assert parse_action("click [1] " + "y" * 1_000_000) == {"type": "click", "element": 1}
