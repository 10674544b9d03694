"""The action grammar: model text -> action dict, and action dict -> real mouse/keyboard events.

Grammars (case-insensitive; the FIRST action found in the text counts, so a model may write
"Action: click [3]" or add prose around it):
  WebGym style     Click [x, y] | Click [12] | Type [x, y] [text] | Type [12] [text] |
                   Select [12] [option] | Scroll [WINDOW|x, y|12] [up|down] | GoBack | Wait |
                   ANSWER [text]
  BrowserGym style click('12') | fill('12', 'text') | select_option('12', 'option') |
                   mouse_click(x, y) | scroll(dx, dy) | send_msg_to_user('text') | go_back() | noop()

Action dicts: {"type": "click", "element": 12} or {"type": "click", "x": .., "y": ..};
{"type": "type", ("element" | "x","y"), "text"}; {"type": "select", "element", "option"} (a choice
in a drop-down list, by its text or value); {"type": "scroll", ("element" | "x","y" | none),
"direction"} or {"type": "scroll", "dx", "dy"}; {"type": "go_back"}; {"type": "wait"};
{"type": "answer", "text"}. Coordinates stay in the model's space (pixels or 0-1000); the executor
maps them with the env's coord_mode.

Invariant: `parse_action` never raises; it returns an action dict or None (invalid). `execute_action`
never raises for a bad or impossible action either; it returns (False, reason). Only a dead browser
escapes as an exception (the caller turns it into EnvCrashed).
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

from asyncwebrl.web.observe import element_by_id

MAX_PARSE_CHARS = 4000
"""only this much of a model output is searched (keeps parsing linear and bounded)"""
MAX_TYPE_CHARS = 200
"""longest text a Type/fill action types"""
MAX_COORD = 100_000.0

_NUM = r"[-+]?\d+(?:\.\d+)?"
_Q = r"""(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")"""  # a single- or double-quoted string

_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("bg_click", re.compile(r"\bclick\(\s*" + _Q + r"\s*\)", re.I)),
    ("bg_fill", re.compile(r"\bfill\(\s*" + _Q + r"\s*,\s*" + _Q + r"\s*\)", re.I)),
    ("bg_select", re.compile(r"\bselect_option\(\s*" + _Q + r"\s*,\s*" + _Q + r"\s*\)", re.I)),
    ("bg_mouse", re.compile(r"\bmouse_click\(\s*(" + _NUM + r")\s*,\s*(" + _NUM + r")\s*\)", re.I)),
    ("bg_scroll", re.compile(r"\bscroll\(\s*(" + _NUM + r")\s*,\s*(" + _NUM + r")\s*\)", re.I)),
    ("bg_msg", re.compile(r"\bsend_msg_to_user\(\s*" + _Q + r"\s*\)", re.I)),
    ("bg_back", re.compile(r"\bgo_back\(\s*\)", re.I)),
    ("bg_noop", re.compile(r"\bnoop\(\s*\)", re.I)),
    ("click_xy", re.compile(r"\bclick\s*\[\s*(" + _NUM + r")\s*,\s*(" + _NUM + r")\s*\]", re.I)),
    ("click_id", re.compile(r"\bclick\s*\[\s*(\d{1,6})\s*\]", re.I)),
    ("type_xy", re.compile(r"\btype\s*\[\s*(" + _NUM + r")\s*,\s*(" + _NUM + r")\s*\]\s*\[(.*?)\]", re.I | re.S)),
    ("type_id", re.compile(r"\btype\s*\[\s*(\d{1,6})\s*\]\s*\[(.*?)\]", re.I | re.S)),
    ("select_id", re.compile(r"\bselect\s*\[\s*(\d{1,6})\s*\]\s*\[(.*?)\]", re.I | re.S)),
    ("scroll_win", re.compile(r"\bscroll\s*\[\s*window\s*\]\s*\[\s*(up|down)\s*\]", re.I)),
    ("scroll_xy", re.compile(r"\bscroll\s*\[\s*(" + _NUM + r")\s*,\s*(" + _NUM + r")\s*\]\s*\[\s*(up|down)\s*\]", re.I)),
    ("scroll_id", re.compile(r"\bscroll\s*\[\s*(\d{1,6})\s*\]\s*\[\s*(up|down)\s*\]", re.I)),
    ("goback", re.compile(r"\bgo\s?back\b", re.I)),
    ("wait", re.compile(r"\bwait\b", re.I)),
    ("answer", re.compile(r"\banswer\s*\[(.*?)\]", re.I | re.S)),
]


