"""Reading a page through channels its own scripts cannot patch.

A page runs its scripts in its main JS world and may replace anything there: `Boolean`, `JSON`,
`Array.prototype`, `Function.prototype.call`, `document.querySelector`. Whatever the environment
learns from the page (rewards, done flags, the element list) therefore goes through one of two
channels, both on a CDP session of the page (not through Playwright's evaluate, whose values are
packed by script in the page's world):

- `isolated(expr)`: evaluated in a FRESH isolated world of the main frame (CDP
  `Page.createIsolatedWorld` + `Runtime.evaluate` with its context id). That world shares the DOM with
  the page but has its own globals and prototypes, so nothing the page did to its JS objects is seen
  there. Evaluators (js_predicate) run here.
- `main_world(expr)`: evaluated in the page's main world (needed where the data lives there, such as
  MiniWoB's `WOB_*` globals and the observation runtime's cache) with the value copied out by V8's own
  serializer (`returnByValue`), never by page-patchable JSON.stringify.

Invariant: every failure of a read raises `PageReadError` (an `EnvCrashed`) naming the cause: what
the page threw, or what the protocol said. No read returns an exception of another type.
"""

from __future__ import annotations

from typing import Any

from asyncwebrl.web.base import EnvCrashed

WORLD_NAME = "asyncwebrl-judge"


class PageReadError(EnvCrashed):
    """The page could not be read (its script threw, the document went away, the value could not be
    copied out): the episode cannot be judged."""

    def __init__(self, message: str, thrown: str | None = None):
        super().__init__(message)
        self.thrown = thrown
        """class name of what the evaluated script threw ('SyntaxError', 'TypeError', ...); None when
        the read failed for another reason"""


class PageReader:
    """The read channels of one page (one CDP session, opened on first use)."""

    def __init__(self, page: Any):
        self.page = page
        self._cdp: Any = None

    async def _session(self) -> Any:
        if self._cdp is None:
            try:
                self._cdp = await self.page.context.new_cdp_session(self.page)
            except Exception as e:
                raise PageReadError(f"cannot open a CDP session on the page: {type(e).__name__}: {e}") from e
        return self._cdp

    async def _send(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        cdp = await self._session()
        try:
            return await cdp.send(method, params)
        except Exception as e:
            raise PageReadError(f"{method} failed: {type(e).__name__}: {str(e)[:300]}") from e

    async def _evaluate(self, expression: str, context_id: int | None, what: str) -> Any:
        params: dict[str, Any] = {"expression": expression, "returnByValue": True, "silent": True,
                                  "awaitPromise": False, "userGesture": False}
        if context_id is not None:
            params["contextId"] = context_id
        r = await self._send("Runtime.evaluate", params)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            exc = d.get("exception") or {}
            why = exc.get("description") or exc.get("value") or d.get("text") or "an exception"
            raise PageReadError(f"{what}: the page threw: {str(why)[:300]}", thrown=exc.get("className") or "")
        result = r.get("result") or {}
        if result.get("type") == "undefined":
            return None
        if "value" not in result:
            raise PageReadError(f"{what}: the value ({result.get('type')}) cannot be copied out of the page")
        return result["value"]

    async def main_world(self, expression: str, what: str = "page read") -> Any:
        """`expression` in the page's main world, its value copied by V8 (no page script involved)."""
        return await self._evaluate(expression, None, what)

    async def isolated(self, expression: str, what: str = "isolated read") -> Any:
        """`expression` in a fresh isolated world of the main frame (own globals, shared DOM)."""
        tree = await self._send("Page.getFrameTree", {})
        frame_id = tree["frameTree"]["frame"]["id"]
        world = await self._send("Page.createIsolatedWorld",
                                 {"frameId": frame_id, "worldName": WORLD_NAME, "grantUniveralAccess": False})
        return await self._evaluate(expression, world["executionContextId"], what)

    async def close(self) -> None:
        if self._cdp is not None:
            cdp, self._cdp = self._cdp, None
            try:
                await cdp.detach()
            except Exception:  # the page or browser is gone already
                pass


def predicate_expression(script: str) -> str:
    """A js_predicate script as an expression of its truth (newlines keep a trailing // comment in
    the script from swallowing the closing parenthesis)."""
    return f"!!(\n{script}\n)"
