"""WebGym-style tasks: a JSONL task file (start URL, instruction, step budget, allowed origins,
evaluator) played in the browser pool.

Task file line (one JSON object):
  {"id": "demo/about", "instruction": "...", "start_url": "index.html", "site": "demo_site",
   "difficulty": "easy" | "medium" | "hard"  (or "max_steps": N),
   "allowed_origins": ["https://example.org"], "allow_private": false,
   "evaluator": {"type": "url_match", "pattern": "about.html", "mode": "contains" | "exact" | "regex"}
              | {"type": "answer_match", "answers": ["12"], "mode": "exact" | "contains"}
              | {"type": "js_predicate", "script": "document.getElementById('agree').checked"}
              | {"type": "vlm_judge", "rubric": "..."}}
`site` names a local folder (relative to the task file) served on 127.0.0.1; a relative start_url
is resolved against it and its origin is allowed automatically.

Invariants: a bad task file fails at load with the line number and field named; the episode ends
when the evaluator is satisfied (url/js) or when the agent answers (answer/judge); a navigation the
network fence refuses leaves the agent on the page it was on, the step is invalid and the refusal is
in `StepResult.blocked`; a page the agent went to that cannot be reached (allowed origin down, name
that does not resolve) raises `SiteUnreachable` (the episode fails and is counted); every reset and
step has a deadline (`env.reset_timeout_s`, `env.step_timeout_s`).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from asyncwebrl.web.actions import act
from asyncwebrl.web.base import EnvCrashed, Observation, SiteUnreachable, StepResult, Task, TaskError
from asyncwebrl.web.browser import (
    BrowserPool,
    BrowserSession,
    EpisodeBudget,
    NavigationPolicy,
    fence_target_matches,
)
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.fence import BlockedRequest
from asyncwebrl.web.observe import (
    MAX_ELEMENTS,
    assign_ids,
    clean_elements,
    draw_set_of_marks,
    element_by_id,
    elements_expression,
    observation_key,
    settle,
    settle_quiet_ms,
    take_screenshot,
)
from asyncwebrl.web.pageread import PageReadError, predicate_expression

DIFFICULTY_STEPS = {"easy": 10, "medium": 20, "hard": 30}
EVALUATORS = {
    "url_match": {"pattern"},
    "answer_match": {"answers"},
    "js_predicate": {"script"},
    "vlm_judge": {"rubric"},
}
_KNOWN_FIELDS = {"id", "instruction", "start_url", "site", "difficulty", "max_steps", "allowed_origins",
                 "allow_private", "evaluator"}

DEMO_SITE = Path(__file__).parent / "demo_site"
DEMO_TASKS = DEMO_SITE / "tasks.jsonl"


class TaskFileError(ValueError):
    """A task file line is malformed; the message names file, line and field."""


def _err(path: Path, line: int, field: str, msg: str) -> TaskFileError:
    return TaskFileError(f"{path}:{line}: field '{field}': {msg}")


def _parse_line(obj: Any, path: Path, line: int) -> Task:
    if not isinstance(obj, dict):
        raise _err(path, line, "<line>", f"expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _KNOWN_FIELDS
    if unknown:
        raise _err(path, line, sorted(unknown)[0], f"unknown field (known: {', '.join(sorted(_KNOWN_FIELDS))})")
    for f in ("id", "instruction", "start_url"):
        if not isinstance(obj.get(f), str) or not obj[f].strip():
            raise _err(path, line, f, "required non-empty string")
    if "max_steps" in obj:
        ms = obj["max_steps"]
        if not isinstance(ms, int) or isinstance(ms, bool) or ms < 1:
            raise _err(path, line, "max_steps", f"must be an integer >= 1, got {ms!r}")
    elif "difficulty" in obj:
        if obj["difficulty"] not in DIFFICULTY_STEPS:
            raise _err(path, line, "difficulty", f"must be one of easy/medium/hard, got {obj['difficulty']!r}")
        ms = DIFFICULTY_STEPS[obj["difficulty"]]
    else:
        raise _err(path, line, "max_steps", "give max_steps or difficulty (easy/medium/hard = 10/20/30)")
    origins = obj.get("allowed_origins", [])
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise _err(path, line, "allowed_origins", "must be a list of origin strings")
    for o in origins:
        if o != "*" and not re.match(r"^https?://[^/\s]+$", o.rstrip("/")):
            raise _err(path, line, "allowed_origins", f"'{o}' is not an origin like https://host[:port]")
    if not isinstance(obj.get("allow_private", False), bool):
        raise _err(path, line, "allow_private", "must be true or false")
    site = None
    if "site" in obj:
        if not isinstance(obj["site"], str):
            raise _err(path, line, "site", "must be a folder path string")
        site = (path.parent / obj["site"]).resolve()
        if not site.is_dir():
            raise _err(path, line, "site", f"folder {site} does not exist")
    elif not urlsplit(obj["start_url"]).scheme:
        raise _err(path, line, "start_url", "a relative URL needs a 'site' folder")
    ev = obj.get("evaluator")
    if not isinstance(ev, dict):
        raise _err(path, line, "evaluator", "required object with a 'type'")
    etype = ev.get("type")
    if etype not in EVALUATORS:
        raise _err(path, line, "evaluator.type", f"must be one of {', '.join(EVALUATORS)}, got {etype!r}")
    for need in EVALUATORS[etype]:
        if need not in ev:
            raise _err(path, line, f"evaluator.{need}", f"required for {etype}")
    if etype == "answer_match":
        ans = ev["answers"]
        if isinstance(ans, str):
            ev = {**ev, "answers": [ans]}
        elif not (isinstance(ans, list) and ans and all(isinstance(a, str) for a in ans)):
            raise _err(path, line, "evaluator.answers", "must be a string or a non-empty list of strings")
    if etype == "url_match":
        mode = ev.get("mode", "contains")
        if mode not in ("contains", "exact", "regex"):
            raise _err(path, line, "evaluator.mode", f"must be contains/exact/regex, got {mode!r}")
        if mode == "regex":
            try:
                re.compile(ev["pattern"])
            except re.error as e:
                raise _err(path, line, "evaluator.pattern", f"bad regex: {e}") from None
    for k in ("pattern", "script", "rubric"):
        if k in ev and not isinstance(ev[k], str):
            raise _err(path, line, f"evaluator.{k}", "must be a string")
    spec = {"start_url": obj["start_url"], "site": str(site) if site else None, "allowed_origins": origins,
            "allow_private": obj.get("allow_private", False), "evaluator": ev}
    return Task(task_id=obj["id"], seed=0, max_steps=ms, instruction=obj["instruction"].strip(), spec=spec)


def load_task_file(path: str | Path) -> list[Task]:
    """All tasks of a JSONL file (blank lines and lines starting with # are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"task file {path} does not exist")
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _err(path, i, "<json>", f"not valid JSON ({e.msg} at column {e.colno})") from None
        task = _parse_line(obj, path, i)
        if task.task_id in seen:
            raise _err(path, i, "id", f"duplicate id '{task.task_id}' (first on line {seen[task.task_id]})")
        seen[task.task_id] = i
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"task file {path} holds no tasks")
    return tasks


