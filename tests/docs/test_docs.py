"""The README and docs/ say only what the results files say, and nothing about how they were made.

Rules a writer of README.md and docs/*.md follows (this test enforces them):

- A figure taken from a results file is a markdown link whose target is the file plus a fragment
  naming the JSON path inside it: `[0.85x](../bench/results/e2e.json#figures.steady_state_speedup)`.
  - The path is dotted; list indices are integers (`figures.eval.0.success_rate`). A key that itself
    contains a dot (`per_size.1.5B`) is matched as the longest key that fits.
  - The link text is one number, optionally with a leading `~`, a sign and thousands commas, and
    optionally one trailing unit (`x`, `s`, `ms`, `%`, `GiB`, `GB/s`, `tokens/s`, ...).
  - Results files hold base units: fractions, seconds, bytes. A unit inside the link text scales the
    value: `%` = value x 100, `ms` = value x 1000, `kB` / `MB` / `GB` = bytes / 1e3 / 1e6 / 1e9. Any
    other unit (`x`, `s`, `GiB`, `GB/s`, `tokens/s`, ...) is decoration. A figure the file already holds
    in a scaled unit (`pss_mb_per_session`) keeps its unit outside the link: `[22.5](...) MB`.
  - The shown number must equal the value rounded to the decimals shown (half a unit of the last
    digit, so `0.85` matches 0.8501 and `1,312` matches 1311.9).
  - A text value (`GraphEngine`) must be shown exactly.
- Every relative link target exists; a fragment on a results file names an existing key.
- README.md, docs/*.md and the default config name no machine paths (/work/, /tmp/), no
  development history ("this session", "2-core box", "this box", "at commit") and no commit hashes
  (7-40 hex characters with at least one digit and one letter). Link targets are exempt from the hash
  check only: some results files carry the code version in their name.
- README.md is at most 200 lines and links every docs/*.md file.

The test only reads files.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, *DOCS]
DEFAULT_YAML = ROOT / "asyncwebrl" / "configs" / "default.yaml"

LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])+)\]\(([^)\s]+)\)")
FIGURE = re.compile(r"^~?\s*([+\-\u2212]?\d[\d,]*(?:\.\d+)?)\s*([A-Za-z%/]+)?$")
HASH = re.compile(r"(?<![0-9A-Za-z_])[0-9a-fA-F]{7,40}(?![0-9A-Za-z_])")
SCALE = {"%": 100.0, "ms": 1e3, "kB": 1e-3, "MB": 1e-6, "GB": 1e-9}
FORBIDDEN = [re.compile(p, re.IGNORECASE) for p in (
    r"/work/", r"/tmp/", r"this session", r"2-core box", r"this box", r"at commit")]


def _links(path: Path) -> list[tuple[int, str, str]]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for m in LINK.finditer(line):
            out.append((n, m.group(1), m.group(2)))
    return out


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")


def resolve(doc: object, dotted: str) -> object:
    """doc at a dotted path; integers index lists; a key may itself contain dots (longest match)."""
    parts = dotted.split(".")
    node = doc
    i = 0
    while i < len(parts):
        if isinstance(node, list):
            node = node[int(parts[i])]
            i += 1
            continue
        if not isinstance(node, dict):
            raise KeyError(f"{'.'.join(parts[:i])} is a {type(node).__name__}, not an object")
        for j in range(len(parts), i, -1):
            key = ".".join(parts[i:j])
            if key in node:
                node = node[key]
                i = j
                break
        else:
            raise KeyError(f"no key {parts[i]!r} under {'.'.join(parts[:i]) or 'the top level'}")
    return node


def check_figure(text: str, value: object) -> str | None:
    """None if the link text shows value under the rules above, else what is wrong."""
    shown_text = text.replace("`", "").replace("*", "").strip()
    if isinstance(value, str):
        return None if shown_text == value else f"shows {shown_text!r}, the file holds {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"the path names a {type(value).__name__}, not a number or text"
    m = FIGURE.match(shown_text)
    if not m:
        return f"link text {text!r} is not one number with an optional unit"
    number, unit = m.group(1).replace(",", "").replace("\u2212", "-"), m.group(2) or ""
    decimals = len(number.split(".")[1]) if "." in number else 0
    expected = float(value) * SCALE.get(unit, 1.0)
    if not math.isfinite(expected) or abs(float(number) - expected) > 0.5 * 10 ** -decimals + 1e-9:
        return f"shows {number}{unit}, the file holds {value} ({round(expected, decimals)} at {decimals} decimals)"
    return None


def _figure_links() -> list[tuple[str, str, Path, str]]:
    out = []
    for md in MARKDOWN:
        for n, text, target in _links(md):
            path, _, fragment = target.partition("#")
            if path.endswith(".json") and "bench/results/" in path and _relative(target):
                out.append((f"{md.relative_to(ROOT)}:{n}", text, (md.parent / path).resolve(), fragment))
    return out


def test_the_docs_exist_and_the_rules_have_something_to_check():
    assert DOCS, "docs/ holds no markdown files"
    assert len(_figure_links()) >= 20


def test_every_relative_link_points_to_a_file_that_exists():
    broken = []
    for md in MARKDOWN:
        for n, _, target in _links(md):
            if _relative(target):
                path = target.partition("#")[0]
                if path and not (md.parent / path).exists():
                    broken.append(f"{md.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_every_figure_linked_to_a_results_file_matches_that_file():
    wrong = []
    cache: dict[Path, object] = {}
    for where, text, path, fragment in _figure_links():
        if not path.exists():
            wrong.append(f"{where}: {path.name} does not exist")
            continue
        if not fragment:
            continue  # a plain reference to the file, not a figure
        if path not in cache:
            cache[path] = json.loads(path.read_text())
        try:
            value = resolve(cache[path], fragment)
        except (KeyError, IndexError, ValueError) as e:
            wrong.append(f"{where}: {path.name}#{fragment}: {e}")
            continue
        problem = check_figure(text, value)
        if problem:
            wrong.append(f"{where}: [{text}]({path.name}#{fragment}): {problem}")
    assert not wrong, "figures that disagree with their results files:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", [*MARKDOWN, DEFAULT_YAML], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_machine_paths_history_or_commit_hashes(path):
    found = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for pattern in FORBIDDEN:
            if pattern.search(line):
                found.append(f"{n}: {pattern.pattern!r}: {line.strip()}")
        prose = LINK.sub(lambda m: m.group(1), line)  # link targets may name versioned results files
        for m in HASH.finditer(prose):
            token = m.group(0)
            if re.search(r"\d", token) and re.search(r"[a-fA-F]", token):
                found.append(f"{n}: commit-like hash {token!r}: {line.strip()}")
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(found)


def test_readme_is_an_entry_point_that_maps_every_doc():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200)"
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, _, t in _links(README) if _relative(t)}
    unlinked = [d.name for d in DOCS if d.resolve() not in linked]
    assert not unlinked, f"docs not linked from README.md: {unlinked}"


@pytest.mark.parametrize("text, value, ok", [
    ("0.85x", 0.8501471, True), ("0.86x", 0.8501471, False), ("1,312 s", 1311.92, True),
    ("0.63%", 0.00625, True), ("63%", 0.00625, False), ("255", 254.72, True), ("GraphEngine", "GraphEngine", True),
    ("**0.367**", 0.36666, True), ("+0.30", 0.3, True), ("about 0.3", 0.3, False),
    ("75.7 ms", 0.07567, True), ("1.89 MB", 1888449, True), ("371 GB/s", 371.4, True), ("-4.3%", -0.0432, True),
])
def test_the_figure_rule(text, value, ok):
    assert (check_figure(text, value) is None) == ok


def test_dotted_paths_take_list_indices_and_keys_with_dots():
    doc = {"figures": {"eval": [{"v": 1}, {"v": 2}], "per_size": {"1.5B": {"s": 3}}}}
    assert resolve(doc, "figures.eval.1.v") == 2
    assert resolve(doc, "figures.per_size.1.5B.s") == 3
    with pytest.raises(KeyError):
        resolve(doc, "figures.missing")
