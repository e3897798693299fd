"""Pattern: metrics an operator can watch, at `GET /metrics` on every replica.

Prometheus text, from prometheus-client's default registry, so what libraries
export there lands on the same page: stamina's `stamina_retries_total` (the
store's retries) and the process's CPU, memory and file descriptors. Each
replica is scraped on its own address; through HAProxy a scrape would reach
one replica at random, so the MCP frontend refuses `/metrics` and HAProxy
serves its own on the stats port.

What is counted, and where:

- tool calls by tool and outcome, and their latency (`ToolMetrics`, FastMCP
  middleware, outermost, so it sees what the client is answered);
- sessions this replica holds a transport for (read from the SDK at scrape
  time, `watch_sessions`), and sessions it adopted (`adoption.py`);
- `resume_session` calls that copied state (`Session.copy_from`), and SSE streams
  resumed from the store (`streams/`);
- store operations: latency by operation, errors by kind (`MeteredStore`, a
  wrapper around any `SessionStore`, so the stores stay unaware of it);
- writes replayed from their op record (`IDEMPOTENT_REPLAYS`), which a
  store reports through its `on_replay` hook (`count_replay`);
- restarts of the task worker after an error (`TASK_WORKER_RESTARTS`, `tasks.py`);
- refusals past each of the kit's bounds, by the setting's name (`mcp_refusals_total`,
  from refusals.py);
- what an operator alerts on (`watch_replica`): the build (`mcp_ha_build_info`),
  whether the replica drains (`mcp_draining`) and reaches its store (`mcp_store_up`).

Labels only ever take values from fixed sets (tool names registered on the
server, operation names of the store contract), never from requests, so a
client cannot grow the page. On the hot path (~400 calls/s per stack) each
call looks up prebuilt label children and does two increments; nothing is
allocated per call beyond the timestamps.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import platform
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ParamSpec, TypeVar, cast

import stamina.instrumentation
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools import ToolResult
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolRequestParams
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from . import _sdk, refusals
from .session_store import Conflict, Fenced, Op, OpReused, SessionStore, StoreUnavailable

# From a 1 ms read to analyze_data's and watch_counter's 30 s.
TOOL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# One Redis round trip is ~0.1-1 ms; a slow one near the client's timeout is what matters.
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# The tool label of a call naming no registered tool: one series for all of them.
OTHER_TOOL = "(other)"

TOOL_CALLS = Counter(
    "mcp_tool_calls_total",
    "Tool calls answered by this replica, by tool and outcome: ok; tool_error (an isError result: the "
    "tool failed, the store was unreachable, the session moved, invalid arguments, unknown tool); "
    "protocol_error (a JSON-RPC error: a malformed or reused idempotency key).",
    ("tool", "outcome"),
)
TOOL_SECONDS = Histogram(
    "mcp_tool_call_duration_seconds",
    "Time from a tools/call reaching FastMCP's middleware to its answer, by tool, whatever the outcome.",
    ("tool",),
    buckets=TOOL_BUCKETS,
)
SESSIONS_HELD = Gauge(
    "mcp_sessions_held",
    "MCP sessions this replica holds a transport for now (opened here or adopted; forgotten when "
    "ended or idle for SESSION_IDLE_SECONDS).",
)
STORE_MEMORY_USED = Gauge(
    "mcp_store_memory_used_bytes", "Memory the session store (Redis) uses, as of the latest health check."
)
STORE_MEMORY_MAX = Gauge(
    "mcp_store_memory_max_bytes",
    "The most memory the session store may use (Redis maxmemory; 0: unbounded); past it, writes are refused.",
)
LISTEN_STREAMS = Gauge(
    "mcp_listen_streams",
    "subscriptions/listen streams open on this replica now (at most MAX_LISTEN_STREAMS).",
)
SESSIONS_ADOPTED = Counter(
    "mcp_sessions_adopted_total",
    "Sessions this replica took over from the store (a new ownership epoch), usually because the "
    "replica that held them died, drained or was taken out by HAProxy.",
)
SESSIONS_RESUMED = Counter(
    "mcp_sessions_resumed_total",
    "Copies of a previous session's state into the caller's that copied something (resume_session: a "
    "client that lost its session for good and started a new one).",
)
STREAMS_RESUMED = Counter(
    "mcp_streams_resumed_total",
    "SSE streams resumed here with Last-Event-ID and answered from the session's event log in the store.",
)
IDEMPOTENT_REPLAYS = Counter(
    "mcp_idempotent_replays_total",
    "Writes of keyed tool calls that were already applied, answered from their op record instead of "
    "applied again (a client's or HAProxy's retry).",
)
TASK_WORKER_RESTARTS = Counter(
    "mcp_task_worker_restarts_total",
    "Restarts of this replica's task worker (Docket) after it stopped on an error, such as a Redis Cluster "
    "none of whose nodes answered: tasks wait meanwhile, none is lost.",
)

STORE_SECONDS = Histogram(
    "mcp_store_operation_duration_seconds",
    "Time a SessionStore operation took, retries included, by operation, whatever the outcome.",
    ("operation",),
    buckets=STORE_BUCKETS,
)
BUILD_INFO = Gauge(
    "mcp_ha_build_info",
    "Always 1: what this replica runs, as labels (the kit's version, 'unknown' for a copy of mcp_ha/ not "
    "installed; FastMCP's and the MCP SDK's; Python's).",
    ("version", "fastmcp", "mcp", "python"),
)
DRAINING = Gauge("mcp_draining", "1 while this replica drains (SIGTERM: it takes no new work), else 0.")
STORE_UP = Gauge(
    "mcp_store_up",
    "1 when this replica's last store health check reached the store (at each /health, HAProxy's ~2/s), else 0.",
)
STORE_ERRORS = Counter(
    "mcp_store_errors_total",
    "SessionStore operations that failed, by operation and kind: unavailable (the store could not be "
    "reached), fenced (a write from a replica that no longer owns the session), op_reused (an "
    "idempotency key sent with a different call), conflict (an apply-once block's reads changed before it committed).",
    ("operation", "kind"),
)


class _Refusals:
    """`mcp_refusals_total{bound}`: refusals.py's counts, read at each scrape (it imports no Prometheus)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "mcp_refusals",
            "Requests refused past one of the kit's bounds, by the setting's name (MAX_BODY_BYTES, "
            "MAX_CALLS_PER_CLIENT, FAIR_SHARE_CALLS, ...; 'store quota' for the store's own: state, list and "
            "client bytes).",
            labels=("bound",),
        )
        for bound, count in sorted(refusals.totals().items()):
            family.add_metric((bound,), count)
        yield family


