"""The kinds of client the HA check (and the failover benchmark) drive, one session each, over a Shape's calls.

    plain           session-era MCP over raw HTTP (wire.RawSession): one session id for life, no retries
    resilient       the kit's ResilientClient: retries with one idempotency key, rejoins its session
    sessionless     FastMCP's Client in its default (2026-07-28) mode: a `create_session` handle passed
                    as the `session_id` argument of every call; nothing pins its requests to a replica.
                    Without the tasks extension, whatever the process imported: a task tool runs in the call
    fastmcp_tasks   the same with fastmcp-tasks (FastMCP's tasks extension): a task tool's call runs as a
                    background task, polled with tasks/get until it ends (`call_tool` hides that). Driven
                    by the task check only
    fastmcp_legacy  FastMCP's Client in mode="legacy" (session-era)
    python_sdk      the MCP Python SDK's ClientSession over streamable_http_client, at its defaults
    ts_sdk          the official TypeScript SDK's Client (node.py; needs Node)

Each answer comes with the replica that served it, read from the `Mcp-Ha-Replica` header the layer
adds to every answer (mcp_ha/replica.py), never from the server's tools. The only addition to a stock
client is an HTTP hook that reads that header (and the session id); ResilientClient's answers name
no replica (its HTTP client is its own).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypedDict

import httpx2
from fastmcp import Client
from fastmcp.client.client import CallToolResult as FastMCPResult
from fastmcp.client.transports import StreamableHttpTransport
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, TextContent

from mcp_ha._sdk import InlineClient, mcp_http_client
from mcp_ha.resilient_client import ResilientClient

from .node import NodeHost
from .shape import Call
from .wire import CallFailed, RawSession, final_message, tool_result

log = logging.getLogger(__name__)

REPLICA_HEADER = "mcp-ha-replica"  # mcp_ha.replica.REPLICA_HEADER, as an HTTP client reads it
RUNNER_META = "io.github.mcp-ha-kit/runner"  # mcp_ha.tasks.RUNNER_META (that module needs the tasks extra)
PLAIN_CALL_TIMEOUT = 5.0
# The stock clients keep their own defaults (no request timeout, or a minute); a call of theirs with no
# outcome within this (plus GUARD_SLACK_SECONDS) is abandoned and counted failed.
STOCK_CALL_BOUND = 5.0
# Past its bound a call is cut off this much later, so a run stays bounded even if a client breaks its
# promise; such a call counts as failed (and overran).
GUARD_SLACK_SECONDS = 1.0


class ResilientSettings(TypedDict):
    """ResilientClient's keyword arguments, typed per key so `**RESILIENT_SETTINGS` checks."""

    max_retries: int
    call_timeout: float
    total_timeout: float


# A call stuck on a hung replica is re-sent by HAProxy itself when it takes the replica out (within about
# 2.6 s), so the per-attempt timeout is above that: a client retry racing HAProxy's own only adds load.
# Retries go on for 20 s, so a restart of every replica costs the calls caught in it time, not an error.
RESILIENT_SETTINGS: ResilientSettings = {"max_retries": 20, "call_timeout": 4.0, "total_timeout": 20.0}


class Answer(dict[str, Any]):
    """A tool's structured result (the dict itself), and `replica`: the replica whose answer carried it
    (None when unseen)."""

    def __init__(self, result: dict[str, Any], replica: str | None) -> None:
        super().__init__(result)
        self.replica = replica


class ToolAnsweredError(Exception):
    """A tool result with isError set, as a client that does not raise on one hands it back."""


def structured(result: CallToolResult | FastMCPResult, tool: str) -> dict[str, Any]:
    """A call's structured content (the SDK's result or FastMCP's); ToolAnsweredError for a tool error."""
    if result.is_error:
        text = next((b.text for b in result.content if isinstance(b, TextContent)), "") or repr(result.content)[:160]
        raise ToolAnsweredError(text)
    if not isinstance(result.structured_content, dict):
        raise TypeError(f"{tool} answered no structured content")
    return result.structured_content


