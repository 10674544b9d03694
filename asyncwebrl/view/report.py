"""`asyncwebrl view RUN_DIR [--serve --port N]`: write RUN_DIR/report/index.html, a static offline
page (episode browser, training plots, timeline, config), and optionally serve it on 127.0.0.1.

Invariant: the report folder reflects the run directory as it is now (plots redrawn, an evicted
episode never lingers) and index.html is replaced atomically; a missing, empty or partial run directory yields a page with
"no data yet" placeholders, never a traceback. Nothing in the page loads from the network.
"""

from __future__ import annotations

import functools
import html
import json
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from asyncwebrl.view.episodes import export_episodes
from asyncwebrl.view.plots import PlotResult, phase_totals, render_plots, series
from asyncwebrl.view.rundata import RunData, RunDirError, load_run

ASSETS = Path(__file__).parent / "assets"
REPORT_DIRNAME = "report"


@dataclass
class ReportResult:
    index: Path
    n_episodes: int
    n_plots: int
    """plots drawn (the rest are 'no data yet' placeholders)"""
    seconds: float


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _placeholder(what: str) -> str:
    return f'<div class="placeholder">no data yet: {_esc(what)}</div>'


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:200]
    return str(v)


def _cards(d: RunData) -> str:
    cards: list[tuple[str, str]] = []
    if d.train:
        last = d.train[-1]
        cards.append(("training steps logged", str(len(d.train))))
        for key, label in [("version", "policy version"), ("success_rate", "success rate (last step)"),
                           ("reward_mean", "reward mean (last step)"), ("trajectories_per_s", "trajectories/s")]:
            if key in last and isinstance(last[key], (int, float)):
                cards.append((label, _fmt(last[key])))
    _, ev = series(d.eval, "success_rate", "version")
    if ev:
        cards.append(("best eval success", f"{max(ev):.3f}"))
        cards.append(("latest eval success", f"{ev[-1]:.3f}"))
    cards.append(("episodes kept", str(len(d.episodes))))
    if d.episodes:
        ok = sum(e.success for e in d.episodes)
        cards.append(("kept episodes successful", f"{ok}/{len(d.episodes)}"))
    times = [r.get("time") for r in d.train + d.eval if isinstance(r.get("time"), (int, float))]
    if times:
        cards.append(("wall time logged", f"{max(times):.0f} s"))
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="v">{_esc(v)}</div><div class="k">{_esc(k)}</div></div>' for k, v in cards
    ) + "</div>"