REGISTRY.register(_Refusals())

# A `_created` sample per series would double the page, for what Prometheus
# already infers from a counter's resets.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
# stamina registers its retry counter in the default registry on first use;
# creating it now puts it on the page from the first scrape.
stamina.instrumentation.get_prometheus_counter()


def count_replay(op: Op) -> None:
    """A store's `on_replay` hook."""
    IDEMPOTENT_REPLAYS.inc()


async def endpoint(request: Request) -> Response:
    """GET /metrics: the Prometheus text format."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def watch_replica(*, draining: Callable[[], bool], store_up: Callable[[], bool]) -> None:
    """What an operator alerts on, read at each scrape: the build, whether the replica drains, whether its
    store answers."""
    BUILD_INFO.labels(_version("mcp-ha-kit"), _version("fastmcp"), _version("mcp"), platform.python_version()).set(1)
    DRAINING.set_function(lambda: float(draining()))
    STORE_UP.set_function(lambda: float(store_up()))


def watch_sessions(app: Starlette, path: str = "/mcp") -> None:
    """Report the sessions the MCP endpoint at `path` of `app` holds, read at each scrape."""

    def held() -> int:
        manager = _sdk.session_manager(app, path)
        return 0 if manager is None else _sdk.held_count(manager)

    SESSIONS_HELD.set_function(held)


class _ToolSeries:
    __slots__ = ("ok", "protocol_error", "seconds", "tool_error")

    def __init__(self, tool: str) -> None:
        self.ok = TOOL_CALLS.labels(tool, "ok")
        self.tool_error = TOOL_CALLS.labels(tool, "tool_error")
        self.protocol_error = TOOL_CALLS.labels(tool, "protocol_error")
        self.seconds = TOOL_SECONDS.labels(tool)


class ToolMetrics(Middleware):
    """Counts and times every tools/call. Put it first in the server's middleware: it then
    sees the outcome the client gets, after the other middleware translated errors."""

    def __init__(self) -> None:
        self._series: dict[str, _ToolSeries] | None = None
        self._other = _ToolSeries(OTHER_TOOL)

    async def _list_tools(self, context: MiddlewareContext) -> dict[str, _ToolSeries]:
        # The server's tools, listed once: a name outside them is counted as OTHER_TOOL.
        if context.fastmcp_context is None:
            raise RuntimeError("ToolMetrics runs as a FastMCP server's middleware, where a call has a context")
        tools = await context.fastmcp_context.fastmcp.list_tools(run_middleware=False)
        self._series = {tool.name: _ToolSeries(tool.name) for tool in tools}
        return self._series

    async def on_call_tool(
        self,
        context: MiddlewareContext[CallToolRequestParams],
        call_next: CallNext[CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        by_name = self._series if self._series is not None else await self._list_tools(context)
        series = by_name.get(context.message.name, self._other)
        start = time.perf_counter()
        try:
            result = await call_next(context)
        except MCPError:
            series.protocol_error.inc()
            raise
        except Exception:
            # FastMCP answers every other failure (the tool's own, an unknown tool,
            # invalid arguments) with an isError result.
            series.tool_error.inc()
            raise
        finally:
            series.seconds.observe(time.perf_counter() - start)
        series.ok.inc()
        return result


class _StoreSeries:
    __slots__ = ("conflict", "fenced", "op_reused", "seconds", "unavailable")

    def __init__(self, operation: str) -> None:
        self.seconds = STORE_SECONDS.labels(operation)
        self.unavailable = STORE_ERRORS.labels(operation, "unavailable")
        self.fenced = STORE_ERRORS.labels(operation, "fenced")
        self.op_reused = STORE_ERRORS.labels(operation, "op_reused")
        self.conflict = STORE_ERRORS.labels(operation, "conflict")


P = ParamSpec("P")
R = TypeVar("R")


async def _metered(
    series: _StoreSeries, operation: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs
) -> R:
    start = time.perf_counter()
    try:
        return await operation(*args, **kwargs)
    except StoreUnavailable:
        series.unavailable.inc()
        raise
    except Fenced:
        series.fenced.inc()
        raise
    except OpReused:
        series.op_reused.inc()
        raise
    except Conflict:
        series.conflict.inc()
        raise
    finally:
        series.seconds.observe(time.perf_counter() - start)


# What is not an operation to time: one long wait (`watch`), health's own probes, and the lifecycle.
UNTIMED = frozenset({"watch", "ping", "memory", "aclose"})


def timed_operations() -> frozenset[str]:
    """Every operation of the store contract that MeteredStore times: each async one, a new one included."""
    return frozenset(
        name
        for name in SessionStore.__abstractmethods__
        if inspect.iscoroutinefunction(getattr(SessionStore, name)) and name not in UNTIMED
    )


class MeteredStore:
    """Any `SessionStore`, its operations timed and their errors counted; otherwise the same store.

    Every async operation of the contract is timed under its own name (`timed_operations`), each wrapped
    once, on first use; everything else is the store's own. `metered(store)` makes one."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._timed = timed_operations()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.store, name)
        if name not in self._timed:
            return found
        series = _StoreSeries(name)

        async def operation(*args: Any, **kwargs: Any) -> Any:
            return await _metered(series, found, *args, **kwargs)

        # Found in the instance from now on: __getattr__ is not asked again for it.
        setattr(self, name, operation)
        return operation

    async def copy(self, source_id: str, target_id: str, *, epoch: int | None = None, op: Op | None = None) -> int:
        copied: int = await _metered(_COPY, self.store.copy, source_id, target_id, epoch=epoch, op=op)
        if copied:
            SESSIONS_RESUMED.inc()
        return copied

    async def memory(self) -> tuple[int, int] | None:
        found = await self.store.memory()
        if found is not None:
            STORE_MEMORY_USED.set(found[0])
            STORE_MEMORY_MAX.set(found[1])
        return found


_COPY = _StoreSeries("copy")


def metered(store: SessionStore) -> SessionStore:
    """`store`, its operations timed and their errors counted (`MeteredStore`): a `SessionStore` by every
    method and attribute, though not by class."""
    return cast(SessionStore, MeteredStore(store))