def _unquote(m: re.Match, first: int) -> str:
    s = m.group(first) if m.group(first) is not None else m.group(first + 1)
    return re.sub(r"\\(.)", r"\1", s or "")


def _num(s: str) -> float | None:
    try:
        v = float(s)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(v) or abs(v) > MAX_COORD:
        return None
    return v


def _build(kind: str, m: re.Match) -> dict[str, Any] | None:
    if kind == "bg_click":
        s = _unquote(m, 1).strip()
        return {"type": "click", "element": int(s)} if s.isdigit() and len(s) <= 6 else None
    if kind == "bg_fill":
        s = _unquote(m, 1).strip()
        if not (s.isdigit() and len(s) <= 6):
            return None
        return {"type": "type", "element": int(s), "text": _unquote(m, 3)[:MAX_TYPE_CHARS]}
    if kind == "bg_select":
        s = _unquote(m, 1).strip()
        if not (s.isdigit() and len(s) <= 6):
            return None
        return {"type": "select", "element": int(s), "option": _unquote(m, 3).strip()[:MAX_TYPE_CHARS]}
    if kind == "select_id":
        return {"type": "select", "element": int(m.group(1)), "option": m.group(2).strip()[:MAX_TYPE_CHARS]}
    if kind in ("bg_mouse", "click_xy"):
        x, y = _num(m.group(1)), _num(m.group(2))
        return None if x is None or y is None else {"type": "click", "x": x, "y": y}
    if kind == "bg_scroll":
        dx, dy = _num(m.group(1)), _num(m.group(2))
        return None if dx is None or dy is None else {"type": "scroll", "dx": dx, "dy": dy}
    if kind == "bg_msg":
        return {"type": "answer", "text": _unquote(m, 1).strip()}
    if kind in ("bg_back", "goback"):
        return {"type": "go_back"}
    if kind in ("bg_noop", "wait"):
        return {"type": "wait"}
    if kind == "click_id":
        return {"type": "click", "element": int(m.group(1))}
    if kind == "type_xy":
        x, y = _num(m.group(1)), _num(m.group(2))
        if x is None or y is None:
            return None
        return {"type": "type", "x": x, "y": y, "text": m.group(3)[:MAX_TYPE_CHARS]}
    if kind == "type_id":
        return {"type": "type", "element": int(m.group(1)), "text": m.group(2)[:MAX_TYPE_CHARS]}
    if kind == "scroll_win":
        return {"type": "scroll", "direction": m.group(1).lower()}
    if kind == "scroll_xy":
        x, y = _num(m.group(1)), _num(m.group(2))
        if x is None or y is None:
            return None
        return {"type": "scroll", "x": x, "y": y, "direction": m.group(3).lower()}
    if kind == "scroll_id":
        return {"type": "scroll", "element": int(m.group(1)), "direction": m.group(2).lower()}
    if kind == "answer":
        return {"type": "answer", "text": m.group(1).strip()}
    return None


def parse_action(text: Any) -> dict[str, Any] | None:
    """The first action in `text`, or None when there is none (an invalid step)."""
    if not isinstance(text, str) or not text:
        return None
    text = text[:MAX_PARSE_CHARS]
    best: tuple[int, int, str, re.Match] | None = None
    for order, (kind, pat) in enumerate(_PATTERNS):
        m = pat.search(text)
        if m is not None and (best is None or (m.start(), order) < best[:2]):
            best = (m.start(), order, kind, m)
    if best is None:
        return None
    try:
        return _build(best[2], best[3])
    except (ValueError, IndexError, OverflowError):
        return None


def _point(action: dict[str, Any], elements: list[dict[str, Any]], coord_mode: str,
           width: int, height: int) -> tuple[float, float] | str:
    """Viewport pixel target of an action, or the reason it has none."""
    if "element" in action:
        el = element_by_id(elements, action["element"])
        if el is None:
            return f"no element [{action['element']}] on the page"
        if el.get("point"):
            return float(el["point"][0]), float(el["point"][1])
        x, y, w, h = el["box"]
        return x + w / 2, y + h / 2
    x, y = float(action["x"]), float(action["y"])
    if coord_mode == "norm1000":
        if not (0 <= x <= 1000 and 0 <= y <= 1000):
            return f"normalized point ({x}, {y}) outside 0-1000"
        x, y = x * width / 1000.0, y * height / 1000.0
    if not (0 <= x < width and 0 <= y < height):
        return f"point ({x}, {y}) outside the {width}x{height} viewport"
    return x, y