async def _ignore_progress(progress: float, total: float | None, message: str | None) -> None:
    """A progress handler that shows nothing: asking for progress is what makes a call stream."""


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: what actually went wrong."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class ReplicaSeen:
    """An httpx response hook: the replica (and session id) of the latest answer."""

    def __init__(self) -> None:
        self.replica: str | None = None
        self.session_id: str | None = None

    async def __call__(self, response: httpx2.Response) -> None:
        if replica := response.headers.get(REPLICA_HEADER):
            self.replica = replica
        if session_id := response.headers.get("mcp-session-id"):
            self.session_id = session_id

    def factory(self) -> Callable[..., httpx2.AsyncClient]:
        """An httpx_client_factory for FastMCP's transport: the SDK's own client, with this hook."""

        def make(
            headers: dict[str, str] | None = None,
            timeout: httpx2.Timeout | None = None,
            auth: httpx2.Auth | None = None,
            **_: Any,  # follow_redirects: the SDK's client follows them already
        ) -> httpx2.AsyncClient:
            http = mcp_http_client(headers=headers, timeout=timeout, auth=auth)
            http.event_hooks.setdefault("response", []).append(self)
            return http

        return make


class CheckClient:
    """One session of one kind of client: open, call, close."""

    kind: ClassVar[str]
    # The longest one call may take by the client's own timeouts; the driver cuts it off GUARD_SLACK_SECONDS later.
    bound: ClassVar[float]
    # Whether it retries a failed call itself. One that does not cannot know whether a failed call was
    # applied: each failed call may account for one effect (at most one).
    retries: ClassVar[bool] = False
    # Pinned to one replica by a session id (2025-11-25), rather than a handle any replica serves.
    session_era: ClassVar[bool] = True
    # Resumes a cut SSE stream by itself (Last-Event-ID), so a streamed call survives its replica.
    resumes_streams: ClassVar[bool] = False
    # Runs task tools as background tasks (the tasks extension): driven by the task check only.
    runs_tasks: ClassVar[bool] = False
    # Works again after a connection of its own closed with no answer (its balancer died). The MCP Python
    # SDK's transport does not (mcp 2.3.0): a transport error ends its session task for good, FastMCP's
    # Client on it likewise (tests/test_failover.py asserts it, a strict xfail).
    survives_dropped_connection: ClassVar[bool] = True
    # Reading the final count is not a measured call: a client with no retries of its own gets a few tries.
    final_read_attempts: ClassVar[int] = 5
    # The session id, once open (session-era kinds): a raw client can read the final count under it.
    session_id: str | None = None

    async def open(self) -> None:
        raise NotImplementedError

    async def call(
        self,
        call: Call | str,
        arguments: dict[str, Any] | None = None,
        *,
        bound: float | None = None,
        progress: bool = False,
    ) -> Answer:
        """`call` (a Call, or a tool's name) on this client's session, with `arguments` (by default the
        Call's own, as before any write). `bound`, for the kinds that take one per call, replaces the
        client's own (a streamed call runs longer); `progress` asks for progress notifications, as a
        client showing them would, so the call streams."""
        if isinstance(call, str):
            call = Call(call)
        return await self._call(
            call.tool, call.arguments_after(None) if arguments is None else arguments, bound, progress
        )

    async def _call(self, tool: str, arguments: dict[str, Any], bound: float | None, progress: bool) -> Answer:
        raise NotImplementedError

    async def aclose(self) -> None:
        """End the session; safe whether or not `open` got anywhere."""
        raise NotImplementedError

    async def reconnect(self) -> None:
        """Before another try at the final read: a new connection to the same session, if need be."""

    @property
    def replica(self) -> str | None:
        """The replica of the latest answer, when this kind can see it."""
        return None

    @property
    def new_sessions(self) -> int:
        """Sessions the client had to open anew during the run."""
        return 0


class PlainClient(CheckClient):
    """Session-era MCP as a naive client speaks it: one session id for life, no retries, each call bounded."""

    kind = "plain"
    bound = PLAIN_CALL_TIMEOUT

    def __init__(self, url: str) -> None:
        self.http = httpx2.AsyncClient(timeout=self.bound)
        self.session = RawSession(self.http, url, timeout=self.bound, client_name="mcp-ha-check")
        self._replica: str | None = None

    async def open(self) -> None:
        self.session_id = await self.session.open()

    async def _call(self, tool: str, arguments: dict[str, Any], bound: float | None, progress: bool) -> Answer:
        params: dict[str, Any] = {"name": tool, "arguments": arguments}
        if progress:
            params["_meta"] = {"progressToken": uuid.uuid4().hex}
        # One call at a time per session: a longer bound for this one is set, then put back.
        self.session.timeout = self.bound if bound is None else bound
        try:
            response = await self.session.post("tools/call", params)
        finally:
            self.session.timeout = self.bound
        self._replica = response.headers.get(REPLICA_HEADER) or self._replica
        return Answer(tool_result(final_message(response)), self._replica)

    @property
    def replica(self) -> str | None:
        return self._replica

    async def aclose(self) -> None:
        try:
            await self.session.close()
        finally:
            await self.http.aclose()