def _table(rows: list[tuple[Any, ...]], head: tuple[str, ...], table_id: str = "") -> str:
    tid = f' id="{_esc(table_id)}"' if table_id else ""
    out = [f"<table{tid}><thead><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td>{_esc(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows]
    return "".join(out) + "</tbody></table>"


def _task_sampling(d: RunData) -> str:
    """Per-task success EMA, sampling share, consumed groups and the evaluation prior (if any) at the
    last step (kind=curriculum)."""
    if not d.curriculum:
        return ""
    last = d.curriculum[-1]
    tasks = sorted({k.split(".", 1)[1] for k in last if "." in k and k.split(".", 1)[0] in ("share", "success")})
    rows = [(t, last.get(f"success.{t}", "not seen"), last.get(f"share.{t}"), last.get(f"groups.{t}"),
             last.get(f"prior.{t}", "none")) for t in tasks]
    mode = (d.summary or {}).get("task_sampling", "")
    head = f"<h3>Task sampling{' (' + _esc(mode) + ')' if mode else ''} at step {_esc(last.get('step', '?'))}</h3>"
    return head + _table(rows, ("task", "success (EMA)", "sampling share", "groups consumed", "prior (eval v0)"),
                         "task-sampling")


def _overview(d: RunData) -> str:
    parts = ['<section id="overview"><h2>Overview</h2>']
    if d.is_empty:
        parts.append(_placeholder("this run has not logged any metrics, timeline or episodes yet "
                                  "(metrics.jsonl, timeline.jsonl and episodes/ are empty or missing)"))
    parts.append(_cards(d))
    if d.summary:
        parts.append("<h3>summary.json</h3>" + _table([(k, v) for k, v in d.summary.items()], ("figure", "value"),
                                                       "summary-table"))
    elif d.summary_metrics:
        last = {k: v for k, v in d.summary_metrics[-1].items() if k != "kind"}
        parts.append("<h3>Run summary (metrics.jsonl)</h3>" + _table(list(last.items()), ("figure", "value"),
                                                                   "summary-table"))
    latest_eval = next((r for r in reversed(d.eval) if isinstance(r.get("per_task"), dict)), None)
    if latest_eval:
        rows = [(t, v.get("success_rate") if isinstance(v, dict) else v) for t, v in sorted(latest_eval["per_task"].items())]
        parts.append(f"<h3>Latest evaluation per task (version {_esc(latest_eval.get('version', '?'))})</h3>"
                     + _table(rows, ("task", "success rate"), "eval-per-task"))
        held = latest_eval.get("heldout_per_task")
        if isinstance(held, dict) and held:
            parts.append("<h3>Held-out tasks (never trained on), same evaluation</h3>"
                         + _table(sorted(held.items()), ("task", "success rate"), "eval-heldout"))
    parts.append(_task_sampling(d))
    if d.problems:
        parts.append('<h3>Could not read</h3><ul class="problems">'
                     + "".join(f"<li>{_esc(p)}</li>" for p in d.problems[:50]) + "</ul>")
    return "".join(parts) + "</section>"


def _episode_section(payload: list[dict[str, Any]]) -> str:
    if not payload:
        return ('<section id="episodes"><h2>Episodes</h2>'
                + _placeholder("no episodes kept yet (episodes/index.jsonl is empty or missing)") + "</section>")
    data = json.dumps({"episodes": payload}, default=str).replace("<", "\\u003c")
    return f"""<section id="episodes"><h2>Episodes</h2>
<div class="filters">
  <label>task <select id="filter-task"><option value="all">all tasks</option></select></label>
  <label>version <select id="filter-version"><option value="all">all versions</option></select></label>
  <label>outcome <select id="filter-outcome">
    <option value="all">all</option><option value="success">success</option>
    <option value="failure">failure</option><option value="invalid">with invalid actions</option>
    <option value="truncated">truncated (budget ran out)</option><option value="crashed">crashed</option>
  </select></label>
  <span id="episode-count"></span>
</div>
<div class="browser">
  <div class="episode-list"><table><thead><tr><th>task</th><th>version</th><th>outcome</th><th>reward</th>
    <th>steps</th><th>invalid</th></tr></thead><tbody id="episode-rows"></tbody></table></div>
  <div class="viewer">
    <div id="viewer-empty" class="placeholder">no episode matches the filters</div>
    <div id="viewer-body">
      <h3 id="ep-title"></h3>
      <div><b>Instruction:</b> <span id="ep-instruction"></span></div>
      <div id="ep-summary" class="note"></div>
      <div class="controls"><button id="prev-step">&larr; prev</button>
        <span id="step-counter"></span><button id="next-step">next &rarr;</button>
        <span class="note">(arrow keys work too)</span></div>
      <img id="step-img" class="shot" alt="screenshot the model saw, with its action drawn on it">
      <div id="step-noimg" class="placeholder-inline"></div>
      <div><b>Model output (raw)</b></div><pre id="step-action-text"></pre>
      <div class="kv">
        <div class="k">parsed action</div><div id="step-parse"></div>
        <div class="k">step reward</div><div id="step-reward"></div>
        <div class="k">per-token versions</div><div id="step-versions"></div>
        <div class="k">behaviour logprob</div><div id="step-logprob"></div>
        <div class="k">tokens</div><div id="step-tokens"></div>
      </div>
    </div>
  </div>
</div>
<script id="episode-data" type="application/json">{data}</script>
</section>"""


def _figure(p: PlotResult, wide: bool = False) -> str:
    cls = ' class="wide"' if wide else ""
    body = (f'<img src="plots/{_esc(p.file)}" alt="{_esc(p.title)}">' if p.file else _placeholder(p.note))
    note = f'<div class="note">{_esc(p.note)}</div>' if p.file and p.note else ""
    return f'<figure id="plot-{_esc(p.key)}"{cls}><figcaption>{_esc(p.title)}</figcaption>{body}{note}</figure>'


def _timeline_section(d: RunData, plots: list[PlotResult]) -> str:
    tl = next(p for p in plots if p.key == "timeline")
    parts = ['<section id="timeline"><h2>Timeline</h2>', '<p class="note">Each bar is one phase of one training '
             "step; bars of different lanes at the same time are work that overlapped. In async mode rollout "
             "keeps generating while the trainer trains; rollout_wait is the trainer waiting for a batch.</p>",
             _figure(tl, wide=True)]
    totals = phase_totals(d)
    if totals:
        parts.append(_table([(p, round(s, 3), sum(1 for r in d.timeline if r["phase"] == p))
                             for p, s in sorted(totals.items(), key=lambda kv: -kv[1])],
                            ("phase", "total seconds", "count"), "phase-totals"))
    return "".join(parts) + "</section>"


def render_page(d: RunData, payload: list[dict[str, Any]], plots: list[PlotResult]) -> str:
    training = "".join(_figure(p) for p in plots if p.key != "timeline")
    config = (f"<details><summary>config.yaml</summary><pre>{_esc(d.config_text)}</pre></details>"
              if d.config_text else _placeholder("config.yaml not written yet"))
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>AsyncWebRL report: {_esc(d.root.resolve().name)}</title>
<link rel="stylesheet" href="assets/report.css"></head>
<body>
<header><h1>AsyncWebRL run report</h1>
<div class="sub">{_esc(d.root.resolve())} &middot; generated {generated}</div></header>
<nav><a href="#overview">Overview</a><a href="#episodes">Episodes</a><a href="#training">Training plots</a>
<a href="#timeline">Timeline</a><a href="#config">Config</a></nav>
<main>
{_overview(d)}
{_episode_section(payload)}
<section id="training"><h2>Training plots</h2><div class="plots">{training}</div></section>
{_timeline_section(d, plots)}
<section id="config"><h2>Config</h2>{config}</section>
</main>
<script src="assets/viewer.js"></script>
</body></html>
"""


def build_report(run_dir: Path | str, out_dir: Path | str | None = None) -> ReportResult:
    """Write the report of `run_dir` into `out_dir` (default RUN_DIR/report); raises RunDirError for a bad path."""
    t0 = time.perf_counter()
    d = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else d.root / REPORT_DIRNAME
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("plots", "assets"):  # episodes/ prunes itself (export_episodes)
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "assets").mkdir()
    for name in ("report.css", "viewer.js"):
        shutil.copyfile(ASSETS / name, out / "assets" / name)
    payload = export_episodes(d.episodes, out, d.coord_mode)
    plots = render_plots(d, out / "plots")
    tmp = out / "index.html.tmp"
    tmp.write_text(render_page(d, payload, plots), encoding="utf-8")
    tmp.replace(out / "index.html")
    return ReportResult(index=out / "index.html", n_episodes=len(payload),
                        n_plots=sum(1 for p in plots if p.file), seconds=time.perf_counter() - t0)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        pass


def make_server(folder: Path, port: int) -> ThreadingHTTPServer:
    """An HTTP server for `folder` bound to 127.0.0.1 only (port 0 = any free port)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 0-65535")
    handler = functools.partial(_QuietHandler, directory=str(folder))
    return _ReportServer(("127.0.0.1", port), handler)


class _ReportServer(ThreadingHTTPServer):
    """Ctrl-C stops it at once: request threads are daemons and closing does not wait for them (a
    browser's lingering connection held the stop past 60 s in a test run)."""

    daemon_threads = True
    block_on_close = False


def view_main(args: Any) -> int:
    """CLI entry: args.run_dir, args.serve, args.port."""
    try:
        res = build_report(args.run_dir)
    except RunDirError as e:
        print(f"view: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a read-only run directory
        print(f"view: cannot write the report into {Path(args.run_dir) / REPORT_DIRNAME}: {e}", file=sys.stderr)
        return 1
    print(f"report: {res.index} ({res.n_episodes} episodes, {res.n_plots} plots, {res.seconds:.1f} s)")
    if not getattr(args, "serve", False):
        return 0
    try:
        server = make_server(res.index.parent, int(args.port))
    except (OSError, ValueError) as e:
        print(f"view: cannot serve on 127.0.0.1:{args.port}: {e}", file=sys.stderr)
        return 1
    print(f"serving http://127.0.0.1:{server.server_address[1]}/index.html  (Ctrl-C to stop)", flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever an imported library installed
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped")
    finally:
        server.server_close()
    return 0
