"""Draw the action a step took onto a copy of the screenshot the model saw at that step.

Invariant: the run directory's screenshots are never modified; annotated copies are written into
the report folder. Any action dict (from either action grammar, or a malformed one) and any image
bytes are accepted: what cannot be drawn is left undrawn, and an unreadable image yields None,
never an exception.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError

MIN_WIDTH = 480
"""small screenshots (MiniWoB is 160 px wide) are enlarged so the marks stay legible"""

_CLICK = (230, 30, 60)
_TYPE = (20, 110, 230)
_SCROLL = (240, 140, 0)
_OTHER = (120, 40, 170)


@dataclass
class ActionMark:
    """What to draw for one action, in the screenshot's pixel coordinates."""

    kind: str
    """click | type | scroll | goback | wait | answer | other | invalid"""
    point: tuple[float, float] | None = None
    text: str = ""
    direction: str = ""
    """up | down | left | right (scroll only)"""
    label: str = ""
    """element id / mark number when the action names an element instead of a point"""


_KIND_ALIASES = {
    "click": "click", "mouse_click": "click", "left_click": "click", "tap": "click", "select": "click",
    "type": "type", "fill": "type", "input": "type", "type_text": "type",
    "scroll": "scroll", "goback": "goback", "go_back": "goback", "back": "goback",
    "wait": "wait", "noop": "wait", "answer": "answer", "send_msg_to_user": "answer", "stop": "answer",
}


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _pair(v: Any) -> tuple[float, float] | None:
    if isinstance(v, (list, tuple)) and len(v) >= 2:
        x, y = _number(v[0]), _number(v[1])
        if x is not None and y is not None:
            if len(v) == 4:  # a box [x, y, w, h]: its centre
                w, h = _number(v[2]), _number(v[3])
                if w is not None and h is not None:
                    return x + w / 2, y + h / 2
            return x, y
    if isinstance(v, dict):
        return _point_of(v)
    return None


def _point_of(a: dict[str, Any]) -> tuple[float, float] | None:
    x, y = _number(a.get("x")), _number(a.get("y"))
    if x is not None and y is not None:
        return x, y
    for key in ("point", "coords", "coordinate", "coordinates", "xy", "position", "box", "bbox"):
        if key in a:
            p = _pair(a[key])
            if p is not None:
                return p
    el = a.get("element")
    if isinstance(el, dict):
        return _point_of(el)
    return None


def action_mark(action: dict[str, Any] | None, invalid: bool, size: tuple[int, int],
                coord_mode: str = "pixel") -> ActionMark:
    """Interpret a parsed action for drawing; `size` is the screenshot's (width, height) in pixels and
    `coord_mode` the run's env.coord_mode ("pixel" or "norm1000": x, y in 0-1000 of the viewport)."""
    if not isinstance(action, dict):
        return ActionMark(kind="invalid")
    raw_kind = next((str(action[k]) for k in ("type", "kind", "action", "name", "op") if action.get(k)), "")
    kind = _KIND_ALIASES.get(raw_kind.strip().lower().replace(" ", "_"), "other")
    point = _point_of(action)
    normalized = coord_mode == "norm1000" or bool(action.get("normalized"))
    if point is not None and normalized:
        point = (point[0] * size[0] / 1000.0, point[1] * size[1] / 1000.0)
    text = next((str(action[k]) for k in ("text", "value", "answer", "message", "content") if action.get(k)), "")
    direction = str(action.get("direction", "")).lower()
    if kind == "scroll" and direction not in ("up", "down", "left", "right"):
        dx, dy = _number(action.get("dx")) or 0.0, _number(action.get("dy")) or 0.0
        direction = ("down" if dy > 0 else "up") if abs(dy) >= abs(dx) else ("right" if dx > 0 else "left")
    label = ""
    for k in ("element_id", "element", "mark", "bid", "id", "index"):
        v = action.get(k)
        if v is not None and not isinstance(v, (dict, list)):
            label = f"#{v}"
            break
    mark = ActionMark(kind=kind, point=point, text=text, direction=direction, label=label)
    if invalid:
        mark.kind = "invalid" if kind == "other" else kind
    return mark


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: fixed-size bitmap font
        return ImageFont.load_default()


def _banner_height(text: str, font) -> int:
    box = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), text, font=font)
    return box[3] - box[1] + 10


def _banner(draw: ImageDraw.ImageDraw, width: int, height: int, text: str, colour: tuple[int, int, int], font) -> None:
    box = draw.textbbox((0, 0), text, font=font)
    draw.rectangle([0, 0, width, height - 1], fill=colour)
    draw.text((6, 5 - box[1]), text, fill=(255, 255, 255), font=font)