class ResilientCheckClient(CheckClient):
    kind = "resilient"
    # stamina starts no attempt after total_timeout; one attempt (recovery + call) is capped at twice call_timeout.
    bound = RESILIENT_SETTINGS["total_timeout"] + 2 * RESILIENT_SETTINGS["call_timeout"]
    retries = True
    final_read_attempts = 1  # it retries on its own

    def __init__(self, url: str) -> None:
        self.client = ResilientClient(url, **RESILIENT_SETTINGS)

    async def open(self) -> None:
        await self.client.__aenter__()
        self.session_id = self.client.session_id

    async def _call(self, tool: str, arguments: dict[str, Any], bound: float | None, progress: bool) -> Answer:
        # A tool error raises (FastMCP's default): the client retries the store's refusals among them.
        return Answer(structured(await self.client.call_tool(tool, arguments), tool), None)

    async def aclose(self) -> None:
        await self.client.aclose()

    @property
    def new_sessions(self) -> int:
        return max(len(self.client.sessions) - 1, 0)


class SessionlessClient(CheckClient):
    """FastMCP's Client in its default (sessionless, 2026-07-28) mode, as is: no retries of its own.

    Its state lives under the handle `create_session` returned, passed as `session_id` to every call.
    A transport error on one request (a connection closed with no answer) ends this client for good
    (FastMCP 4.0.11, mcp 2.3.0): every later call raises again. Its state is the handle's, so the final
    read, which is not a measured call, goes through a new Client with the same handle when it must.
    """

    kind = "sessionless"
    bound = PLAIN_CALL_TIMEOUT
    session_era = False
    survives_dropped_connection = False

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen = ReplicaSeen()
        self.client = self._client()
        self.handle: str | None = None
        self._entered = False

    def _client(self) -> Client[StreamableHttpTransport]:
        transport = StreamableHttpTransport(self.url, httpx_client_factory=self.seen.factory())
        return InlineClient(transport, timeout=self.bound)

    async def open(self) -> None:
        await self.client.__aenter__()  # type: ignore[no-untyped-call]  # unannotated in FastMCP
        self._entered = True
        self.handle = (await self.client.call_tool("create_session", {})).data["session_id"]

    async def _call(self, tool: str, arguments: dict[str, Any], bound: float | None, progress: bool) -> Answer:
        result = await self.client.call_tool(
            tool,
            {**arguments, "session_id": self.handle},
            timeout=bound,
            progress_handler=_ignore_progress if progress else None,
        )
        return Answer(structured(result, tool), self.seen.replica)

    @property
    def replica(self) -> str | None:
        return self.seen.replica

    async def aclose(self) -> None:
        # A handle has no end: it expires with the session TTL, like any idle session.
        if self._entered:
            self._entered = False
            await self.client.__aexit__(None, None, None)  # type: ignore[no-untyped-call]  # unannotated in FastMCP

    async def reconnect(self) -> None:
        try:
            async with asyncio.timeout(5):
                await self.aclose()
        except Exception as exc:  # a broken client re-raises its transport's error on the way out too
            log.debug("closing a broken sessionless client: %r", exc)
        self.client = self._client()
        await self.client.__aenter__()  # type: ignore[no-untyped-call]  # unannotated in FastMCP
        self._entered = True