EDITABLE_ROLES = frozenset({"textbox", "searchbox", "combobox", "spinbutton"})
"""element roles that take typed text (a <select> is a combobox too, but it has `options`, is not
editable, and has its own action)"""


def is_editable(el: dict[str, Any]) -> bool:
    """Whether `type [id] [text]` can put text into this listed element. Like BrowserGym's `fill`, which
    refuses an element that is not an input, textarea or contenteditable, typing into a link or button
    is an error here, not a click: measured 2026-12-02, the old click-then-type let `type [1] [a]`
    succeed on click-link whenever element 1 was the target, which taught the policy to type on every
    click task (the prompt's own example `type [1] [Bob]`)."""
    return "options" not in el and (bool(el.get("editable")) or el.get("role") in EDITABLE_ROLES)


async def act(page, action: dict[str, Any] | None, elements: list[dict[str, Any]], cfg: Any, *,
              episode_done: bool) -> tuple[bool, dict[str, Any]]:
    """The guarded action of an env's step(): (executed, info), where info["error"] says why nothing
    (or not all) was done: the episode is over, the model's output did not parse, or the target is
    not on the page. `cfg` is the EnvConfig (coordinate mode, viewport, wait length)."""
    if episode_done:
        return False, {"error": "episode already done"}
    if action is None:
        return False, {"error": "unparsable action"}
    executed, why = await execute_action(page, action, elements, cfg.coord_mode, cfg.viewport_width,
                                         cfg.viewport_height, wait_s=cfg.wait_action_s)
    return executed, ({"error": why} if why else {})


async def execute_action(page, action: dict[str, Any], elements: list[dict[str, Any]],
                         coord_mode: str, width: int, height: int, wait_s: float = 0.2) -> tuple[bool, str]:
    """Run one action with real input events. (executed, reason-if-not)."""
    t = action.get("type")
    if t == "select":
        if "element" not in action:
            return False, "select needs an element id: select [id] [option]"
        el = element_by_id(elements, action["element"])
        if el is None:
            return False, f"no element [{action['element']}] on the page"
        why = await page.evaluate("([i, o, id]) => window.__awr ? window.__awr.select(i, o, id) : 'page not ready'",
                                  [int(el.get("index", el["id"])), str(action.get("option", "")), int(el["id"])])
        return (False, why) if why else (True, "")
    if t == "type" and "element" in action:
        el = element_by_id(elements, action["element"])
        if el is not None and not is_editable(el):
            i = action["element"]
            if "options" in el:
                return False, (f"element [{i}] is a drop-down list: typing does not choose an option; "
                               f"use select [{i}] [option]")
            return False, (f"element [{i}] is a {el.get('role') or 'element'}, not a text field: nothing "
                           f"to type into; use click [{i}]")
    if t in ("click", "type") or (t == "scroll" and ("element" in action or "x" in action)):
        target = _point(action, elements, coord_mode, width, height)
        if isinstance(target, str):
            return False, target
    else:
        target = (width / 2, height / 2)
    x, y = target
    if t == "click":
        await page.mouse.click(x, y)
    elif t == "type":
        await page.mouse.click(x, y)
        await page.keyboard.press("ControlOrMeta+A")
        await page.keyboard.type(str(action.get("text", ""))[:MAX_TYPE_CHARS])
    elif t == "scroll":
        if "dx" in action:
            dx, dy = float(action["dx"]), float(action["dy"])
        else:
            dx, dy = 0.0, (height / 2 if action.get("direction") == "down" else -height / 2)
        await page.mouse.move(x, y)
        await page.mouse.wheel(dx, dy)
    elif t == "go_back":
        try:
            await page.go_back(timeout=5_000)
        except Exception as e:  # nothing to go back to, or a slow page: not an executed action
            if page.is_closed():
                raise
            return False, f"go back failed: {type(e).__name__}"
    elif t == "wait":
        await asyncio.sleep(wait_s)
    elif t == "answer":
        pass  # the environment's evaluator reads the answer
    else:
        return False, f"unknown action type {t!r}"
    return True, ""
