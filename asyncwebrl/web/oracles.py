"""Scripted solvers for MiniWoB tasks. They read only what the model reads (instruction and element
list) and answer in the model's own action grammar, executed through the normal step path, so they
prove the reward path end to end and give demonstrations for a behaviour-cloning warm-up.

A few pages do not show how far a task has got (button ONE of click-button-sequence looks the same
once clicked; an opened accordion section carries no state in the element list). Their oracles keep
a per-episode memory of what they did, as the policy keeps its own history in the prompt:
`EpisodeOracle` holds it for one episode; `oracle_action` without a memory answers as at the start
of an episode.

Invariants:
- an oracle returns action TEXT (e.g. 'click [3]'), never a dict, so every demonstration is a string
  the policy could have emitted and `parse_action` accepts;
- an oracle addresses elements by what they are (role, name, state, order in the list), never by id:
  ids are drawn anew for every observation (`env.element_ids=drawn`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from asyncwebrl.web.base import Observation

Elements = list[dict[str, Any]]
Memory = dict[str, Any]
"""what an oracle did earlier in its episode (empty at the start)"""
Oracle = Callable[[Observation, Memory], str]
"""(observation, the episode's memory) -> action text"""


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
    if box is not None and box.get("value", "") != target:
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
    if box is not None and box.get("value") == m.group(0):
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


def _submit(obs: Observation, name: str = "Submit") -> str:
    return _click(_find(obs.elements, name=name, role="button"))


def _fill_then_submit(obs: Observation, fields: list[tuple[dict[str, Any] | None, str]], button: str) -> str:
    """Type each wanted text into its field unless it already holds it, then click the button."""
    for box, text in fields:
        if box is not None and box.get("value", "") != text:
            return f"type [{box['id']}] [{text}]"
    return _submit(obs, button)


def _enter_password(obs: Observation) -> str:
    password = _quoted(obs.instruction)
    boxes = [e for e in obs.elements if e["role"] == "textbox"]
    return _fill_then_submit(obs, [(b, password) for b in boxes], "Submit")


def _login_fields(obs: Observation) -> list[tuple[dict[str, Any] | None, str]]:
    """(username box, user), (password box, password): by their names where the page names them, else
    in the order the form lists them (username first)."""
    user, password = (re.findall(r'"([^"]*)"', obs.instruction) + ["", ""])[:2]
    boxes = [e for e in obs.elements if e["role"] == "textbox"]
    named = [next((b for b in boxes if k in b["name"].lower()), None) for k in ("user", "pass")]
    user_box, password_box = named if None not in named else (boxes + [None, None])[:2]
    return [(user_box, user), (password_box, password)]


def _login_user(obs: Observation) -> str:
    return _fill_then_submit(obs, _login_fields(obs), "Login")


def _login_user_popup(obs: Observation) -> str:
    """login-user, but focusing a field may raise a popup ('Exit to home page?' OK / Cancel) that
    disables the form: cancel it, then fill the form and press its OK."""
    cancel = _find(obs.elements, name="Cancel", role="button")
    if cancel is not None:
        return _click(cancel)
    return _fill_then_submit(obs, _login_fields(obs), "OK")


def _enter_text_2(obs: Observation) -> str:
    target = _quoted(obs.instruction)
    target = target.upper() if "upper case" in obs.instruction else target.lower()
    return _fill_then_submit(obs, [(_find(obs.elements, role="textbox"), target)], "Submit")


def _click_button_sequence(obs: Observation, memory: Memory) -> str:
    """ONE, then TWO: a clicked button looks as before, so the oracle remembers having clicked ONE."""
    if memory.get("clicked") != "ONE":
        memory["clicked"] = "ONE"
        return _click(_find(obs.elements, name="ONE", role="button"))
    return _click(_find(obs.elements, name="TWO", role="button"))


def _click_collapsible(obs: Observation, memory: Memory) -> str:
    """Open the section (its header, 'Section #N'), then Submit: an open section's header carries no
    state in the element list, so the oracle remembers having opened it."""
    if not memory.get("opened"):
        header = next((e for e in obs.elements if e["name"].startswith("Section #")), None)
        memory["opened"] = header is not None
        return _click(header)
    return _click(next((e for e in obs.elements if e["name"] == "Submit"), None))


def _click_tab_link(obs: Observation, memory: Memory) -> str:
    """click-tab-2 and its easy variant: click the link if the open tab shows it, else open the next tab
    not yet seen (the first tab is open at the start; an open tab carries no state in the list)."""
    target = _quoted(obs.instruction)
    link = next((e for e in obs.elements if e["role"] != "tab" and e["name"] == target), None)
    if link is not None:
        return _click(link)
    seen = memory.setdefault("tabs_seen", ["Tab #1"])
    tab = next((e for e in obs.elements if e["role"] == "tab" and e["name"] not in seen), None)
    if tab is None:
        return "Wait"
    seen.append(tab["name"])
    return _click(tab)


def _page_only(oracle: Callable[[Observation], str]) -> Oracle:
    """An oracle that reads only the page (it needs no memory)."""
    return lambda obs, memory: oracle(obs)

ORACLES: dict[str, Oracle] = {
    **{name: _page_only(fn) for name, fn in {
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
        "enter-text-dynamic": _enter_text,
        "click-checkboxes": _click_checkboxes,
        "click-checkboxes-transfer": _click_checkboxes,
        "click-option": _click_option,
        "choose-date": _choose_date,
        "use-autocomplete": _use_autocomplete,
        "click-scroll-list": _click_scroll_list,
        "enter-password": _enter_password,
        "login-user": _login_user,
        "login-user-popup": _login_user_popup,
        "enter-text-2": _enter_text_2,
    }.items()},
    "click-button-sequence": _click_button_sequence,
    "click-collapsible": _click_collapsible,
    "click-tab-2-easy": _click_tab_link,
    "click-tab-2": _click_tab_link,
}


def _oracle_of(task_id: str) -> Oracle:
    name = task_id.split("/", 1)[1] if task_id.startswith("miniwob/") else task_id
    if name not in ORACLES:
        raise KeyError(f"no oracle for '{name}'; oracles exist for: {', '.join(ORACLES)}")
    return ORACLES[name]


def oracle_action(task_id: str, obs: Observation, memory: Memory | None = None) -> str:
    """The oracle's next action text for a MiniWoB task ('miniwob/NAME' or 'NAME'); without `memory`,
    as at the start of an episode (right for every task whose page shows its progress)."""
    return _oracle_of(task_id)(obs, {} if memory is None else memory)


class EpisodeOracle:
    """The oracle of one episode: call it with each observation the episode returns, in order."""

    def __init__(self, task_id: str):
        self.task_id = task_id
        self.oracle = _oracle_of(task_id)
        self.memory: Memory = {}

    def __call__(self, obs: Observation) -> str:
        return self.oracle(obs, self.memory)
