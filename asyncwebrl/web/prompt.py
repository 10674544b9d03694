"""The agent's prompt: a system line with the action format, two in-context examples, then the task,
the element list, the last k screenshots and the earlier actions as text.

Why the examples: zero-shot, the 135M default model almost never emits a parsable action (SPEC
section 12); with a system line plus two examples of the format nearly all outputs parse, which is
what gives RL a clean signal. The prompt is kept short on purpose: on CPU its length dominates cost.

Invariant: the number of {"type": "image"} parts in the messages equals `n_images`, in the order the
caller passes the screenshots (oldest first), so prompt ids and pixel keys line up.
Training (rollout) and evaluation build prompts here and nowhere else.
"""

from __future__ import annotations

from typing import Any

from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.observe import elements_text

MAX_INSTRUCTION_CHARS = 300
MAX_HISTORY_LINES = 6

_SYSTEM_ELEMENTS = ("You are a web agent. Reply with exactly one action: click [id], type [id] [text] or "
                    "select [id] [option], using an element id from the list.")
_SYSTEM_COORDS = ("You are a web agent. Reply with exactly one action: click [x, y] or type [x, y] [text], "
                  "with {unit} coordinates on the screenshot.")

_EXAMPLES_ELEMENTS = [
    ('Task: Click on the "ok" button.\nElements:\n[1] button "cancel"\n[2] button "ok"', "click [2]"),
    ('Task: Enter "Bob" into the text field.\nElements:\n[1] textbox ""\n[2] button "Submit"', "type [1] [Bob]"),
]
# under env.element_ids=drawn the listed ids are not in document order, and the examples show that
_EXAMPLES_ELEMENTS_DRAWN = [
    ('Task: Click on the "ok" button.\nElements:\n[2] button "cancel"\n[1] button "ok"', "click [1]"),
    ('Task: Enter "Bob" into the text field.\nElements:\n[2] textbox ""\n[1] button "Submit"', "type [2] [Bob]"),
]
_EXAMPLES_COORDS_PIXEL = [
    ('Task: Click on the "ok" button.', "click [80, 120]"),
    ('Task: Enter "Bob" into the text field.', "type [60, 70] [Bob]"),
]
_EXAMPLES_COORDS_NORM = [
    ('Task: Click on the "ok" button.', "click [500, 571]"),
    ('Task: Enter "Bob" into the text field.', "type [375, 333] [Bob]"),
]


def _text(s: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": s}]


def build_messages(
    instruction: str,
    elements: list[dict[str, Any]],
    history: list[str],
    n_images: int,
    env_cfg: EnvConfig,
) -> list[dict[str, Any]]:
    """Chat messages for one step.

    instruction: the task's goal; elements: the current element list; history: action texts of the
    earlier steps (oldest first); n_images: screenshots in the prompt (the caller's sliding window).
    """
    if env_cfg.element_list:
        system = _SYSTEM_ELEMENTS
        examples = _EXAMPLES_ELEMENTS_DRAWN if env_cfg.element_ids == "drawn" else _EXAMPLES_ELEMENTS
    else:
        unit = "pixel" if env_cfg.coord_mode == "pixel" else "0-1000 normalized"
        system = _SYSTEM_COORDS.format(unit=unit)
        examples = _EXAMPLES_COORDS_PIXEL if env_cfg.coord_mode == "pixel" else _EXAMPLES_COORDS_NORM
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(system)}]
    for user, assistant in examples:
        messages.append({"role": "user", "content": _text(user)})
        messages.append({"role": "assistant", "content": _text(assistant)})
    lines = [f"Task: {' '.join(instruction.split())[:MAX_INSTRUCTION_CHARS]}"]
    if history:
        shown = history[-MAX_HISTORY_LINES:]
        lines.append("Done so far: " + "; ".join(a if a else "(invalid)" for a in shown))
    if env_cfg.element_list:
        lines.append("Elements:\n" + (elements_text(elements) or "(none)"))
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    content.extend(_text("\n".join(lines)))
    messages.append({"role": "user", "content": content})
    return messages


def short_action(text: str, limit: int = 40) -> str:
    """An earlier model output as it appears in the history line."""
    return " ".join(text.split())[:limit]