class TaskSeen(ReplicaSeen):
    """`ReplicaSeen`, and of each `tasks/get` answer: the task, its status and message, and the replica the
    server names as running it (`_meta`, RUNNER_META), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.polls: list[dict[str, Any]] = []
        self.named = asyncio.Event()  # set once an answer names the replica running the task

    def forget(self) -> None:
        """Forget the answers seen so far: what follows is another task's."""
        self.polls.clear()
        self.named.clear()

    @property
    def runner(self) -> str | None:
        """The replica named by the latest answer that named one."""
        return next((p["runner"] for p in reversed(self.polls) if p["runner"]), None)

    async def __call__(self, response: httpx2.Response) -> None:
        await super().__call__(response)
        if response.request.headers.get("mcp-method") != "tasks/get" or response.status_code != 200:
            return
        await response.aread()  # an answer of a few hundred bytes; the SDK reads it from the cache
        try:
            result = final_message(response).get("result")
        except (CallFailed, ValueError):
            return  # not an answer the hook can read: the client sees it for itself
        if isinstance(result, dict):
            self.polls.append(
                {
                    "task": result.get("taskId"),
                    "status": result.get("status"),
                    "message": result.get("statusMessage"),
                    "runner": (result.get("_meta") or {}).get(RUNNER_META),
                    "replica": response.headers.get(REPLICA_HEADER),
                }
            )
            if self.polls[-1]["runner"]:
                self.named.set()


class TasksClient(SessionlessClient):
    """FastMCP's Client with its tasks extension: fastmcp-tasks imported, as a user of tasks does (FastMCP
    opts in on that import). A task tool's `call_tool` runs as a task FastMCP polls to its end; each poll's
    answer is seen (`TaskSeen`)."""

    kind = "fastmcp_tasks"
    runs_tasks = True
    seen: TaskSeen

    def __init__(self, url: str) -> None:
        import fastmcp_tasks  # noqa: F401  FastMCP's Client asks for tasks once this is imported

        super().__init__(url)
        self.seen = TaskSeen()
        self.client = self._client()

    def _client(self) -> Client[StreamableHttpTransport]:
        return Client(StreamableHttpTransport(self.url, httpx_client_factory=self.seen.factory()), timeout=self.bound)


class FastMCPLegacyClient(CheckClient):
    """FastMCP's Client in `mode="legacy"`: the session-era `initialize`, the session pinned by its
    Mcp-Session-Id; every other setting its default."""

    kind = "fastmcp_legacy"
    bound = STOCK_CALL_BOUND
    resumes_streams = True
    survives_dropped_connection = False

    def __init__(self, url: str) -> None:
        self.seen = ReplicaSeen()
        self.client = Client(StreamableHttpTransport(url, httpx_client_factory=self.seen.factory()), mode="legacy")
        self._entered = False

    async def open(self) -> None:
        await self.client.__aenter__()  # type: ignore[no-untyped-call]  # unannotated in FastMCP
        self._entered = True
        self.session_id = self.seen.session_id

    async def _call(self, tool: str, arguments: dict[str, Any], bound: float | None, progress: bool) -> Answer:
        result = await self.client.call_tool(tool, arguments, progress_handler=_ignore_progress if progress else None)
        return Answer(structured(result, tool), self.seen.replica)

    @property
    def replica(self) -> str | None:
        return self.seen.replica

    async def aclose(self) -> None:
        if self._entered:
            self._entered = False
            await self.client.__aexit__(None, None, None)  # type: ignore[no-untyped-call]  # unannotated in FastMCP


