"""What the agent sees: the viewport screenshot, the list of interactive elements, and the optional
set-of-marks overlay.

Invariant: element ids are 1..N over the elements of the CURRENT observation, and each element's box
is in viewport pixels, so `click [id]` and `Click [x, y]` address the same screen the model saw. Under
`env.element_ids=drawn` (the default) the ids are a permutation of 1..N drawn per observation from
(task, episode seed, observation index), so an id carries no position: a constant answer such as
`click [1]` hits a random element. The list stays in document order (it is how the page reads); the
element text, the set-of-marks overlay and the action executor all read the same `id` field, and
`index` keeps the runtime's document position (what `select` addresses in the page).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import random
from typing import Any

from PIL import Image, ImageDraw

log = logging.getLogger(__name__)
MAX_ELEMENTS = 40
"""cap on listed elements: the list is prompt text, and prompt length dominates CPU cost"""

# A JS function expression: (maxN) -> [[{id, role, name, box:[x,y,w,h], point?, covered?, checked?,
# selected?, expanded?, editable?, value?, options?}], [DOM nodes], nameOf, selectState, ariaState]. Interactive = form controls, links
# (with or without href), ARIA roles, click handlers, or a pointer cursor (MiniWoB styles its links
# that way). Listed: rendered (checkVisibility, ancestors' opacity included), enabled, inside the
# viewport; `covered` when no sample point of the element receives a click (something lies on top).
ELEMENTS_FN = r"""
(maxN) => {
  const W = window.innerWidth, H = window.innerHeight;
  const SEL = 'a,button,input,select,textarea,summary,[role=button],[role=link],[role=tab],' +
              '[role=checkbox],[role=radio],[role=menuitem],[role=menuitemcheckbox],[role=menuitemradio],' +
              '[role=option],[role=treeitem],[role=switch],[role=slider],[role=spinbutton],[role=combobox],' +
              '[onclick],[tabindex],.ui-menu-item';
  const STRONG = SEL.replace(',[onclick],[tabindex]', '');
  const clean = (n) => (n || '').replace(/\s+/g, ' ').trim();
  const roleOf = (e) => {
    const r = e.getAttribute('role'); if (r) return r;
    const t = e.tagName.toLowerCase();
    if (t === 'a') return 'link';
    if (t === 'button' || t === 'summary') return 'button';
    if (t === 'select') return e.multiple ? 'listbox' : 'combobox';
    if (t === 'textarea') return 'textbox';
    if (t === 'input') {
      const ty = (e.getAttribute('type') || 'text').toLowerCase();
      if (ty === 'checkbox' || ty === 'radio') return ty;
      if (ty === 'submit' || ty === 'button' || ty === 'reset') return 'button';
      if (ty === 'number') return 'spinbutton';
      return 'textbox';
    }
    if (e.classList.contains('ui-menu-item')) return 'option';
    return 'clickable';
  };
  // words an icon-only control's classes say (jQuery UI spinner arrows, datepicker arrows, close boxes)
  const ICON_WORDS = [[/(^|[-_ ])(up|triangle-1-n|increment|increase|plus)([-_ ]|$)/, 'up'],
                      [/(^|[-_ ])(down|triangle-1-s|decrement|decrease|minus)([-_ ]|$)/, 'down'],
                      [/(^|[-_ ])(prev|previous|circle-triangle-w|triangle-1-w)([-_ ]|$)/, 'previous'],
                      [/(^|[-_ ])(next|circle-triangle-e|triangle-1-e)([-_ ]|$)/, 'next'],
                      [/(^|[-_ ])(close|closethick)([-_ ]|$)/, 'close']];
  const iconWord = (e) => {
    const cls = [e, ...e.querySelectorAll('*')].slice(0, 5).map((x) => String(x.className || '')).join(' ');
    for (const [re, w] of ICON_WORDS) if (re.test(cls.toLowerCase())) return w;
    return '';
  };
  // text of `c` outside its interactive descendants (a datepicker header without its arrows)
  const plainText = (c) => {
    if (!c) return '';
    const w = document.createTreeWalker(c, NodeFilter.SHOW_TEXT);
    let out = '';
    for (let t = w.nextNode(); t && out.length < 80; t = w.nextNode()) {
      const p = t.parentElement;
      if (p && !p.closest('a,button,[role=button],[title]')) out += ' ' + t.nodeValue;
    }
    return clean(out);
  };
  // a short name (a day "7", a cell "3") inside a table: add what the table is about (its caption,
  // aria-label, or the text just before it: the datepicker's "December 2016")
  const tableContext = (e, n) => {
    if (n.length > 3) return '';
    const tb = e.closest('table');
    if (!tb) return '';
    const cap = tb.getAttribute('aria-label') || (tb.caption ? tb.caption.innerText : '');
    return clean(cap) || plainText(tb.previousElementSibling);
  };
  // text just before an unnamed control among its siblings (a spinner's arrows follow its input);
  // for a text field (`ownText`) the search stops at another control: a button's or link's text names
  // that control, not the field after it
  const nearby = (e, ownText) => {
    for (let x = e.previousSibling; x; x = x.previousSibling) {
      if (ownText && x.nodeType === 1 && (x.matches(STRONG) || x.querySelector(STRONG))) return '';
      const t = clean(x.nodeType === 3 ? x.nodeValue : (x.nodeType === 1 ? x.innerText : ''));
      if (t) return t;
    }
    return '';
  };
  const nameOf = (e) => {
    let n = e.getAttribute('aria-label') || '';
    const lb = e.getAttribute('aria-labelledby');
    if (!n && lb) n = lb.split(/\s+/).map((i) => { const x = document.getElementById(i); return x ? x.innerText : ''; }).join(' ');
    if (!n && e.labels && e.labels.length) n = e.labels[0].innerText;
    if (e.tagName === 'SELECT') return clean(n || e.getAttribute('title')).slice(0, 40);
    // a text field without a label element: its placeholder or title, else the text just before it (a
    // sibling <label> that names no control: login forms); never what it holds (that is its value)
    if (!n && e.tagName === 'INPUT' && ['button', 'submit', 'reset'].includes(e.type)) n = e.value || '';
    if (!n && (e.tagName === 'INPUT' || e.tagName === 'TEXTAREA'))
      n = e.getAttribute('placeholder') || e.getAttribute('title') || nearby(e, true) || '';
    if (!n) n = e.innerText || '';
    if (!clean(n)) n = e.getAttribute('title') || e.getAttribute('alt') || '';
    if (!clean(n)) {
      const w = iconWord(e);
      if (w) { const near = nearby(e); n = near ? `${near} ${w}` : w; }
    }
    if (!clean(n) && e.tagName !== 'INPUT' && e.tagName !== 'TEXTAREA') n = e.textContent || '';
    n = clean(n);
    const ctx = n ? tableContext(e, n) : '';
    if (ctx) n = `${n} ${ctx}`;
    return n.length > 40 ? n.slice(0, 40) : n;
  };
  // the state of a tab or an accordion header (ARIA, as jQuery UI sets it): which tab is shown,
  // which section is open; refreshed in place, so a state that ends is removed
  const ariaState = (e, rec) => {
    const expanded = e.getAttribute('aria-expanded');
    if (expanded === 'true' || expanded === 'false') rec.expanded = expanded === 'true';
    else delete rec.expanded;
    if (e.getAttribute('aria-selected') === 'true' && rec.role === 'tab') rec.selected = true;
    else delete rec.selected;
  };
  const seen = new Set(), out = [], kept = [];
  const selectState = (e, rec) => {
    const t = (o) => clean(o.label || o.text).slice(0, 60);
    rec.value = Array.from(e.selectedOptions || []).map(t).join(' | ');
    rec.options = Array.from(e.options).slice(0, 20).map(t);
  };
  const shown = (e) => {
    if (e.checkVisibility) return e.checkVisibility({opacityProperty: true, visibilityProperty: true});
    const s = getComputedStyle(e);
    return !(s.visibility === 'hidden' || s.display === 'none' || s.opacity === '0');
  };
  const consider = (e) => {
    if (seen.has(e) || out.length >= maxN) return;
    seen.add(e);
    if (e.id === 'sync-task-cover' || e.disabled || e.closest('fieldset:disabled') ||
        e.getAttribute('aria-disabled') === 'true') return;
    if (e.tagName === 'INPUT' && (e.type || '').toLowerCase() === 'hidden') return;
    const r = e.getBoundingClientRect();
    if (r.width < 1 || r.height < 1 || r.right <= 0 || r.bottom <= 0 || r.left >= W || r.top >= H) return;
    if (!shown(e)) return;
    const name = nameOf(e);
    // a control nested in an already listed one with the same label (tab <li> holding its <a>)
    for (const o of kept) if (o.contains(e) && o.__awrName === name) return;
    const x = Math.max(0, r.left), y = Math.max(0, r.top);
    e.__awrName = name; kept.push(e);
    const rec = {id: out.length + 1, role: roleOf(e), name: name,
                 box: [Math.round(x), Math.round(y), Math.round(Math.min(W, r.right) - x),
                       Math.round(Math.min(H, r.bottom) - y)]};
    if (e.type === 'checkbox' || e.type === 'radio') rec.checked = !!e.checked;
    ariaState(e, rec);
    if (e.tagName === 'SELECT') selectState(e, rec);
    else if (e.tagName === 'TEXTAREA' || (e.tagName === 'INPUT' && rec.role !== 'checkbox' && rec.role !== 'radio'))
      rec.value = clean(e.value).slice(0, 60);  // what it holds, apart from its label
    if (e.isContentEditable) rec.editable = true;  // a rich-text editor <div>: typed into like a textbox
    // a point where the element itself receives the click (siblings may overlap its center); none =
    // covered: a click on it lands on whatever lies on top (an open drop-down, a dialog)
    const [bx, by, bw, bh] = rec.box;
    for (const [fx, fy] of [[.5, .5], [.25, .25], [.75, .25], [.25, .75], [.75, .75], [.5, .15], [.5, .85], [.15, .5], [.85, .5]]) {
      const px = bx + bw * fx, py = by + bh * fy, hit = document.elementFromPoint(px, py);
      if (hit && (hit === e || e.contains(hit) || (e.labels && Array.from(e.labels).some((l) => l.contains(hit))))) {
        rec.point = [Math.round(px), Math.round(py)]; break;
      }
    }
    if (!rec.point) rec.covered = true;
    out.push(rec);
  };
  const all = document.body ? document.body.getElementsByTagName('*') : [];
  for (const e of all) {
    if (out.length >= maxN) break;
    if (e.matches(SEL)) {
      // a focusable or click-handling box that holds controls of its own (an open menu's <ul
      // tabindex>) is a container: its items are listed, it is not
      if (!e.matches(STRONG) && e.querySelector(SEL)) continue;
      consider(e); continue;
    }
    // a pointer-styled element, unless its parent is one too or it holds controls of its own (an open
    // menu's list: its items are listed, the list is not)
    if (getComputedStyle(e).cursor === 'pointer' && !e.querySelector(SEL) &&
        !(e.parentElement && getComputedStyle(e.parentElement).cursor === 'pointer')) consider(e);
  }
  return [out, kept, nameOf, selectState, ariaState];
}
"""

# Installed into every document by the browser pool (an init script): `window.__awr.elements(n)`
# returns the element list, re-extracting only after the DOM changed (MutationObserver), the page
# scrolled or resized; otherwise it refreshes only what changes without a mutation (form values,
# checked state). Extraction is the costliest part of a step; most steps do not change the DOM.
RUNTIME_JS = r"""
(() => {
  if (window.__awr) return;
  const extract = """ + ELEMENTS_FN + r""";
  let dirty = true, cache = null, refs = [], nameOf = null, selectState = null, ariaState = null, cachedN = -1, changes = 0;
  // the page's own clock and timer functions may be replaced later; settle() uses these
  const now = performance.now.bind(performance), wait = setTimeout.bind(window);
  const getAnimations = document.getAnimations.bind(document);
  let lastChange = now();
  const NOISE = new Set(['data-tampered', 'data-wob_eps', 'data-wob_ref']);
  const note = (records) => {
    for (const r of records) {
      if (r.type === 'attributes' && NOISE.has(r.attributeName)) continue;
      const t = r.target.nodeType === 1 ? r.target : r.target.parentElement;
      if (t && t.closest && t.closest('#reward-display')) continue;  // MiniWoB's hidden HUD timer
      dirty = true; changes++; lastChange = now(); return;
    }
  };
  const mo = new MutationObserver(note);
  mo.observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
  addEventListener('scroll', () => { dirty = true; changes++; lastChange = now(); }, true);
  for (const ev of ['input', 'change', 'focusin', 'focusout']) addEventListener(ev, () => { changes++; }, true);
  addEventListener('resize', () => { dirty = true; });
  const api = {
    elements(maxN) {
      note(mo.takeRecords());
      if (dirty || maxN !== cachedN || !cache) {
        const r = extract(maxN);
        cache = r[0]; refs = r[1]; nameOf = r[2]; selectState = r[3]; ariaState = r[4]; cachedN = maxN; dirty = false; api.extractions++;
        return cache;
      }
      for (let i = 0; i < refs.length; i++) {
        const e = refs[i], rec = cache[i];
        if (e.type === 'checkbox' || e.type === 'radio') rec.checked = !!e.checked;
        ariaState(e, rec);
        if (e.tagName === 'INPUT' || e.tagName === 'TEXTAREA') {
          rec.name = nameOf(e);
          if ('value' in rec) rec.value = (e.value || '').replace(/\s+/g, ' ').trim().slice(0, 60);
        }
        if (e.tagName === 'SELECT') selectState(e, rec);
      }
      return cache;
    },
    // how many page changes (DOM mutations, input/change/focus events, scrolls) have happened so far
    changes() { note(mo.takeRecords()); return changes; },
    // set the selection of the <select> at document position `index` of the last element list (the
    // agent's element `id`) to `option`: one option (its text, label or value; exact, then case- and
    // space-insensitive), or for a multi-select several joined by " | " (the whole selection: the
    // others are cleared). No focus first: focusing opens custom drop-downs over the next target.
    // Returns '' or why not.
    select(index, option, id) {
      const e = refs[index - 1];
      if (!e || !e.isConnected) return `no element [${id}] on the page`;
      if (e.tagName !== 'SELECT') return `element [${id}] is not a drop-down list (<select>)`;
      const norm = (x) => (x || '').replace(/\s+/g, ' ').trim().toLowerCase();
      const opts = Array.from(e.options);
      const find = (want) => opts.find((x) => x.text === want || x.label === want || x.value === want) ||
                             opts.find((x) => norm(x.text) === norm(want) || norm(x.value) === norm(want));
      let chosen = [find(option)];
      if (!chosen[0] && e.multiple) chosen = String(option).split('|').map((w) => w.trim()).filter((w) => w).map(find);
      const missing = chosen.findIndex((o) => !o);
      if (missing >= 0 || !chosen.length)
        return `element [${id}] has no option "${String(option).slice(0, 40)}"`;
      const off = chosen.find((o) => o.disabled);
      if (off) return `option "${String(off.text).slice(0, 40)}" is disabled`;
      for (const o of opts) o.selected = chosen.includes(o);
      e.dispatchEvent(new Event('input', {bubbles: true}));
      e.dispatchEvent(new Event('change', {bubbles: true}));
      return '';
    },
    // resolves (with the ms waited) once the page has settled: no running finite animation or
    // transition, and no DOM change for `quietMs` (counted from the call too: a handler's deferred
    // change is waited for), or the global `doneFlag` is true, or after `maxMs` whatever the page does
    settle(quietMs, maxMs, doneFlag) {
      const t0 = now();
      return new Promise((resolve) => {
        const tick = () => {
          note(mo.takeRecords());
          const t = now();
          if (doneFlag && window[doneFlag] === true) return resolve(Math.round(t - t0));  // the episode ended
          const moving = getAnimations().some((a) => {
            if (a.playState !== 'running' || !a.effect) return false;
            const end = a.effect.getComputedTiming().endTime;
            return Number.isFinite(end);  // an endless spinner never settles: not waited for
          });
          if ((!moving && t - Math.max(lastChange, t0) >= quietMs) || t - t0 >= maxMs) resolve(Math.round(t - t0));
          else wait(tick, 10);
        };
        tick();
      });
    },
    invalidate() { dirty = true; },
    extractions: 0,
  };
  Object.defineProperty(window, '__awr', {value: api, writable: false, configurable: false, enumerable: false});
})();
"""

def elements_expression(max_n: int) -> str:
    """Expression for `PageReader.main_world`: [element list, page change count] of the current page
    (empty on pages the runtime could not enter). Its value is copied out by V8, never by the page's
    JSON.stringify; `window.__awr` is a non-writable, non-configurable property set before any page
    script runs, so a page cannot swap it."""
    return f"window.__awr ? [window.__awr.elements({int(max_n)}), window.__awr.changes()] : [[], -1]"


def clean_elements(value: Any) -> list[dict[str, Any]]:
    """The element records of a page read, keeping only well-formed ones: the list comes from the page's
    world, where a page can reach the runtime's cache and bend its records."""
    if not isinstance(value, list):
        return []

    def nums(v: Any, n: int) -> bool:
        return (isinstance(v, list) and len(v) == n
                and all(isinstance(x, int | float) and not isinstance(x, bool) and abs(x) < 1e6 for x in v))

    out = []
    for e in value[:MAX_ELEMENTS]:
        if not (isinstance(e, dict) and isinstance(e.get("id"), int) and isinstance(e.get("role"), str)
                and isinstance(e.get("name"), str) and nums(e.get("box"), 4)):
            continue
        if "point" in e and not nums(e["point"], 2):
            e = {k: v for k, v in e.items() if k != "point"}
        if "value" in e and not isinstance(e["value"], str):
            e = {k: v for k, v in e.items() if k != "value"}
        if "options" in e and not (isinstance(e["options"], list) and all(isinstance(o, str) for o in e["options"])):
            continue
        out.append(e)
    return out


