"""How the HA check drives a server: a `Shape` of a few `Call`s, written once in the user's project.

    # ha_shape.py
    from mcp_ha.ops.check import Call, Shape

    shape = Shape(
        write=Call("start_job", {"name": "probe", "steps": 1, "step_seconds": 0}),
        read=Call("list_jobs"),
        count=lambda result: result["count"],
        streamed=Call("start_job", {"name": "long", "steps": 25, "step_seconds": 0.15}),
    )

`load_shape(path)` reads such a file (its module-level `shape`); a file that is missing, does not run,
or holds no Shape is a `ShapeError` saying which. The check never assumes any tool of its own: every
call it makes to the server's tools comes from here. The tools a shape names must keep their state with
`ha.session(ctx, session_id)`, as every tool on the layer does: a sessionless client passes its
handle as the `session_id` argument.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Arguments = Mapping[str, Any] | Callable[[dict[str, Any] | None], Mapping[str, Any]]


class ShapeError(Exception):
    """A shape file that cannot be used, with the reason."""


@dataclass(frozen=True)
class Call:
    """One tool call: its name and arguments. `arguments` is a dict, or a callable of the structured result
    of the session's previous `write` (None before the first) returning one: `lambda wrote: {"job_id": ...}`."""

    tool: str
    arguments: Arguments = field(default_factory=dict)

    def arguments_after(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        """The arguments to send, given the session's previous write result."""
        arguments = self.arguments(previous) if callable(self.arguments) else self.arguments
        return dict(arguments)


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What the check needs to know of a server, keyword-only:

    write      a call with one countable effect each time it is applied (required)
    read       a call that reads the session's effects back (required)
    count      how many writes `read`'s structured result shows (required); the check compares it, per
               session, with the writes it was told succeeded: fewer is an effect lost, more one doubled
    once       a call whose retry (same idempotency key) must apply once; default: `write`
    state      what a repeated `once` must leave as one application left it, from `read`'s result;
               default: `count`. Give it when `once` is not the write (a checkout: the orders placed)
    streamed   a call that streams progress for a few seconds, or None (the streamed checks are skipped)
    """

    write: Call
    read: Call
    count: Callable[[dict[str, Any]], int]
    once: Call | None = None
    state: Callable[[dict[str, Any]], Any] | None = None
    streamed: Call | None = None

    def __post_init__(self) -> None:
        for name in ("write", "read", "once", "streamed"):
            value = getattr(self, name)
            if not (isinstance(value, Call) or (value is None and name in ("once", "streamed"))):
                raise ShapeError(f"Shape.{name} must be a Call, not {type(value).__name__}")
        for name in ("count", "state"):
            value = getattr(self, name)
            if not (callable(value) or (value is None and name == "state")):
                raise ShapeError(f"Shape.{name} must be a function of the read's result")

    @property
    def once_call(self) -> Call:
        return self.once or self.write

    def count_of(self, result: dict[str, Any]) -> int:
        """`count` of a read result, checked to be an int: a shape that counts wrong is a broken shape."""
        value = self.count(result)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShapeError(f"count returned {value!r} ({type(value).__name__}), not an int, for {str(result)[:200]}")
        return value

    def state_of(self, result: dict[str, Any]) -> Any:
        return self.state(result) if self.state is not None else self.count_of(result)


# Where a shape written before the ops wing (mcp_ha/ops/) imports from, and where that is now.
MOVED = {"mcp_ha.check": "mcp_ha.ops.check"}


def load_shape(path: str | Path) -> Shape:
    """The `shape` a Python file defines; ShapeError, saying why, for any file that does not."""
    path = Path(path)
    if not path.is_file():
        raise ShapeError(f"{path}: no such file")
    name = f"_mcp_ha_shape_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ShapeError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # The file's own folder first, so a shape next to its server can import from it.
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        moved = f" (the HA check moved: import from {MOVED[exc.name]})" if exc.name in MOVED else ""
        raise ShapeError(f"{path}: {type(exc).__name__}: {exc}{moved}") from exc
    except Exception as exc:
        raise ShapeError(f"{path}: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
    shape = getattr(module, "shape", None)
    if not isinstance(shape, Shape):
        found = "nothing" if shape is None else f"a {type(shape).__name__}"
        raise ShapeError(f"{path}: defines no `shape = Shape(...)` (found {found} named shape)")
    return shape