class PythonSDKClient(CheckClient):
    """The MCP Python SDK's own `ClientSession` over its `streamable_http_client`, both at their defaults.

    The transport's task group must be left by the task that entered it, so one task of its own holds
    the session open until `aclose`; calls come from any task.
    """

    kind = "python_sdk"
    bound = STOCK_CALL_BOUND
    resumes_streams = True
    survives_dropped_connection = False

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen = ReplicaSeen()
        self.session: ClientSession | None = None
        self._closing = asyncio.Event()
        self._holder: asyncio.Task[None] | None = None
        # What ended the SDK's transport early: the SDK answers every later call "Connection closed",
        # which alone does not say why.
        self.ended_by: BaseException | None = None

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        try:
            http = mcp_http_client()
            http.event_hooks.setdefault("response", []).append(self.seen)
            async with (
                http,
                streamable_http_client(self.url, http_client=http) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                self.session = session
                self.session_id = self.seen.session_id
                ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                # The transport ended on an error: every later call fails, which the figures count.
                self.ended_by = exc
                log.warning("a python_sdk session ended: %r", exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def open(self) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._holder = asyncio.create_task(self._hold(ready))
        await ready

    async def _call(self, tool: str, arguments: dict[str, Any], bound: float | None, progress: bool) -> Answer:
        if self.session is None:
            raise RuntimeError("the session is not open")
        try:
            result = await self.session.call_tool(
                tool, arguments, progress_callback=_ignore_progress if progress else None
            )
        except Exception as exc:
            if self._holder is not None and not self._holder.done():
                # The holder records the transport's end just after the calls see it.
                await asyncio.wait([self._holder], timeout=0.5)
            if self.ended_by is not None:
                cause = _leaf(self.ended_by)
                raise RuntimeError(f"{exc} (the SDK's transport ended on {type(cause).__name__}: {cause})") from exc
            raise
        if not isinstance(result, CallToolResult):
            raise TypeError(f"{tool} answered a {type(result).__name__}, not a CallToolResult")
        return Answer(structured(result, tool), self.seen.replica)

    @property
    def replica(self) -> str | None:
        return self.seen.replica

    async def aclose(self) -> None:
        self._closing.set()
        if self._holder is not None:
            holder, self._holder = self._holder, None
            try:
                async with asyncio.timeout(5):
                    await holder
            finally:
                holder.cancel()


class TypeScriptSDKClient(CheckClient):
    """The official TypeScript SDK's `Client` over its `StreamableHTTPClientTransport`, at their defaults:
    one session in the Node process `host` runs for every session of this kind (node.py)."""

    kind = "ts_sdk"
    bound = STOCK_CALL_BOUND
    resumes_streams = True

    def __init__(self, url: str, host: NodeHost) -> None:
        self.url = url
        self.host = host
        self.number: int | None = None
        self._replica: str | None = None

    async def open(self) -> None:
        opened = await self.host.request({"op": "open", "url": self.url}, within=30)
        self.number = int(opened["session"])
        self.session_id = opened.get("session_id")
        self._replica = opened.get("replica")

    async def _call(self, tool: str, arguments: dict[str, Any], bound: float | None, progress: bool) -> Answer:
        limit = self.bound if bound is None else bound
        answer = await self.host.request(
            {
                "op": "call",
                "session": self.number,
                "tool": tool,
                "arguments": arguments,
                "progress": progress,
                # The SDK's own AbortSignal abandons the call then: the check's bound, not a client setting.
                "bound_ms": int((limit + GUARD_SLACK_SECONDS) * 1000),
            },
            within=limit + GUARD_SLACK_SECONDS + 2,
        )
        self._replica = answer.get("replica") or self._replica
        if not answer.get("ok"):
            error = str(answer.get("error"))
            raise TimeoutError(error) if answer.get("overran") else CallFailed(error)
        return Answer(answer["result"], self._replica)

    @property
    def replica(self) -> str | None:
        return self._replica

    async def aclose(self) -> None:
        if self.number is not None and self.host.running:
            number, self.number = self.number, None
            await self.host.request({"op": "close", "session": number}, within=10)


# The kinds that run in this process, made with the URL alone.
IN_PROCESS: dict[
    str, type[PlainClient | ResilientCheckClient | SessionlessClient | FastMCPLegacyClient | PythonSDKClient]
] = {
    c.kind: c
    for c in (PlainClient, ResilientCheckClient, SessionlessClient, FastMCPLegacyClient, PythonSDKClient, TasksClient)
}
# The clients nobody here wrote, at their defaults (FastMCP's default, sessionless, among them).
STOCK_KINDS = ("ts_sdk", "python_sdk", "fastmcp_legacy", "sessionless")


class ClientFactory:
    """New clients of any kind for one URL; the Node process of the ts_sdk kind starts with its first
    client and ends with the factory (`async with`)."""

    def __init__(self, url: str, *, node_clients: str | Path | None = None) -> None:
        self.url = url
        self.node_clients = node_clients
        self._host: NodeHost | None = None

    @staticmethod
    def kind_class(kind: str) -> type[CheckClient]:
        return TypeScriptSDKClient if kind == "ts_sdk" else IN_PROCESS[kind]

    def new(self, kind: str) -> CheckClient:
        if kind == "ts_sdk":
            if self._host is None:
                self._host = NodeHost(self.node_clients)
            return TypeScriptSDKClient(self.url, self._host)
        return IN_PROCESS[kind](self.url)

    async def __aenter__(self) -> ClientFactory:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._host is not None:
            await self._host.aclose()
