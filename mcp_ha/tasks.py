"""Pattern: durable tasks, long work that outlives its replica.

A tool marked with FastMCP's own `@mcp.tool(task=True)` runs as a background
task (the `io.modelcontextprotocol/tasks` extension, SEP-2663) for a client
that asks for one: the `tools/call` answers at once with a task id, the client
polls `tasks/get` through any replica, and `tasks/cancel` works from any.
FastMCP's `fastmcp-tasks` implements the extension on Docket, a task queue on
Redis; `ha.server()` adds it (`HATasks`), configured from the settings, so a
server gets tasks with no line of its own. A client that did not ask (every
session-era client) gets the tool's answer inline, as before.

What Docket gives, on the kit's Redis (`docket_url`: REDIS_URL or
REDIS_SENTINELS, the kit's ACL user; keys and channels under `mcp:tasks`;
`memory://` with the in-memory store): every replica runs a worker; a worker
holds each task it runs by renewing a lease every quarter of
TASK_REDELIVERY_SECONDS, and a task whose lease lapses is delivered to another
worker, which runs it again from its start. So a task whose replica died is
taken over about TASK_REDELIVERY_SECONDS after the death.

What the layer adds, because Docket does not:

- **Writes apply once.** Inside a task run, `current_call` is the call that
  created the task (its idempotency key, else HAProxy's request id, and its
  digest; the task's own key, `task:<task id>`, without either), so every
  write through `ha.session()` made by a run that is repeated (a takeover, a
  redelivery, or the next leg after the client answered an input request),
  or by a call that was cut and is sent again as a task under its key,
  replays the first run's instead of applying again; `Session.resume()` tells
  the re-run where the first run got to. The kit's
  FastMCP middlewares do not run in a worker (Docket calls the tool's function
  itself), so the layer wraps the functions Docket runs (`HATasks.lifespan`).
- **A live task is never run twice.** Docket redelivers a task that is still
  running when its worker stopped renewing the lease while the task went on (a
  Redis error makes a worker stop renewing until its tasks end; so does an
  event-loop stall over the redelivery time). Each run records itself under the
  task in the kit's store, by this replica's `Runs` lease (`TaskRuns`): a second
  delivery that finds the first run's replica alive does not run the body; it
  waits (polling every POLL_SECONDS) until that run ends, and answers with the
  first run's recorded result, or until that replica's lease lapses, and then
  takes over. Docket stores a run's result under the task's key and
  generation, which a redelivery shares, so the result that reaches the client
  is the first run's whichever delivery ends last. A loop stalled past both
  the redelivery time and the `Runs` lease (one second) cannot be told from a
  dead replica: its task runs again, its writes still applied once.
- **A task belongs to its principal.** fastmcp-tasks scopes every task id by
  the caller's token (`client_id|sub`), and answers another principal's id
  exactly as one that never existed. With the kit's verifiers that is the
  kit's principal (`principals.py`: one issuer per deployment, `sub` always
  present); a client id holding "|" could make two principals' scopes one
  text, so such a caller gets no task.
- **Bounds.** MAX_TASKS_PER_CLIENT tasks not yet finished per client (its
  principal, else its address), held as numbered slots in the store (one
  more is a tool error, nothing started); MAX_TASK_RESULT_BYTES of result
  JSON (a larger one ends the task with a tool error instead);
  MAX_TASK_ARGUMENT_BYTES of arguments, none the tool does not take (else a
  tool error before anything is stored: Docket keeps them for the task's
  life); and TASK_TTL_SECONDS, how long a finished task is kept (Docket's
  execution TTL). What a task keeps in Redis (its arguments, twice, its
  context snapshot, its result and Docket's own keys) is charged to its
  client's MAX_CLIENT_BYTES: while it runs with the most its result may take,
  then what it keeps, until Docket lets it go; a creation past the quota is a
  tool error naming it, nothing started. A task that fails frees its slot as
  one that succeeds does, its data still charged. Redis full or out of reach while a task is created is the
  store's clear tool error, not an internal error (`_docket_answered`).
- **The worker outlives a store outage.** Docket waits out a Redis error
  itself, but redis-py raises a non-Redis error when no node of a Redis
  Cluster answers, which ended the worker: the replica ran no task until
  restarted. The layer starts the worker again whenever it ends on an error
  (`_supervised`: 1 s, doubling to 30 s), logged and counted
  (`mcp_task_worker_restarts_total`, with metrics on).
- **No credentials kept.** fastmcp-tasks keeps each task's context snapshot
  (its caller's access token and request headers) in Redis for the task's
  life; the layer has it captured without the raw bearer token (the claims
  that scope the task stay) and without credential headers
  (`_sdk.scrub_task_snapshots`).
- **Store errors** in a task body are answered as `errors.StoreErrors`
  answers them in a call (`_answered`), instead of fastmcp-tasks' masked
  "Error calling tool".
- **Log messages** (`ctx.info()` and the rest) of a task go to the server's
  log (`TaskContext`): FastMCP's would raise, for want of a session, and
  fail the task.

- **Progress only rises.** What a task reports (`ctx.report_progress`, whose
  message is the `statusMessage` its client polls, SEP-2663) is kept beside
  the task's Docket state (`Progress`). Docket sets a leg's progress back to
  zero when a worker claims it; a run that takes the task over starts from
  what its client saw instead, and a report below that (a re-run catching up)
  changes nothing.
- **Who runs it.** `tasks/get` of a working task names the replica whose run
  started last in its `_meta` (RUNNER_META; one GET), so an operator, or the
  HA check, can tell which replica a fault must reach.

Not given: a task is always run again from its start (its writes replay;
`Session.resume()` and checkpoints let it skip work). The rest of a task's
context snapshot (its other headers, its token's claims) is kept unencrypted
unless FASTMCP_TASKS_ENCRYPTION_KEY is set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, NamedTuple, cast
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import mcp_types
from docket.dependencies import current_execution
from fastmcp.exceptions import ToolError
from fastmcp.server.context import Context
from fastmcp.server.dependencies import get_access_token, get_http_request, set_background_context_factory
from fastmcp.server.extensions import MethodBinding
from fastmcp.tools.base import InputRequiredToolResult, Tool, ToolResult
from fastmcp.tools.function_tool import FunctionTool
from fastmcp.utilities.tasks import TASKS_EXTENSION_ID
from fastmcp_tasks import TasksExtension
from fastmcp_tasks.context import get_task_context, make_task_context
from fastmcp_tasks.handlers import tasks_get
from fastmcp_tasks.input_loop import reentrant_task_fn
from fastmcp_tasks.input_store import is_cancelled
from fastmcp_tasks.models import CreateTaskResult, GetTaskResult
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, LoggingLevel
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import Field
from redis import exceptions as redis_exceptions

from . import _sdk
from .elicitation import InputNeeded
from .errors import KEY_REUSED, SESSION_BUSY, SESSION_MOVED, STORE_FULL
from .idempotency import current_call
from .principals import client_of
from .refusals import STORE_QUOTA, refused
from .session_store import (
    STORE_UNAVAILABLE,
    Conflict,
    Fenced,
    LimitExceeded,
    OpReused,
    SessionStore,
    StoreFull,
    StoreUnavailable,
)
from .settings import Settings
from .streams.lease import Runs

log = logging.getLogger(__name__)

# Docket's name, the prefix of every key and channel it uses: under the Redis store's own prefix (`mcp`,
# RedisSessionStore's default, which make_store keeps), so the kit's ACL user reaches it (~mcp:*).
DOCKET_NAME = "mcp:tasks"
# How long Docket's XREADGROUP blocks for new work: a new task is picked up as it arrives whatever this is.
CHECK_INTERVAL = timedelta(milliseconds=500)
# How soon a worker whose Redis connection failed connects again.
RECONNECTION_DELAY = timedelta(seconds=1)
# How soon the layer starts Docket's worker again after it stopped on an error (`HATasks._supervised`):
# doubling from the first to the most, and back to the first once a worker ran that long.
WORKER_RESTART_FIRST_SECONDS = 1.0
WORKER_RESTART_MAX_SECONDS = 30.0
# How often a delivery that waits for another replica's run of its task looks again.
POLL_SECONDS = 0.5
# How long a task's first run waits for its creator to note the call that created it (`_call_of`).
CALL_NOTED_WITHIN_SECONDS = 5
# A run's records in the store (`TaskRuns`): kept this long, renewed every RUN_RENEW_SECONDS while it runs.
RUN_TTL_SECONDS = 300
RUN_RENEW_SECONDS = 60
# A finished run's outcome, for the deliveries waiting on it (they look every POLL_SECONDS).
DONE_TTL_SECONDS = 60
# A client's task slot (MAX_TASKS_PER_CLIENT): held this long until the task is noted in it, then this
# long at most; a slot whose task finished is freed by the next creation that finds every slot taken,
# which looks at most once per SWEEP_SECONDS per client.
SLOT_PENDING_SECONDS = 60
SLOT_TTL_SECONDS = 24 * 3600
SWEEP_SECONDS = 1
# What Docket, fastmcp-tasks and the layer keep of a task besides its arguments, its caller's headers and
# its result, charged with them: a dozen small keys and the snapshot's frame (measured on Redis 7.0: a task
# of small arguments took 4.8 KB, one of 60 KB arguments 137 KB, twice them and the allocator's rounding).
TASK_KEPT_BYTES = 4096

TOO_MANY_TASKS = (
    "Refused: this client has {n} tasks not yet finished (MAX_TASKS_PER_CLIENT). Wait for one to finish or "
    "cancel one (tasks/cancel), then call again. Nothing was started."
)
RESULT_TOO_LARGE = (
    "The task finished, but its result ({size} bytes of JSON) is over the {limit} bytes a task keeps "
    "(MAX_TASK_RESULT_BYTES), so it was not kept. Its writes stay applied; return less (a reference to the "
    "data instead of the data) to get it."
)
# Marks the functions the layer wraps for Docket's worker (the fenced ones of `HATasks`).
FENCED = "mcp_ha_fenced"
# The RESP version Docket's connections speak (`docket_url`).
RESP = {"protocol": "2"}
# Where `tasks/get` of a working task names the replica running it.
RUNNER_META = "io.github.mcp-ha-kit/runner"
AMBIGUOUS_CLIENT = "Refused: a client id holding '|' cannot own tasks (its task scope would be ambiguous)."
UNKNOWN_ARGUMENTS = "Refused: {tool} takes no argument {names}. Nothing was started."
ARGUMENTS_TOO_LARGE = (
    "Refused: this task's arguments take {size} bytes of JSON; a task keeps at most {limit} "
    "(MAX_TASK_ARGUMENT_BYTES). Nothing was started."
)


def docket_url(settings: Settings) -> str:
    """Docket's Redis: the store's own (REDIS_URL, or REDIS_SENTINELS with the master's name), as the kit's
    ACL user (REDIS_USERNAME/REDIS_PASSWORD, percent-encoded); `memory://` with the in-memory store.

    Over RESP2 (`protocol=2`, as Docket's own pub/sub connections already are): redis-py 8.1.0's pools
    never replace a RESP3 connection Redis closed (redis/redis-py#4252, fixed after 8.1.0), and Docket does
    not retry, so after a Redis restart, failover or killed client, a task's `ctx.report_progress` and
    Docket's own writes of its result failed on the dead connection, ending the task in error."""
    userinfo = ""
    if settings.redis_username is not None or settings.redis_password is not None:
        userinfo = quote(settings.redis_username or "", safe="")
        if settings.redis_password is not None:
            userinfo += ":" + quote(settings.redis_password, safe="")
        userinfo += "@"
    if settings.redis_sentinels:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in settings.redis_sentinels)
        query = {
            name: value
            for name, value in (
                ("sentinel_username", settings.redis_sentinel_username),
                ("sentinel_password", settings.redis_sentinel_password),
            )
            if value
        }
        return f"redis+sentinel://{userinfo}{hosts}/{settings.redis_master_name}/0?" + urlencode({**query, **RESP})
    if settings.redis_cluster_nodes:
        # Docket takes one node to learn the cluster from; its keys share one hash tag ({mcp:tasks}).
        host, port = settings.redis_cluster_nodes[0]
        return f"redis+cluster://{userinfo}{host}:{port}/0?" + urlencode(RESP)
    if settings.redis_url:
        parts = urlsplit(settings.redis_url)
        netloc = userinfo + parts.netloc.rpartition("@")[2] if userinfo else parts.netloc
        options = urlencode([*((k, v) for k, v in parse_qsl(parts.query) if k != "protocol"), *RESP.items()])
        return urlunsplit((parts.scheme, netloc, parts.path, options, parts.fragment))
    return "memory://"


def _wire(result: ToolResult) -> mcp_types.CallToolResult:
    """`result` as the client gets it (as fastmcp-tasks' `tasks/get` inlines it)."""
    wire = result.to_mcp_result()
    if isinstance(wire, tuple):
        return mcp_types.CallToolResult(content=wire[0], structured_content=wire[1])
    if isinstance(wire, list):
        return mcp_types.CallToolResult(content=wire)
    return wire


def _wire_bytes(result: ToolResult | mcp_types.CallToolResult) -> int:
    """The bytes of JSON `result` takes as the client gets it (and as Docket keeps it)."""
    wire = _wire(result) if isinstance(result, ToolResult) else result
    return len(wire.model_dump_json(by_alias=True, exclude_none=True).encode())


def _outcome(done: str) -> Any:
    """What a finished run recorded (`TaskRuns`), as the run answered it: a result, None, or its exception."""
    recorded = json.loads(done)
    if "result" in recorded:
        return ToolResult.from_mcp_result(mcp_types.CallToolResult.model_validate(recorded["result"]))
    if "error" in recorded:
        error = recorded["error"]
        raise MCPError(error["code"], error["message"], error.get("data"))
    if recorded.get("cancelled"):
        raise asyncio.CancelledError()
    return None


class TaskRuns:
    """Each task leg run once at a time, fleet-wide, by this replica's lease (`Runs`) in the kit's store.

    Under a leg's name (a digest of its Docket key): `<name>:run` holds the run id of the replica that ran it
    first, and `<name>:after:<run id>` the one that took it over from that run, and so on (a chain, as
    streams/reruns.py); `<name>:done` its outcome once it ended. A delivery runs the leg if it can claim
    the first link, or the link after a run whose lease lapsed; otherwise it waits for the outcome.
    """

    def __init__(self, store: SessionStore, runs: Runs) -> None:
        self.store = store
        self.runs = runs
        # The legs this replica runs now: the answer of each, for a second delivery of it here.
        self._local: dict[str, tuple[asyncio.Future[Any], asyncio.Task[Any]]] = {}

    async def run(self, name: str, body: Callable[[], Awaitable[Any]], cancelled: Callable[[], Awaitable[bool]]) -> Any:
        """`body`'s answer, run here once: or the answer of the run of `name` that another delivery made."""
        waited = False
        while True:
            done = await self.store.claimed(f"{name}:done")
            if done is not None:
                return _outcome(done)
            local = self._local.get(name)
            if local is not None:
                return await self._follow(*local)
            chain = await self._take(name)
            if chain is not None:
                done = await self.store.claimed(f"{name}:done")  # it may have ended just before the claim
                if done is not None:
                    await self._release(chain)
                    return _outcome(done)
                return await self._run(name, chain, body, cancelled)
            if not waited:
                waited = True
                log.info("task %s was delivered again while it runs elsewhere: waiting for its outcome", name)
            await asyncio.sleep(POLL_SECONDS)

    async def _take(self, name: str) -> list[tuple[str, str]] | None:
        """The chain of links ending with this run's, once it has claimed one; None while another runs it."""
        me = self.runs.run_id
        link = f"{name}:run"
        if await self.store.claim(link, me, RUN_TTL_SECONDS):
            return [(link, me)]
        chain: list[tuple[str, str]] = []
        for _ in range(64):  # each link is a replica that died with the leg; far fewer in practice
            holder = await self.store.claimed(link)
            if holder is None:
                return None  # released or lapsed since: the next look claims it afresh
            chain.append((link, holder))
            after = f"{name}:after:{holder}"
            if await self.store.claimed(after) is not None:
                link = after
                continue
            if holder == me:
                return chain  # this replica's, and not running here (`_local`): its run stopped unrecorded
            if await self.runs.alive(holder):
                return None
            log.info("taking over task %s: the replica that ran it (%s) is gone", name, holder)
            if await self.store.claim(after, me, RUN_TTL_SECONDS):
                return [*chain, (after, me)]
            return None
        return None

    async def _run(
        self,
        name: str,
        chain: list[tuple[str, str]],
        body: Callable[[], Awaitable[Any]],
        cancelled: Callable[[], Awaitable[bool]],
    ) -> Any:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(lambda done: done.cancelled() or done.exception())  # read here if nobody else
        task = asyncio.current_task()
        assert task is not None
        self._local[name] = (answer, task)
        renewing = asyncio.ensure_future(self._renew(chain))
        try:
            if await cancelled():
                raise asyncio.CancelledError()
            result = await body()
            outcome: dict[str, Any]
            if isinstance(result, ToolResult):
                outcome = {"result": _wire(result).model_dump(by_alias=True, mode="json", exclude_none=True)}
            else:
                outcome = {"none": True}
            earlier = await self._record(name, outcome)
            if earlier is not None:
                # Another run ended first (this replica looked dead to it): both answer with its outcome, so
                # the result Docket keeps is the same whichever delivery ends last.
                with suppress(Exception, asyncio.CancelledError):
                    result = _outcome(earlier)
            answer.set_result(result)
            await self._release(chain)
            return result
        except asyncio.CancelledError:
            answer.cancel()
            # Cancelled by tasks/cancel: the other deliveries end cancelled too. Otherwise (the replica is
            # stopping) the leg is left to whoever takes it over.
            with suppress(StoreUnavailable):
                if await asyncio.shield(cancelled()):
                    await self._record(name, {"cancelled": True})
            await self._release(chain)
            raise
        except BaseException as exc:
            if not answer.done():
                answer.set_exception(exc)
            if isinstance(exc, MCPError):  # a protocol error fails the task: every delivery answers with it
                error = {"code": exc.error.code, "message": exc.error.message, "data": exc.error.data}
                await self._record(name, {"error": error})
            await self._release(chain)
            raise
        finally:
            renewing.cancel()
            self._local.pop(name, None)

    async def _follow(self, answer: asyncio.Future[Any], runner: asyncio.Task[Any]) -> Any:
        """A second delivery of a leg this replica runs: its answer; cancelling this cancels that run too."""
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            if not answer.done():
                runner.cancel()
            raise

    async def _renew(self, chain: list[tuple[str, str]]) -> None:
        while True:
            await asyncio.sleep(RUN_RENEW_SECONDS)
            for link, holder in chain:
                with suppress(StoreUnavailable):
                    await self.store.claim(link, holder, RUN_TTL_SECONDS)

    async def _record(self, name: str, outcome: dict[str, Any]) -> str | None:
        """Record the leg's outcome; None, or the outcome another run recorded first."""
        try:
            text = json.dumps(outcome, separators=(",", ":"))
            if await self.store.claim(f"{name}:done", text, DONE_TTL_SECONDS):
                return None
            return await self.store.claimed(f"{name}:done")
        except StoreUnavailable as exc:
            # A delivery waiting on it runs the leg again once the chain is released (its writes replay).
            log.warning("outcome of task %s not recorded: %s", name, exc)
            return None

    async def _release(self, chain: list[tuple[str, str]]) -> None:
        for link, _ in chain:
            try:
                await self.store.release(link)
            except StoreUnavailable as exc:
                log.warning("task run record %s not released (it lapses in %d s): %s", link, RUN_TTL_SECONDS, exc)


def _answered(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`fn`, with the store's refusals answered as `errors.StoreErrors` answers them in a call, and
    `ha.elicit`'s question as `AskForInput` answers it (the task then waits for its client's input)."""

    @functools.wraps(fn)
    async def answered(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except InputNeeded as needed:
            return InputRequiredToolResult(needed.result)
        except StoreFull as exc:
            raise ToolError(STORE_FULL) from exc
        except StoreUnavailable as exc:
            raise ToolError(STORE_UNAVAILABLE) from exc
        except Fenced as exc:
            raise ToolError(SESSION_MOVED) from exc
        except OpReused as exc:
            raise MCPError(INVALID_PARAMS, KEY_REUSED) from exc
        except Conflict as exc:
            raise ToolError(SESSION_BUSY) from exc
        except LimitExceeded as exc:
            refused(STORE_QUOTA, str(exc))
            raise ToolError(f"Refused: {exc}. Nothing was applied.") from exc

    answered.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    return answered


async def _docket_answered(creating: Awaitable[Any]) -> Any:
    """A task's creation (fastmcp-tasks writes its snapshot and Docket its task), with Redis' refusals
    answered as the kit's store's are: full, or out of reach, never an internal error."""
    try:
        return await creating
    except redis_exceptions.OutOfMemoryError as exc:
        raise ToolError(STORE_FULL) from exc
    except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError) as exc:
        raise ToolError(STORE_UNAVAILABLE) from exc


class Progress:
    """The progress a task's client has seen, kept (in Docket's Redis, for the task's life) so that it only
    rises: across runs that take the task over, and across the legs of a task that asked for input."""

    def __init__(self, docket: Any, task_id: str, ttl: timedelta) -> None:
        self.docket = docket
        self.key = docket.key(f"mcp-ha:progress:{task_id}")
        self.ttl = ttl
        self.seen = 0.0

    async def restore(self, execution: Any) -> None:
        """Set the leg's progress (which Docket's claim reset to zero) back to what the client saw."""
        async with self.docket.redis() as redis:
            kept = await redis.get(self.key)
        if kept is None:
            return
        last = json.loads(kept)
        self.seen = last["progress"]
        if last["total"] is not None:
            await execution.progress.set_total(int(last["total"]))
        await execution.progress.increment(int(self.seen))
        _sdk.set_reported_progress(execution, self.seen)
        if last["message"] is not None:
            await execution.progress.set_message(last["message"])

    async def rises(self, progress: float, total: float | None, message: str | None) -> bool:
        """Whether a report is not below what the client saw; if so it is kept first, so a run that takes
        the task over never starts below what reached the client."""
        if progress < self.seen:
            return False
        self.seen = progress
        last = json.dumps({"progress": progress, "total": total, "message": message})
        async with self.docket.redis() as redis:
            await redis.set(self.key, last, ex=self.ttl)
        return True


# The progress of the task run in this context (set by `HATasks` around the run's body).
task_progress: ContextVar[Progress | None] = ContextVar("mcp_ha_task_progress", default=None)


class TaskContext(Context):
    """A task's `Context`: its log messages (`ctx.info()` and the rest) go to the server's log, since a task
    has no session to send them on (FastMCP's own would raise, failing the task). `report_progress`'s
    message is what reaches the client, as the task's `statusMessage`, and only a rise reaches it
    (`Progress`)."""

    async def report_progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        kept = task_progress.get()
        if kept is None or await kept.rises(progress, total, message):
            await super().report_progress(progress, total, message)

    async def log(
        self,
        message: str,
        level: LoggingLevel | None = None,
        logger_name: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        task_log.log(_LEVELS.get(level or "info", logging.INFO), "task %s: %s", self.task_id, message)


task_log = logging.getLogger("mcp_ha.tasks.log")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "notice": logging.INFO, "warning": logging.WARNING} | {
    level: logging.ERROR for level in ("error", "critical", "alert", "emergency")
}


async def _task_context() -> Context | None:
    """fastmcp-tasks' worker `Context`, as a `TaskContext`."""
    ctx = await make_task_context()
    if ctx is not None:
        ctx.__class__ = TaskContext
    return ctx


def _supervised(
    run: Callable[..., Awaitable[None]], *, on_restart: Callable[[], None] | None
) -> Callable[..., Awaitable[None]]:
    """Docket's worker loop, started again whenever it ends on an error. Docket waits out a Redis error
    itself, but not every outage raises one: a Redis Cluster none of whose nodes answers raises redis-py's
    RedisClusterException, which ended the worker, and the replica ran no task until it was restarted."""

    async def supervised(*args: Any, **kwargs: Any) -> None:
        loop = asyncio.get_running_loop()
        delay = WORKER_RESTART_FIRST_SECONDS
        while True:
            started = loop.time()
            try:
                return await run(*args, **kwargs)  # it returns only when told to stop
            except Exception:
                if loop.time() - started > WORKER_RESTART_MAX_SECONDS:
                    delay = WORKER_RESTART_FIRST_SECONDS  # it had run a while: not the same failure again
                if on_restart is not None:
                    on_restart()
                log.exception("the task worker stopped on an error: starting it again in %.0f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, WORKER_RESTART_MAX_SECONDS)

    return supervised


def _runner_key(docket: Any, task_id: str) -> str:
    """Where the latest run of a task names its replica (beside the task's Docket state)."""
    return cast(str, docket.key(f"mcp-ha:runner:{task_id}"))  # Docket.key -> str; `docket` is Any


class _Slot(NamedTuple):
    """One of a client's MAX_TASKS_PER_CLIENT slots, taken for a task being created, charged to `client`
    what the task may keep until it ends (`reserved`); `kept`, what it keeps once ended, but its result."""

    name: str
    claimant: str
    client: str
    kept: int
    reserved: int


def _slot_records(slot: str, task_id: str) -> tuple[str, ...]:
    """What a client's slot holds for its task in the store (`_note`), freed together."""
    return (f"{slot}:task", slot, f"task-slot:{task_id}", f"task-call:{task_id}")


def _leg_name(execution_key: str) -> str:
    return "task:" + hashlib.sha256(execution_key.encode()).hexdigest()[:32]


def task_call(task_id: str, tool: str) -> tuple[str, str]:
    """`current_call` inside a run of task `task_id`: the same for every run and leg of the task."""
    return f"task:{task_id}", hashlib.sha256(f"{tool}\n{task_id}".encode()).hexdigest()[:32]


class NamedTask(GetTaskResult):
    """`tasks/get` of a working task, with `_meta` naming the replica that runs it. Every MCP result may
    carry `_meta`; the draft schema's task shape lists it no more than the `resultType` fastmcp-tasks
    already sends."""

    meta: dict[str, Any] | None = Field(default=None, serialization_alias="_meta")


class HATasks(TasksExtension):
    """FastMCP's tasks extension on the kit's store and settings, with the layer's guarantees (module doc)."""

    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        runs: Runs,
        *,
        on_worker_restart: Callable[[], None] | None = None,
    ) -> None:
        """`on_worker_restart`: told each time Docket's worker is started again after an error (a metric)."""
        super().__init__(
            url=docket_url(settings),
            name=DOCKET_NAME,
            worker_name=settings.instance_id,
            redelivery_timeout=timedelta(seconds=settings.task_redelivery_seconds),
            reconnection_delay=RECONNECTION_DELAY,
            minimum_check_interval=CHECK_INTERVAL,
        )
        self.kit_settings = settings
        self.store = store
        self.runs = TaskRuns(store, runs)
        self.on_worker_restart = on_worker_restart
        # A task's context snapshot stays in Redis for its life: never with its caller's credentials.
        _sdk.scrub_task_snapshots()

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        # Before the worker starts: what it will run, and nothing after it starts may suspend until each
        # function is wrapped (the worker task only runs once this coroutine next waits).
        tools = [t for t in await self.server.get_tasks() if isinstance(t, Tool) and t.task_config.supports_tasks()]
        async with super().lifespan():
            docket = _sdk.docket_of(self.server)
            # Before the worker's task first runs, so its first run is supervised too.
            _sdk.supervise_worker(self.server, functools.partial(_supervised, on_restart=self.on_worker_restart))
            if docket is not None:
                docket.execution_ttl = timedelta(seconds=self.kit_settings.task_ttl_seconds)
                for tool in tools:
                    registered = docket.tasks.get(tool.key)
                    if registered is None:
                        continue
                    inner = (
                        reentrant_task_fn(_answered(tool.fn), tool.name)
                        if isinstance(tool, FunctionTool)
                        else registered
                    )
                    docket.register(self._fenced(inner, tool, docket), names=[tool.key])
            # A task has no session to send log messages on: FastMCP's ctx.info() and the rest would raise.
            set_background_context_factory(_task_context)
            try:
                yield
            finally:
                set_background_context_factory(make_task_context)

    def _fenced(self, fn: Callable[..., Awaitable[Any]], tool: Tool, docket: Any) -> Callable[..., Awaitable[Any]]:
        """What the worker runs for `tool`: `fn` once fleet-wide (`TaskRuns`), keyed, its result bounded."""

        @functools.wraps(fn)
        async def fenced(*args: Any, **kwargs: Any) -> Any:
            info = get_task_context()
            if info is None:  # not a task leg (Docket's own): nothing to fence
                return await fn(*args, **kwargs)

            ran = False

            async def body() -> Any:
                nonlocal ran
                ran = True
                progress = Progress(docket, info.task_id, docket.execution_ttl)
                await progress.restore(current_execution.get())
                async with docket.redis() as redis:  # for tasks/get (RUNNER_META)
                    await redis.set(_runner_key(docket, info.task_id), self.kit_settings.instance_id, ex=progress.ttl)
                token = current_call.set(await self._call_of(info.task_id, tool.name))
                kept = task_progress.set(progress)
                try:
                    raw = await fn(*args, **kwargs)
                finally:
                    task_progress.reset(kept)
                    current_call.reset(token)
                return self._kept(tool, raw)

            async def cancelled() -> bool:
                return await is_cancelled(docket, info.task_scope, info.task_id)

            try:
                result = await self.runs.run(_leg_name(current_execution.get().key), body, cancelled)
            except asyncio.CancelledError:
                if ran and await asyncio.shield(cancelled()):
                    await self._end_slot(info.task_id, 0)
                raise
            except Exception as exc:  # the task failed: kept with its error
                if ran:
                    await self._end_slot(info.task_id, len(str(exc).encode()))
                raise
            if ran and result is not None:  # None: a leg that asks for input, still the client's task
                await self._end_slot(info.task_id, _wire_bytes(result) if isinstance(result, ToolResult) else 0)
            return result

        fenced.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        setattr(fenced, FENCED, True)
        return fenced

    async def _call_of(self, task_id: str, tool: str) -> tuple[str, str]:
        """`current_call` in a run of the task: the call that created it (its idempotency key, or HAProxy's
        request id, and its digest), so a call cut mid-stream and sent again as a task, under its key,
        applies its writes once; else the task's own. Its creator notes it just after Docket has the task,
        so the first run may look a few times."""
        deadline = asyncio.get_running_loop().time() + CALL_NOTED_WITHIN_SECONDS
        while (noted := await self.store.claimed(f"task-call:{task_id}")) is None:
            if asyncio.get_running_loop().time() > deadline:
                return task_call(task_id, tool)  # its creator stopped first
            await asyncio.sleep(POLL_SECONDS / 10)
        key, digest = json.loads(noted)
        return key, digest

    def _kept(self, tool: Tool, raw: Any) -> Any:
        """The result a run keeps: as the client will get it (a `ToolResult` of its exact wire form),
        or a tool error when that is over MAX_TASK_RESULT_BYTES. None (a leg that asks for input) as is."""
        if raw is None or isinstance(raw, mcp_types.InputRequiredResult | InputRequiredToolResult):
            return raw
        result = _wire(tool.convert_result(raw))
        size = _wire_bytes(result)
        limit = self.kit_settings.max_task_result_bytes
        if size > limit:
            refused("MAX_TASK_RESULT_BYTES", f"a result of {size} bytes from {tool.name}, not kept")
            text = RESULT_TOO_LARGE.format(size=size, limit=limit)
            result = mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)], is_error=True)
        return ToolResult.from_mcp_result(result)

    def methods(self) -> Sequence[MethodBinding]:
        """The extension's methods, with `tasks/get` naming the replica that runs a working task."""
        return [
            dataclasses.replace(b, handler=self._naming_runner(b.handler)) if b.method == "tasks/get" else b
            for b in super().methods()
        ]

    def _naming_runner(self, handler: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def get(ctx: Any, params: Any) -> Any:
            got = await handler(ctx, params)  # the caller's task: another's is answered as unknown
            docket = _sdk.docket_of(self.server)
            if got.status != "working" or docket is None:
                return got
            async with docket.redis() as redis:
                runner = await redis.get(_runner_key(docket, params.task_id))
            if runner is None:  # not claimed by a worker yet
                return got
            return NamedTask(**dict(got), meta={RUNNER_META: runner.decode() if isinstance(runner, bytes) else runner})

        return get

    async def intercept_tool_call(self, params: Any, context: Context, call_next: Any) -> Any:
        """A task-creating call takes one of its client's MAX_TASKS_PER_CLIENT slots first (`_reserve`)."""
        slot = await self._reserve(params, context)
        if slot is None:
            return await super().intercept_tool_call(params, context, call_next)
        try:
            outcome = await _docket_answered(super().intercept_tool_call(params, context, call_next))
        except BaseException:
            await self._free(slot)
            raise
        if isinstance(outcome, CreateTaskResult):
            await self._note(slot, outcome.task_id, current_call.get() or task_call(outcome.task_id, params.name))
        else:
            await self._free(slot)  # run inline after all (a tool another tool called)
        return outcome

    async def _reserve(self, params: Any, context: Context) -> _Slot | None:
        """The slot this call's task takes, charged what the task may keep; None when it is no task's."""
        request = context.request_context
        if (
            request is None
            or request.protocol_version not in MODERN_PROTOCOL_VERSIONS
            or context.client_extension_settings(TASKS_EXTENSION_ID) is None
        ):
            return None
        try:
            tool = await context.fastmcp.get_tool(params.name)
        except Exception:
            return None  # the extension answers an unknown tool as usual
        if tool is None or not tool.task_config.supports_tasks():
            return None
        arguments = self._check_arguments(tool, params.arguments or {})
        # Docket keeps them twice (the task's and its run's); an eighth more for the allocator's size classes.
        kept = TASK_KEPT_BYTES + 2 * arguments * 9 // 8
        token = get_access_token()
        if token is not None and "|" in (token.client_id or ""):
            raise ToolError(AMBIGUOUS_CLIENT)
        try:
            http = get_http_request()
            client = client_of(http.scope)
            kept += sum(len(name) + len(value) for name, value in http.scope["headers"])  # its snapshot
        except RuntimeError:
            client = "local"
        claimant = secrets.token_hex(8)
        # Until it ends, the most it may keep: its result, and its arguments once more in Docket's queue.
        reserved = kept + arguments + self.kit_settings.max_task_result_bytes
        slots = [f"tasks:{client}:{n}" for n in range(self.kit_settings.max_tasks_per_client)]
        try:
            for slot in slots:
                if await self.store.claim(slot, claimant, SLOT_PENDING_SECONDS, holder=client, charge=reserved):
                    return _Slot(slot, claimant, client, kept, reserved)
            # Every slot taken: free all those whose task has finished, at most once per SWEEP_SECONDS per client.
            if await self.store.claim(f"tasks:{client}:sweep", claimant, SWEEP_SECONDS):
                freed = []
                for slot in slots:
                    task_id = await self.store.claimed(f"{slot}:task")
                    if task_id is None or not await self._finished(task_id):
                        continue  # being created (or its creator stopped first: it lapses), or still live
                    await self._end_slot(task_id, 0)
                    freed.append(slot)
                for slot in freed:
                    if await self.store.claim(slot, claimant, SLOT_PENDING_SECONDS, holder=client, charge=reserved):
                        return _Slot(slot, claimant, client, kept, reserved)
        except LimitExceeded as exc:
            refused(STORE_QUOTA, str(exc))
            raise ToolError(f"Refused: {exc}. Nothing was started.") from exc
        refused("MAX_TASKS_PER_CLIENT")
        raise ToolError(TOO_MANY_TASKS.format(n=self.kit_settings.max_tasks_per_client))

    def _check_arguments(self, tool: Tool, arguments: Mapping[str, Any]) -> int:
        """A task keeps its arguments for its life: none it does not take, and at most MAX_TASK_ARGUMENT_BYTES.
        Their bytes, once they pass."""
        known = (tool.parameters or {}).get("properties", {})
        if unknown := sorted(set(arguments) - set(known)):
            raise ToolError(UNKNOWN_ARGUMENTS.format(tool=tool.name, names=", ".join(map(repr, unknown))[:200]))
        size = len(json.dumps(arguments, separators=(",", ":"), default=str).encode())
        limit = self.kit_settings.max_task_argument_bytes
        if size > limit:
            refused("MAX_TASK_ARGUMENT_BYTES")
            raise ToolError(ARGUMENTS_TOO_LARGE.format(size=size, limit=limit))
        return size

    async def _finished(self, task_id: str) -> bool:
        """Whether the caller's task `task_id` has finished (or is gone), as `tasks/get` would say."""
        try:
            got = await tasks_get(self.server, task_id)
        except MCPError:
            return True  # not found: expired, or never created
        return got.status in ("completed", "failed", "cancelled")

    async def _note(self, slot: _Slot, task_id: str, call: tuple[str, str]) -> None:
        """The task's call (`_call_of`); and slot and task, each findable from the other: the run that ends
        the task frees the slot (`_end_slot`), and a full client's sweep frees the slot of a task that ended
        otherwise (cancelled before it ran). The slot stays charged what the task may keep."""
        try:
            await self.store.claim(f"task-call:{task_id}", json.dumps(call), SLOT_TTL_SECONDS, holder=slot.client)
            await self.store.claim(f"{slot.name}:task", task_id, SLOT_TTL_SECONDS, holder=slot.client)
            noted = json.dumps([slot.name, slot.client, slot.kept])
            await self.store.claim(f"task-slot:{task_id}", noted, SLOT_TTL_SECONDS, holder=slot.client)
            await self.store.claim(slot.name, slot.claimant, SLOT_TTL_SECONDS, holder=slot.client, charge=slot.reserved)
        except (StoreUnavailable, LimitExceeded) as exc:
            log.warning("task %s not noted in its client's slot (it lapses): %s", task_id, exc)

    async def _end_slot(self, task_id: str, result_bytes: int) -> None:
        """Free the slot of a task that ended, and charge its client what the task keeps instead (its
        arguments, snapshot and result, for TASK_TTL_SECONDS): never more than the slot was charged."""
        try:
            noted = await self.store.claimed(f"task-slot:{task_id}")
            if noted is None:
                return
            if not noted.startswith("["):  # noted by a replica of an earlier version: the slot's name
                noted = json.dumps([noted, None, 0])
            name, client, kept = json.loads(noted)
            for record in _slot_records(name, task_id):
                await self.store.release(record)
            if client is not None:
                charge = kept + result_bytes
                ttl = self.kit_settings.task_ttl_seconds
                await self.store.claim(f"task-kept:{task_id}", "1", ttl, holder=client, charge=charge)
        except StoreUnavailable as exc:
            log.warning("slot of task %s not freed (the next sweep frees it): %s", task_id, exc)
        except LimitExceeded as exc:  # the client filled the room the slot left, in the moment between
            log.warning("task %s is kept uncharged: %s", task_id, exc)

    async def _free(self, slot: _Slot) -> None:
        with suppress(StoreUnavailable):
            await self.store.release(slot.name)