def _arrow(draw: ImageDraw.ImageDraw, centre: tuple[float, float], direction: str, length: float, colour) -> None:
    cx, cy = centre
    vec = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}.get(direction, (0, 1))
    sx, sy = cx - vec[0] * length / 2, cy - vec[1] * length / 2
    ex, ey = cx + vec[0] * length / 2, cy + vec[1] * length / 2
    w = max(4, int(length / 10))
    draw.line([(sx, sy), (ex, ey)], fill=colour, width=w)
    head = length / 3
    px, py = -vec[1], vec[0]  # perpendicular
    draw.polygon([(ex + vec[0] * head / 2, ey + vec[1] * head / 2),
                  (ex + px * head / 2, ey + py * head / 2), (ex - px * head / 2, ey - py * head / 2)],
                 fill=colour)


def _caption(mark: ActionMark, invalid: bool) -> str:
    where = f"at ({mark.point[0]:.0f}, {mark.point[1]:.0f})" if mark.point is not None else ""
    caption = {
        "click": " ".join(p for p in ("click", mark.label, where) if p),
        "type": " ".join(p for p in ("type", mark.label, where) if p),
        "scroll": " ".join(p for p in ("scroll", mark.direction, mark.label) if p), "goback": "go back",
        "wait": "wait", "answer": f"answer: {mark.text[:60]}",
        "invalid": "INVALID action (did not parse / not executable)", "other": "action",
    }[mark.kind]
    return f"INVALID {caption}" if invalid and mark.kind != "invalid" else caption


def _draw_marks(draw: ImageDraw.ImageDraw, mark: ActionMark, point: tuple[float, float] | None,
                box: tuple[int, int, int, int], font) -> None:
    """Draw the mark inside `box` = (left, top, width, height) of the screenshot on the canvas."""
    left, top, w, h = box
    r = max(8, w // 40)
    colour = {"click": _CLICK, "type": _TYPE, "scroll": _SCROLL}.get(mark.kind, _OTHER)
    if point is not None and mark.kind in ("click", "type", "other", "invalid"):
        x, y = point[0] + left, point[1] + top
        draw.ellipse([x - r, y - r, x + r, y + r], outline=colour, width=max(2, r // 3))
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        for (ax, ay), (bx, by) in [((-2, 0), (-1, 0)), ((1, 0), (2, 0)), ((0, -2), (0, -1)), ((0, 1), (0, 2))]:
            draw.line([(x + ax * r, y + ay * r), (x + bx * r, y + by * r)], fill=colour, width=2)
    if mark.kind == "scroll":
        centre = point if point is not None else (w * 0.85, h / 2)
        _arrow(draw, (centre[0] + left, centre[1] + top), mark.direction, min(w, h) / 4, _SCROLL)
    if mark.kind == "type" and mark.text:
        anchor = point if point is not None else (8, h / 2)
        text = f"type: {mark.text[:60]}"
        tb = draw.textbbox((0, 0), text, font=font)
        tx = left + min(anchor[0] + r + 4, max(0, w - (tb[2] - tb[0]) - 8))
        ty = top + min(anchor[1] + r + 4, h - (tb[3] - tb[1]) - 8)
        draw.rectangle([tx - 3, ty - 3, tx + tb[2] - tb[0] + 3, ty + tb[3] - tb[1] + 3],
                       fill=(255, 255, 255), outline=_TYPE, width=2)
        draw.text((tx, ty - tb[1]), text, fill=_TYPE, font=font)


def draw_action(png: bytes, action: dict[str, Any] | None, invalid: bool, coord_mode: str = "pixel") -> bytes | None:
    """PNG bytes of the screenshot with the action drawn on it, or None if `png` is not an image."""
    try:
        img = Image.open(io.BytesIO(png))
        img.load()
        img = img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None
    orig = img.size
    mark = action_mark(action, invalid, orig, coord_mode)
    scale = max(1.0, MIN_WIDTH / max(1, orig[0]))
    if scale > 1.0:
        img = img.resize((round(orig[0] * scale), round(orig[1] * scale)), Image.NEAREST)
    w, h = img.size
    font = _font(max(13, min(28, w // 32)))
    point = None
    if mark.point is not None:
        point = (min(max(mark.point[0] * scale, 0), w - 1), min(max(mark.point[1] * scale, 0), h - 1))
    caption = _caption(mark, invalid)
    bad = invalid or mark.kind == "invalid"
    # The caption goes on a strip above the screenshot, so it never hides what the model saw.
    bh = _banner_height(caption, font)
    canvas = Image.new("RGB", (w, h + bh), "white")
    canvas.paste(img, (0, bh))
    draw = ImageDraw.Draw(canvas)
    _draw_marks(draw, mark, point, (0, bh, w, h), font)
    if bad:
        draw.rectangle([0, bh, w - 1, h + bh - 1], outline=_CLICK, width=max(3, w // 120))
    colour = {"click": _CLICK, "type": _TYPE, "scroll": _SCROLL}.get(mark.kind, _OTHER)
    _banner(draw, w, bh, caption, _CLICK if bad else colour, font)
    out = io.BytesIO()
    canvas.save(out, format="PNG", compress_level=3)
    return out.getvalue()
