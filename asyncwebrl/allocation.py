"""Parser for `allocation_mode`, the string that says which devices each role gets (SPEC section 1).

Grammar::

    expr      := component ("+" component)*     "+" = disaggregated: own devices each
    component := alloc ("|" alloc)*              "|" = colocated on the same devices (binds tighter)
    alloc     := backend ["[" role "]"] ":" dims
    backend   := sglang | vllm | hf | fsdp
    dims      := ("d"|"t"|"p") INT, repeated     world size = product

Invariant: a parsed `AllocationMode` is internally consistent (colocated allocs have equal world
sizes, no role appears twice); every error names the offending character position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INFERENCE_BACKENDS = ("sglang", "vllm", "hf")
TRAINING_BACKENDS = ("fsdp",)
DIM_LETTERS = {"d": "dp", "t": "tp", "p": "pp"}


class AllocationModeError(ValueError):
    """A malformed allocation_mode; the message shows the string with a caret under the error."""

    def __init__(self, text: str, pos: int, what: str):
        self.text, self.pos, self.what = text, pos, what
        caret = " " * pos + "^"
        super().__init__(f"allocation_mode {what} at position {pos}:\n  {text}\n  {caret}")


@dataclass(frozen=True)
class Alloc:
    """One backend with its role and parallel dims, e.g. `sglang[rollout]:d4t2`."""

    backend: str
    role: str
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Component:
    """Allocs colocated on the same devices (joined by `|`)."""

    allocs: tuple[Alloc, ...]

    @property
    def world_size(self) -> int:
        return self.allocs[0].world_size


@dataclass(frozen=True)
class AllocationMode:
    """A parsed allocation_mode: disaggregated components, each with its own devices."""

    text: str
    components: tuple[Component, ...] = field(default_factory=tuple)

    @property
    def total_devices(self) -> int:
        return sum(c.world_size for c in self.components)

    def role(self, name: str) -> Alloc | None:
        for c in self.components:
            for a in c.allocs:
                if a.role == name:
                    return a
        return None

    @property
    def rollout(self) -> Alloc | None:
        return self.role("rollout")

    @property
    def actor(self) -> Alloc | None:
        return self.role("actor")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def error(self, what: str, pos: int | None = None) -> AllocationModeError:
        return AllocationModeError(self.text, self.pos if pos is None else pos, what)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def word(self) -> tuple[str, int]:
        start = self.pos
        while self.pos < len(self.text) and (self.text[self.pos].isalnum() or self.text[self.pos] in "_-"):
            self.pos += 1
        return self.text[start : self.pos], start

    def parse(self) -> AllocationMode:
        if not self.text.strip():
            raise self.error("is empty; expected e.g. 'sglang[rollout]:d1+fsdp[actor]:d1'", 0)
        components = [self.component()]
        while self.peek() == "+":
            self.pos += 1
            components.append(self.component())
        if self.pos != len(self.text):
            raise self.error(f"has unexpected character {self.peek()!r} (expected '+', '|' or end)")
        mode = AllocationMode(self.text, tuple(components))
        seen: dict[str, int] = {}
        for c in components:
            for a in c.allocs:
                if a.role in seen:
                    raise self.error(f"names role '{a.role}' twice", self.text.rfind(f"[{a.role}]") + 1)
                seen[a.role] = 1
        return mode

    def component(self) -> Component:
        start = self.pos
        allocs = [self.alloc()]
        while self.peek() == "|":
            self.pos += 1
            allocs.append(self.alloc())
        sizes = {a.world_size for a in allocs}
        if len(sizes) > 1:
            desc = ", ".join(f"{a.backend}[{a.role}]={a.world_size}" for a in allocs)
            raise self.error(f"colocates allocations of different world sizes ({desc})", start)
        return Component(tuple(allocs))

    def alloc(self) -> Alloc:
        backend, bpos = self.word()
        if not backend:
            raise self.error("expects a backend name (sglang, vllm, hf or fsdp)")
        if backend not in INFERENCE_BACKENDS + TRAINING_BACKENDS:
            raise self.error(
                f"has unknown backend '{backend}' (expected one of sglang, vllm, hf, fsdp)", bpos
            )
        role = "actor" if backend in TRAINING_BACKENDS else "rollout"
        if self.peek() == "[":
            self.pos += 1
            role, rpos = self.word()
            if not role:
                raise self.error("expects a role name inside '[...]'")
            if self.peek() != "]":
                raise self.error("expects ']' to close the role")
            self.pos += 1
            if role in ("rollout", "test-rollout") and backend in TRAINING_BACKENDS:
                raise self.error(f"gives inference role '{role}' to training backend '{backend}'", rpos)
            if role == "actor" and backend in INFERENCE_BACKENDS:
                raise self.error(f"gives training role 'actor' to inference backend '{backend}'", rpos)
        if self.peek() != ":":
            raise self.error("expects ':' followed by dims such as d2")
        self.pos += 1
        dims: dict[str, int] = {}
        if self.peek() not in DIM_LETTERS:
            raise self.error("expects a dim letter d, t or p")
        while self.peek() in DIM_LETTERS and self.peek():
            letter_pos = self.pos
            letter = self.peek()
            self.pos += 1
            num_start = self.pos
            while self.peek().isdigit():
                self.pos += 1
            if num_start == self.pos:
                raise self.error(f"expects an integer after '{letter}'")
            value = int(self.text[num_start : self.pos])
            if value < 1:
                raise self.error(f"has dim {letter}{value}; sizes must be >= 1", num_start)
            name = DIM_LETTERS[letter]
            if name in dims:
                raise self.error(f"repeats dim '{letter}'", letter_pos)
            dims[name] = value
        return Alloc(backend=backend, role=role, **dims)


def parse_allocation_mode(text: str) -> AllocationMode:
    """Parse an allocation_mode string; raises AllocationModeError naming the offending position."""
    if not isinstance(text, str):
        raise AllocationModeError(str(text), 0, "must be a string")
    return _Parser(text).parse()