def assign_ids(elements: list[dict[str, Any]], mode: str, key: str) -> list[dict[str, Any]]:
    """Number the (cleaned) elements of one observation in place and return them: `index` = the
    runtime's document position (the id it read back, what `window.__awr.select` addresses), `id` =
    the id the agent sees: 1..N in document order under mode "document", a permutation of 1..N drawn
    from `key` (task, seed, observation index) under mode "drawn", so equal episodes see equal ids
    and runs are reproducible."""
    for i, e in enumerate(elements, 1):
        e["index"] = e["id"]
        e["id"] = i
    if mode == "drawn" and len(elements) > 1:
        ids = list(range(1, len(elements) + 1))
        random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")).shuffle(ids)
        for e, i in zip(elements, ids, strict=True):
            e["id"] = i
    elif mode not in ("drawn", "document"):
        raise ValueError(f"element id mode must be 'drawn' or 'document', not {mode!r}")
    return elements


def observation_key(task_id: str, seed: int, index: int) -> str:
    """What the drawn ids of one observation are seeded from."""
    return f"{task_id}#{seed}#{index}"


def _element_line(e: dict[str, Any]) -> str:
    line = f"[{e['id']}] {e['role']} \"{e['name']}\"" + (" (checked)" if e.get("checked") else "")
    if e.get("selected"):  # the tab shown, the accordion section open
        line += " (selected)"
    elif "expanded" in e and e["role"] != "tab":  # a menu button, a disclosure: open or shut
        line += " (expanded)" if e["expanded"] else " (collapsed)"
    if e.get("covered"):  # nothing of it takes a click: something lies on top
        line += " (covered)"
    if "options" in e:  # a <select>: its current value and its choices, each on its own
        line += f" value=\"{e.get('value', '')}\" options: " + " | ".join(e["options"])
    elif e.get("value") and e["value"] != e["name"]:  # a labelled text field: what it holds
        line += f" value=\"{e['value']}\""
    return line


