// Episode browser of the AsyncWebRL run report. Reads the episodes embedded in the page
// (<script id="episode-data" type="application/json">), so it works from file:// without a server.
// Invariant: the list shows exactly the episodes that pass every filter; the step viewer always shows
// a step of the selected episode, or a placeholder when nothing is selected.
(function () {
  "use strict";
  const node = document.getElementById("episode-data");
  if (!node) return;
  const data = JSON.parse(node.textContent);
  const episodes = data.episodes || [];
  const $ = (id) => document.getElementById(id);
  const state = { ep: null, k: 0 };

  function text(el, s) { el.textContent = s == null ? "" : String(s); }
  function fmt(x, d) { return (typeof x === "number" && isFinite(x)) ? x.toFixed(d) : "n/a"; }

  function fillSelect(sel, values, label) {
    for (const v of values) {
      const o = document.createElement("option");
      o.value = String(v); o.textContent = label(v); sel.appendChild(o);
    }
  }

  function matches(ep) {
    const task = $("filter-task").value, ver = $("filter-version").value, out = $("filter-outcome").value;
    if (task !== "all" && ep.task_id !== task) return false;
    if (ver !== "all" && String(ep.version) !== ver) return false;
    if (out === "invalid") return ep.n_invalid > 0;
    if (out === "truncated") return ep.truncated;
    if (out !== "all" && ep.outcome !== out) return false;
    return true;
  }

  function renderList() {
    const body = $("episode-rows");
    body.innerHTML = "";
    const shown = episodes.filter(matches);
    text($("episode-count"), shown.length + " of " + episodes.length + " episodes");
    for (const ep of shown) {
      const tr = document.createElement("tr");
      tr.dataset.traj = ep.traj_id;
      tr.className = "episode-row" + (state.ep && state.ep.traj_id === ep.traj_id ? " selected" : "");
      const cells = [ep.task_id, "v" + ep.version, null, fmt(ep.reward, 2), ep.steps.length, ep.n_invalid];
      cells.forEach((c, i) => {
        const td = document.createElement("td");
        if (i === 2) {
          const b = document.createElement("span");
          b.className = "badge " + ep.outcome; text(b, ep.outcome); td.appendChild(b);
          if (ep.truncated) { const t = document.createElement("span"); text(t, " (truncated)"); td.appendChild(t); }
        } else { text(td, c); }
        tr.appendChild(td);
      });
      tr.addEventListener("click", () => select(ep));
      body.appendChild(tr);
    }
    if (state.ep && !shown.some((e) => e.traj_id === state.ep.traj_id)) state.ep = null;
    if (!state.ep && shown.length) { select(shown[0]); return; }
    renderStep();
  }

  function select(ep) {
    state.ep = ep; state.k = 0;
    for (const tr of document.querySelectorAll("#episode-rows tr")) {
      tr.classList.toggle("selected", tr.dataset.traj === ep.traj_id);
    }
    renderStep();
  }

  function renderStep() {
    const ep = state.ep;
    $("viewer-empty").style.display = ep ? "none" : "block";
    $("viewer-body").style.display = ep ? "block" : "none";
    if (!ep) return;
    text($("ep-title"), ep.task_id + " \u2014 " + ep.traj_id);
    text($("ep-instruction"), ep.instruction || "(no instruction recorded)");
    text($("ep-summary"), "version v" + ep.version + ", outcome " + ep.outcome + ", reward " + fmt(ep.reward, 3) +
      ", " + ep.steps.length + " steps, " + ep.n_invalid + " invalid" + (ep.truncated ? ", step budget ran out" : ""));
    const n = ep.steps.length;
    if (!n) {
      text($("step-counter"), "Step 0 / 0");
      $("step-img").style.display = "none"; text($("step-noimg"), "this episode has no steps");
      for (const id of ["step-action-text", "step-parse", "step-reward", "step-versions", "step-logprob", "step-tokens"]) text($(id), "");
      $("prev-step").disabled = true; $("next-step").disabled = true;
      return;
    }
    const s = ep.steps[state.k];
    text($("step-counter"), "Step " + (state.k + 1) + " / " + n);
    $("prev-step").disabled = state.k === 0;
    $("next-step").disabled = state.k >= n - 1;
    if (s.image) {
      $("step-img").src = s.image; $("step-img").style.display = "block"; text($("step-noimg"), "");
    } else {
      $("step-img").removeAttribute("src"); $("step-img").style.display = "none";
      text($("step-noimg"), s.image_note || "no screenshot kept for this step");
    }
    text($("step-action-text"), s.action_text === "" ? "(empty output)" : s.action_text);
    const parse = $("step-parse");
    parse.className = s.invalid ? "invalid-text" : "";
    text(parse, s.invalid ? "INVALID" + (s.action ? " (parsed but not executable): " + JSON.stringify(s.action) : " (did not parse)")
      : (s.action ? JSON.stringify(s.action) : "(no action)"));
    text($("step-reward"), fmt(s.reward, 3));
    text($("step-versions"), s.versions_summary);
    text($("step-logprob"), "mean " + fmt(s.behave_logprob_mean, 3) + ", min " + fmt(s.behave_logprob_min, 3) +
      (typeof s.behave_logprob_mean === "number" ? " (per-token prob \u2248 " + fmt(Math.exp(s.behave_logprob_mean), 3) + ")" : ""));
    text($("step-tokens"), s.n_prompt_tokens + " prompt, " + s.n_output_tokens + " generated");
  }

  function move(d) {
    if (!state.ep) return;
    const k = state.k + d;
    if (k >= 0 && k < state.ep.steps.length) { state.k = k; renderStep(); }
  }

  const uniq = (xs) => Array.from(new Set(xs));
  fillSelect($("filter-task"), uniq(episodes.map((e) => e.task_id)).sort(), (v) => v);
  fillSelect($("filter-version"), uniq(episodes.map((e) => e.version)).sort((a, b) => a - b), (v) => "v" + v);
  for (const id of ["filter-task", "filter-version", "filter-outcome"]) $(id).addEventListener("change", renderList);
  $("prev-step").addEventListener("click", () => move(-1));
  $("next-step").addEventListener("click", () => move(1));
  document.addEventListener("keydown", (e) => {
    if (e.target && e.target.tagName === "SELECT") return;
    if (e.key === "ArrowRight") move(1);
    if (e.key === "ArrowLeft") move(-1);
  });
  renderList();
})();