def _url_matches(url: str, ev: dict[str, Any]) -> bool:
    mode, pat = ev.get("mode", "contains"), ev["pattern"]
    if mode == "exact":
        return url == pat
    if mode == "regex":
        return re.search(pat, url) is not None
    return pat in url


def _answer_matches(answer: str, ev: dict[str, Any]) -> bool:
    norm = (lambda s: s) if ev.get("case_sensitive") else (lambda s: s.lower())
    a = norm(" ".join(answer.split()))
    golds = [norm(" ".join(g.split())) for g in ev["answers"]]
    if ev.get("mode", "exact") == "contains":
        return any(g in a for g in golds)
    return a in golds


async def vlm_judge(env_cfg: EnvConfig, instruction: str, rubric: str, answer: str, png: bytes) -> bool:
    """Ask an OpenAI-compatible chat endpoint whether the episode met the rubric (YES/NO)."""
    import aiohttp

    from asyncwebrl.models.vlm import encode_image_b64

    if not env_cfg.vlm_judge_url:
        raise ValueError("task uses a vlm_judge evaluator but env.vlm_judge_url is not set (the judge is off)")
    prompt = (f"Task: {instruction}\nRubric: {rubric}\nAgent's final answer: {answer or '(none)'}\n"
              "Looking at the final screenshot, did the agent complete the task? Reply YES or NO.")
    body = {"model": env_cfg.vlm_judge_model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": prompt},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + encode_image_b64(png)}}]}]}
    url = env_cfg.vlm_judge_url.rstrip("/") + "/chat/completions"
    timeout = aiohttp.ClientTimeout(total=env_cfg.vlm_judge_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"VLM judge at {url} answered HTTP {r.status}: {(await r.text())[:200]}")
            doc = await r.json()
    text = doc["choices"][0]["message"]["content"] or ""
    return text.strip().upper().startswith("YES")


class WebGymEnv:
    """One browser session playing WebGym-style tasks (implements asyncwebrl.web.base.Env)."""

    def __init__(self, env_cfg: EnvConfig | None = None, pool: BrowserPool | None = None):
        self.cfg = env_cfg or EnvConfig(type="webgym")
        self._pool = pool
        self.session: BrowserSession | None = None
        self.task: Task | None = None
        self._elements: list[dict[str, Any]] = []
        self._last_png = b""
        self._last_url = ""
        self._done = True
        self._pending_blocked: list[BlockedRequest] = []
        """fence records from the reset, reported with the first step"""
        self._changes = -1
        """the page's change count at the last observation (see observe.RUNTIME_JS)"""
        self.budget = EpisodeBudget(self.cfg)
        """the episode's env wall time (env.episode_timeout_s)"""
        self._observations = 0
        """observations taken in this episode (the drawn element ids are seeded from it)"""

    @property
    def pool(self) -> BrowserPool:
        if self._pool is None:
            self._pool = BrowserPool.shared(self.cfg)
        return self._pool

    @staticmethod
    def resolve(task: Task) -> tuple[str, NavigationPolicy]:
        """Absolute start URL and navigation policy of a task (serving its local site if it has one)."""
        spec = task.spec
        origins = list(spec.get("allowed_origins", []))
        start = spec["start_url"]
        if spec.get("site"):
            from asyncwebrl.web.miniwob import static_server

            srv = static_server(Path(spec["site"]))
            start = urljoin(srv.origin + "/", start)
            origins.append(srv.origin)
        if not origins:
            p = urlsplit(start)
            origins = [f"{p.scheme}://{p.netloc}"]
        return start, NavigationPolicy(origins, allow_private=bool(spec.get("allow_private", False)))

    async def reset(self, task: Task) -> Observation:
        if "evaluator" not in task.spec:
            raise ValueError(f"task {task.task_id} has no evaluator; load it with load_task_file")
        if task.spec["evaluator"]["type"] == "vlm_judge" and not self.cfg.vlm_judge_url:
            raise ValueError(f"task {task.task_id} needs the VLM judge; set env.vlm_judge_url")
        self.budget.start()
        obs, _ = await self.budget.run(self._reset(task), self.cfg.reset_timeout_s, f"reset of {task.task_id}",
                                       lambda: self.session)
        return obs

    async def _reset(self, task: Task) -> Observation:
        start, policy = self.resolve(task)
        ok, why = policy.permits(start)
        if not ok:
            raise TaskError(f"task {task.task_id}: start URL {start} is refused by its own policy: {why}")
        self.session = await self.pool.acquire(self.session, self.cfg)
        s = self.session
        s.policy = policy
        try:
            await s.context.clear_cookies()
            failure: Exception | None = None
            try:
                await s.page.goto(start, wait_until="load", timeout=30_000)
            except Exception as e:  # a refused or dead start page: the fence's records say which
                if not s.alive():
                    raise
                failure = e
            blocked = s.take_blocked()
            navs = s.take_navigations() or [start]
            for b in blocked:
                if any(fence_target_matches(u, b) for u in navs):
                    if b.kind == "refused":
                        raise TaskError(f"task {task.task_id}: start URL {start} is refused by the fence: {b.reason}")
                    raise SiteUnreachable(f"task {task.task_id}: start page {b.target} cannot be reached: {b.reason}")
            if failure is not None:
                raise failure
            self._pending_blocked = blocked
            s.episodes += 1
            self.task, self._done, self._observations = task, False, 0
            obs = await self._observe()
        except (EnvCrashed, TaskError):
            raise
        except Exception as e:
            if not s.alive():
                raise EnvCrashed(f"browser died while starting {task.task_id}: {e}") from e
            raise
        self._last_png, self._last_url = obs.screenshot, obs.url
        return obs

    async def _observe(self) -> Observation:
        page = self.session.page
        n = MAX_ELEMENTS if self.cfg.element_list or self.cfg.set_of_marks else 0
        for attempt in range(4):
            try:
                got = await self.session.reader.main_world(elements_expression(n), "element list")
                if not (isinstance(got, list) and len(got) == 2 and isinstance(got[1], int)):
                    raise PageReadError(f"the element list read back as {str(got)[:100]}")
                self._elements, self._changes = clean_elements(got[0]), got[1]
                assign_ids(self._elements, self.cfg.element_ids,
                           observation_key(self.task.task_id, self.task.seed, self._observations))
                self._observations += 1
                png = await take_screenshot(page)
                break
            except PageReadError as e:
                # a navigation started by the last action replaced the document under us: let it land
                if attempt == 3 or not self.session.alive() or e.thrown:
                    raise
                await self._wait_loaded()
            except Exception as e:
                if attempt == 3 or not self.session.alive() or "navigat" not in str(e).lower():
                    raise
                await self._wait_loaded()
        if self.cfg.set_of_marks:
            png = draw_set_of_marks(png, self._elements)
        return Observation(screenshot=png, instruction=self.task.instruction, elements=self._elements, url=page.url)

    async def _land(self, navs: list[str]) -> None:
        """After the main frame requested `navs`: wait (briefly) until the navigation has committed,
        so what we judge is where the page went, not where it was."""
        page = self.session.page
        for _ in range(40):
            if page.url in navs or page.url.startswith("chrome-error:"):
                break
            await asyncio.sleep(0.05)
        await self._wait_loaded()

    async def _fence_outcome(self, info: dict[str, Any]) -> tuple[list[BlockedRequest], bool]:
        """(the fence's records of this step, whether the main frame was put back on the last page).
        Raises SiteUnreachable when the page the agent went to cannot be reached."""
        s, page = self.session, self.session.page
        navs = s.take_navigations()
        if navs:
            await self._land(navs)
        blocked, self._pending_blocked = self._pending_blocked + s.take_blocked(), []
        hit = [b for b in blocked if any(fence_target_matches(u, b) for u in navs)]
        dead = [b for b in hit if b.kind == "unreachable"]
        if dead:
            raise SiteUnreachable(f"{self.task.task_id}: {dead[0].target} cannot be reached: {dead[0].reason}")
        ok, why = s.policy.may_land(page.url)
        if not hit and ok and not page.url.startswith("chrome-error:"):
            return blocked, False
        info["error"] = f"navigation refused: {hit[0].reason if hit else why or 'error page'}"
        if ok and page.url == self._last_url:
            return blocked, True  # the refused navigation never committed: the page is where it was
        await page.goto(self._last_url, wait_until="load", timeout=30_000)
        s.take_navigations()
        blocked += s.take_blocked()
        return blocked, True

    async def step(self, action: dict[str, Any] | None) -> tuple[Observation, StepResult]:
        if self.session is None or self.task is None:
            raise RuntimeError("step() before reset()")
        (obs, res), seconds = await self.budget.run(self._step(action), self.cfg.step_timeout_s,
                                                    f"step of {self.task.task_id}", lambda: self.session)
        res.step_s, res.slow = seconds, seconds >= self.cfg.slow_step_s
        return obs, res

    async def _step(self, action: dict[str, Any] | None) -> tuple[Observation, StepResult]:
        s, ev = self.session, self.task.spec["evaluator"]
        prev_changes, prev_url = self._changes, s.page.url
        info: dict[str, Any] = {}
        executed, success, done = False, False, False
        blocked: list[BlockedRequest] = []
        try:
            executed, info = await act(s.page, action, self._elements, self.cfg, episode_done=self._done)
            if executed and action["type"] in ("click", "type", "go_back", "select"):
                await self._settle(action)
            blocked, restored = await self._fence_outcome(info)
            obs = await self._observe()
            await s.close_popups()
            blocked += s.take_blocked()  # late records (a popup is announced after the page settled)
            if restored or any(b.target == "popup" for b in blocked):
                executed = False  # what the action set off was refused
            if executed and not self._done:
                success, done = await self._evaluate(ev, action, obs)
        except (EnvCrashed, TaskError):
            raise
        except Exception as e:
            if not s.alive():
                raise EnvCrashed(f"browser died during {self.task.task_id}: {e}") from e
            info["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            executed = False
            obs = await self._observe()
        self._done = self._done or done
        no_effect = (executed and not done and action["type"] in ("click", "type", "select", "scroll")
                     and self._changes == prev_changes and obs.url == prev_url and obs.screenshot == self._last_png)
        if no_effect:
            info.setdefault("error", "the action changed nothing on the page")
        elif not executed and action is not None and action.get("type") == "type" and "drop-down" in info.get("error", ""):
            no_effect = True
        res = StepResult(reward=1.0 if success else 0.0, raw_reward=1.0 if success else 0.0, done=done,
                         success=success, invalid=not executed,
                         screenshot_unchanged=obs.screenshot == self._last_png, blocked=blocked,
                         no_effect=no_effect, info=info)
        self._last_png = obs.screenshot
        if s.policy.may_land(obs.url)[0] and not obs.url.startswith("chrome-error:"):
            self._last_url = obs.url
        return obs, res

    async def _wait_loaded(self) -> None:
        try:
            await self.session.page.wait_for_load_state("load", timeout=10_000)
        except Exception:  # a slow page still gets observed as it is
            pass

    async def _settle(self, action: dict[str, Any]) -> None:
        # navigation (link, form submit) starts asynchronously after the input event; after a click on
        # a link, give the navigation request up to a second to show up (a loaded machine is slow)
        await asyncio.sleep(max(0.05, self.cfg.action_settle_ms / 1000))
        target = element_by_id(self._elements, action["element"]) if "element" in action else None
        if action["type"] == "click" and target is not None and target.get("role") == "link":
            for _ in range(20):
                if self.session.has_navigations():
                    break
                await asyncio.sleep(0.05)
        await self._wait_loaded()
        await settle(self.session.page, settle_quiet_ms(self.cfg, action), self.cfg.settle_max_ms)

    async def _evaluate(self, ev: dict[str, Any], action: dict[str, Any], obs: Observation) -> tuple[bool, bool]:
        """(success, done) after an executed step."""
        etype = ev["type"]
        answered = action["type"] == "answer"
        if etype == "url_match":
            ok = _url_matches(obs.url, ev)
            return ok, ok or answered
        if etype == "js_predicate":
            # in a fresh isolated world: the page's own globals and prototypes (Boolean, JSON,
            # Array.prototype, document.querySelector, ...) are not the ones the predicate sees
            try:
                ok = await self.session.reader.isolated(predicate_expression(ev["script"]), "js_predicate")
            except PageReadError as e:
                if e.thrown == "SyntaxError":
                    raise TaskError(f"task {self.task.task_id}: js_predicate is not valid JavaScript: {e}") from None
                if not e.thrown:
                    raise
                ok = False  # it threw on this page (an element it reads is not there): not satisfied
            ok = ok is True
            return ok, ok or answered
        if not answered:
            return False, False
        if etype == "answer_match":
            return _answer_matches(action.get("text", ""), ev), True
        ok = await vlm_judge(self.cfg, self.task.instruction, ev["rubric"], action.get("text", ""), obs.screenshot)
        return ok, True

    async def close(self) -> None:
        if self.session is not None:
            await self.pool.release(self.session)
            self.session = None