def elements_text(elements: list[dict[str, Any]]) -> str:
    """One short line per element: `[3] button "Submit"`; a drop-down list shows its value and its
    options apart: `[2] combobox "" value="Alpha" options: Alpha | Beta` (what the prompt shows)."""
    return "\n".join(_element_line(e) for e in elements)


def element_by_id(elements: list[dict[str, Any]], eid: int) -> dict[str, Any] | None:
    for e in elements:
        if e.get("id") == eid:
            return e
    return None


def draw_set_of_marks(png: bytes, elements: list[dict[str, Any]]) -> bytes:
    """The screenshot with each element's box outlined and its id written at the box's corner."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    draw = ImageDraw.Draw(img)
    for e in elements:
        x, y, w, h = e["box"]
        draw.rectangle([x, y, x + max(w - 1, 0), y + max(h - 1, 0)], outline=(255, 0, 0))
        label = str(e["id"])
        tw = 6 * len(label) + 2
        draw.rectangle([x, y, x + tw, y + 10], fill=(255, 0, 0))
        draw.text((x + 1, y - 1), label, fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def settle_quiet_ms(cfg: Any, action: dict[str, Any] | None) -> float:
    """The quiet window after `action` (env.settle_quiet_ms; env.settle_type_quiet_ms after typing)."""
    if action is not None and action.get("type") == "type":
        return max(cfg.settle_quiet_ms, cfg.settle_type_quiet_ms)
    return cfg.settle_quiet_ms


async def settle(page, quiet_ms: float, max_ms: float, done_flag: str = "") -> float:
    """Wait until the page has settled (`window.__awr.settle`: no running animation or transition, no
    DOM change for `quiet_ms`), at most `max_ms`; returns the ms waited, or -1 when the document was
    replaced meanwhile (a navigation: the caller waits for the load). max_ms <= 0: no wait."""
    if max_ms <= 0:
        return 0.0
    try:
        waited = await asyncio.wait_for(
            page.evaluate("([q, m, f]) => window.__awr ? window.__awr.settle(q, m, f) : 0",
                          [float(quiet_ms), float(max_ms), done_flag]), max_ms / 1000 + 2.0)
    except Exception as e:
        if page.is_closed() or isinstance(e, asyncio.TimeoutError):
            raise
        log.debug("settle: %s", e)  # the document went away under the wait (a navigation)
        return -1.0
    return float(waited) if isinstance(waited, int | float) and not isinstance(waited, bool) else -1.0


async def take_screenshot(page) -> bytes:
    """PNG bytes of the viewport (no animations wait: `settle` ran before it)."""
    return await page.screenshot(type="png", animations="allow", caret="initial", timeout=10_000)
