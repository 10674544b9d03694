"""Scripted solvers for MiniWoB tasks. They read only what the model reads (instruction and element
list) and answer in the model's own action grammar, executed through the normal step path, so they
prove the reward path end to end and give demonstrations for a behaviour-cloning warm-up.

Invariant: an oracle returns action TEXT (e.g. 'click [3]'), never a dict, so every demonstration
is a string the policy could have emitted and `parse_action` accepts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from asyncwebrl.web.base import Observation

Elements = list[dict[str, Any]]


def _quoted(instruction: str) -> str:
    m = re.search(r'"([^"]*)"', instruction)
    return m.group(1) if m else ""


def _find(elements: Elements, name: str | None = None, role: str | None = None) -> dict[str, Any] | None:
    for e in elements:
        if (name is None or e["name"] == name) and (role is None or e["role"] == role):
            return e
    return None


def _click(e: dict[str, Any] | None) -> str:
    return f"click [{e['id']}]" if e else "Wait"


def _click_test(obs: Observation) -> str:
    return _click(_find(obs.elements, role="button"))


def _click_test_2(obs: Observation) -> str:
    m = re.search(r"button (\w+)", obs.instruction)
    return _click(_find(obs.elements, name=m.group(1) if m else "ONE", role="button"))


def _click_button(obs: Observation) -> str:
    return _click(_find(obs.elements, name=_quoted(obs.instruction), role="button"))


def _click_link(obs: Observation) -> str:
    return _click(_find(obs.elements, name=_quoted(obs.instruction)))


def _click_dialog(obs: Observation) -> str:
    return _click(_find(obs.elements, name="Close", role="button"))


def _click_dialog_2(obs: Observation) -> str:
    label = _quoted(obs.instruction)
    return _click(_find(obs.elements, name="Close" if label == "x" else label, role="button"))


def _focus_text(obs: Observation) -> str:
    return _click(_find(obs.elements, role="textbox"))


def _focus_text_2(obs: Observation) -> str:
    m = re.search(r"(\d)(?:st|nd|rd|th)", obs.instruction)
    boxes = [e for e in obs.elements if e["role"] == "textbox"]
    k = int(m.group(1)) - 1 if m else 0
    return _click(boxes[k] if 0 <= k < len(boxes) else None)


def _click_tab(obs: Observation) -> str:
    m = re.search(r"Tab #(\d+)", obs.instruction)
    return _click(_find(obs.elements, name=f"Tab #{m.group(1)}" if m else ""))


def _enter_text(obs: Observation) -> str:
    target = _quoted(obs.instruction)
    box = _find(obs.elements, role="textbox")
    if box is not None and box["name"] != target:
        return f"type [{box['id']}] [{target}]"
    return _click(_find(obs.elements, name="Submit", role="button"))


def _select_then_submit(obs: Observation, wanted: list[str], role: str) -> str:
    for e in obs.elements:
        if e["role"] == role and (e["name"] in wanted) != bool(e.get("checked")):
            return _click(e)
    return _click(_find(obs.elements, name="Submit", role="button"))


def _click_checkboxes(obs: Observation) -> str:
    m = re.match(r"Select (.*) and click Submit", obs.instruction)
    items = m.group(1) if m else ""
    wanted = [] if items == "nothing" else [s.strip() for s in items.split(",")]
    return _select_then_submit(obs, wanted, "checkbox")


def _click_option(obs: Observation) -> str:
    m = re.match(r"Select (.*) and click Submit", obs.instruction)
    wanted = [m.group(1).strip()] if m else []
    for e in obs.elements:
        if e["role"] == "radio" and e["name"] in wanted and not e.get("checked"):
            return _click(e)
    return _click(_find(obs.elements, name="Submit", role="button"))


_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]


def _choose_date(obs: Observation) -> str:
    """Open the datepicker, walk its months with the Prev / Next arrows, click the day, submit."""
    m = re.search(r"(\d\d)/(\d\d)/(\d{4})", obs.instruction)
    if not m:
        return "Wait"
    month, day, year = int(m.group(1)), int(m.group(2)), int(m.group(3))
    box = _find(obs.elements, role="textbox")
    if box is not None and box["name"] == m.group(0):
        return _click(_find(obs.elements, name="Submit", role="button"))
    days = [e for e in obs.elements if re.fullmatch(r"\d{1,2} [A-Z][a-z]+ \d{4}", e["name"])]
    if not days:
        return _click(box)
    _, shown_month, shown_year = days[0]["name"].split(" ")
    shown = int(shown_year) * 12 + _MONTHS.index(shown_month)
    want = year * 12 + month - 1
    if shown != want:
        return _click(_find(obs.elements, name="Prev" if shown > want else "Next"))
    return _click(_find(obs.elements, name=f"{day} {_MONTHS[month - 1]} {year}"))


def _use_autocomplete(obs: Observation) -> str:
    """Type the prefix, pick the menu item that matches the whole ask, submit."""
    parts = re.findall(r'"([^"]*)"', obs.instruction)
    prefix, suffix = (parts + ["", ""])[:2]

    def fits(name: str) -> bool:
        return name.lower().startswith(prefix.lower()) and name.lower().endswith(suffix.lower())

    box = _find(obs.elements, role="textbox")
    if box is not None and box.get("value") and fits(box["value"]):
        return _click(_find(obs.elements, name="Submit", role="button"))
    item = next((e for e in obs.elements if e is not box and e["role"] != "button" and fits(e["name"])), None)
    if item is not None:
        return _click(item)
    return f"type [{box['id']}] [{prefix}]" if box else "Wait"


def _click_scroll_list(obs: Observation) -> str:
    """Set the whole selection of the multi-select list, submit."""
    m = re.match(r"Select (.*) from the scroll list and click Submit", obs.instruction)
    wanted = [w.strip() for w in m.group(1).split(",")] if m else []
    lst = next((e for e in obs.elements if "options" in e), None)
    if lst is None:
        return "Wait"
    if sorted(v for v in lst.get("value", "").split(" | ") if v) != sorted(wanted):
        return f"select [{lst['id']}] [{' | '.join(wanted)}]"
    return _click(_find(obs.elements, name="Submit", role="button"))


ORACLES: dict[str, Callable[[Observation], str]] = {
    "click-test": _click_test,
    "click-test-2": _click_test_2,
    "click-button": _click_button,
    "click-link": _click_link,
    "click-dialog": _click_dialog,
    "click-dialog-2": _click_dialog_2,
    "focus-text": _focus_text,
    "focus-text-2": _focus_text_2,
    "click-tab": _click_tab,
    "enter-text": _enter_text,
    "click-checkboxes": _click_checkboxes,
    "click-option": _click_option,
    "choose-date": _choose_date,
    "use-autocomplete": _use_autocomplete,
    "click-scroll-list": _click_scroll_list,
}


def oracle_action(task_id: str, obs: Observation) -> str:
    """The oracle's next action text for a MiniWoB task ('miniwob/NAME' or 'NAME')."""
    name = task_id.split("/", 1)[1] if task_id.startswith("miniwob/") else task_id
    if name not in ORACLES:
        raise KeyError(f"no oracle for '{name}'; oracles exist for: {', '.join(ORACLES)}")
    return ORACLES[name](obs)
