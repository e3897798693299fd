"""The only code of the kit that reaches into the MCP SDK's private session handling.

The SDK (mcp 2.3.0) keeps streamable-HTTP sessions in a dict on its
`StreamableHTTPSessionManager` and answers 404 for any id it did not create
itself. Adoption needs three things it does not offer publicly:

- to know whether this replica holds a session, and how many it holds
  (`_server_instances`; the count is a metric, `metrics.py`);
- to create a session under an id it did not mint, already initialized with
  the client's stored params (a transport registered under that id, and a
  connection built like `serve_loop` builds it but marked initialized), and
  to forget it again when it ends (`_discard_session`).

With authentication on, the SDK binds each session to the principal that
created it (`_session_owners`) and answers 404 to anyone else; an adopted
session is bound to the principal adopting it (whom `adoption.py`
has checked against the session's recorded owner), or its rightful owner
would get that 404.

Resumable streams (`streams/`) need one more: an event store per
session. The SDK takes one store for all transports (FastMCP's wraps it with
a random prefix per transport, which no other replica can know), so the
session's own store is set on its transport (`_event_store`) instead: at
`initialize`, before the answer is sent, and when a session is adopted.

Answers as JSON until there is something to stream (`JsonFirstTransport`):
the SDK picks JSON or SSE once per transport (`json_response`), and its
SSE path opens a stream, stores a priming event and the answer in the event
log before the call has anything to stream. The kit's transports take a
request's first message first: the call's answer goes out as one JSON
response, never stored (nothing can resume a response that has not
started, and until it starts HAProxy re-sends the request elsewhere when its
replica dies, under the same idempotency key); a notification or a request
of the server's first turns the response into the SDK's own SSE stream,
that message first, with the SSE `retry:` field. Its POST handling
(`_handle_post_request`) is the SDK's, validation included, for everything
else. The event log is told which streams have not started
(`_unstreamed`), so their answers cost no write. A call whose response's
connection closes before it answers holds its session (counted in flight, so
the SDK does not end it as idle, the call with it) until it answers, and the
event log is told (`unread`), which cancels it as the client's
`notifications/cancelled` would once nobody has read it for a while.

Subscriptions (`subscriptions.py`) need the server to answer
`subscriptions/listen`, `resources/subscribe` and `resources/unsubscribe`.
FastMCP registers none of them and has no public way to add a request
handler, so they go on its low-level server (`_mcp_server`), whose
`add_request_handler` is public; that also makes the capabilities say so.
Refusing a replayed request state (`request_state.py`) needs a middleware
of the same server's, just outside the SDK's `RequestStateBoundary`, which
is where the sealed state is still on the request.

Durable tasks (`tasks.py`) keep no credentials: fastmcp-tasks' public
`TaskContextSnapshot.capture` is wrapped (`scrub_task_snapshots`), so the
snapshot it keeps in Redis for a task's life leaves out the raw bearer
token and credential headers.

Bounds (`limits.py`, `adoption.py`) need two more things: a middleware of
that server's around every request's handler, outermost (`CallsRunning`:
a call in flight until its handler ends); and, to forget a client's least
recently used idle transport, whether a transport is idle and a way to end
it as its idle timeout would. Both through its public `idle_scope`: the SDK
holds its deadline at infinity while a request is in flight, and cancelling
it is what the timeout does.

The SDK checks a 2026-07-28 `tools/call`'s `Mcp-Param-*` headers against the
tool's input schema, from the low-level server's `get_tool_input_schema` when
it has one, else by running a whole `tools/list` (every middleware of the
server's) before each call that has arguments: a third of such a call's CPU.
FastMCP sets none before 4.2, so `ToolSchemas` serves it as FastMCP 4.2 does
(leaving a server alone that has one).

FastMCP's `get_session` reads a session from its `session_state_store` as
one value whose layout is FastMCP's own (`fastmcp_store.FastMCPSessions` serves it
from the kit's store): a creation mark and the state under
`fastmcp.server.sessions._MARKER_KEY` and `._STATE_KEY`.

Durable tasks (`tasks.py`) run on the Docket that FastMCP's tasks extension
(`fastmcp-tasks`) starts in the server's lifespan and keeps on the server
(`_docket`), with no public way to reach it: the layer sets how long a
finished task is kept on it (`execution_ttl`, which the extension does not
take) and wraps the task functions registered there, before its worker runs
any. A run that takes a task over starts its progress where its client saw
it, so FastMCP's `report_progress` is told where that is.
FastMCP's `Client` asks every server to run task tools as tasks once
fastmcp-tasks is imported anywhere in the process; the HA check drives both
kinds of client in one process, so its sessionless kind is an `InlineClient`,
which never asks (as FastMCP's own proxy client never does).

Every private attribute touched here, and nowhere else in the kit, those
`JsonFirstTransport` inherits from the SDK's transport included:

| attribute | of | why |
|---|---|---|
| `_server_instances` | the session manager | which sessions this replica holds; registering an adopted one |
| `_session_owners` | the session manager | the principal an adopted session is bound to |
| `_discard_session` | the session manager | forgetting an adopted session when it ends |
| `_task_group` | the session manager | running an adopted session's connection beside the SDK's own |
| `_lifespan_state` | the session manager | the server's lifespan state, for that connection |
| `_handle_post_request` | a transport | answering as JSON until there is something to stream (`JsonFirstTransport`) |
| `_serve_events` | a transport | sets its `_event_store` (the session's own) and `_unstreamed` |
| `_event_store` | a transport, inherited | the session's own event store, set when the session is bound or adopted |
| `_read_stream_writer` | a transport, inherited | where a request goes to the server, and a cancellation (`_cancel`) |
| `_request_streams` | a transport, inherited | the stream a request's answer comes back on, as the SDK keeps it |
| `_sse_stream_writers` | a transport, inherited | the SSE stream of a response that turned to streaming |
| `_requests_in_flight` | a transport, inherited | a call whose reader left, counted in flight (`_hold`) |
| `_idle_timeout` | a transport, inherited | when that count reaches 0, the idle deadline set again as the SDK sets it |
| `_retry_interval` | a transport, inherited | the SSE `retry:` field of a response that turned to streaming |
| `_check_content_type` | a transport, inherited | the SDK's own check of a POST, before the kit reads its body |
| `_validate_request_headers` | a transport, inherited | the SDK's own checks of a request's headers |
| `_create_session_message` | a transport, inherited | a request sent to the server as the SDK sends it |
| `_create_error_response` | a transport, inherited | the SDK's answer when the session ends under a request |
| `_create_json_response` | a transport, inherited | an answer sent as JSON, as the SDK sends one |
| `_create_event_data` | a transport, inherited | the first SSE event of a response that turned to streaming |
| `_run_sse_writer` | a transport, inherited | the SDK's own writer of that SSE response |
| `_clean_up_memory_streams` | a transport, inherited | a request's streams dropped as the SDK drops them |
| `_MARKER_KEY` | `fastmcp.server.sessions` | the creation mark in a FastMCP session's stored value |
| `_STATE_KEY` | `fastmcp.server.sessions` | where that value holds the session's state |
| `_mcp_server` | a FastMCP server | its low-level server: request handlers, a middleware, tools' schemas |
| `_docket` | a FastMCP server | the Docket its tasks extension runs, while its lifespan runs (`tasks.py`) |
| `_worker` | a FastMCP server | the Docket worker its tasks extension runs, to supervise it (`tasks.py`) |
| `_run` | a Docket worker | its loop, which `run_forever` calls: started again when it ends on an error |
| `_fastmcp_last_progress` | a Docket execution | a run taking a task over starts from its progress (`tasks.py`) |
| `_auto_internal_extensions` | FastMCP's `Client` | a client that never asks for tasks (`InlineClient`) |
| `_httpx_utils` | `mcp.shared` | the SDK transports' own HTTP client, for the HA check (`mcp_http_client`) |

`tests/mcp_ha/test_sdk.py` checks each of these against the installed SDK;
if an upgrade moves them, that test fails first and says which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from http import HTTPStatus
from typing import Any, Protocol, cast, runtime_checkable

import anyio
import fastmcp.server.sessions as fastmcp_sessions
import httpx2
import pydantic_core
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream
from fastmcp import Client, FastMCP
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import Tool
from fastmcp.utilities.versions import dedupe_with_versions
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, authorization_context
from mcp.server.connection import Connection
from mcp.server.request_state import RequestStateBoundary
from mcp.server.runner import serve_connection
from mcp.server.streamable_http import (
    CONTENT_TYPE_SSE,
    MCP_SESSION_ID_HEADER,
    REQUEST_STREAM_BUFFER_SIZE,
    EventCallback,
    EventId,
    EventMessage,
    EventStore,
    StreamableHTTPServerTransport,
    StreamId,
    check_accept_headers,
)
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher
from mcp.shared.message import SessionMessage
from mcp_types import (
    DEFAULT_NEGOTIATED_VERSION,
    INTERNAL_ERROR,
    InitializeRequestParams,
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    RequestId,
    jsonrpc_message_adapter,
)
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


def session_manager(app: Starlette, path: str) -> StreamableHTTPSessionManager | None:
    """The manager behind `path`; None until the app's lifespan has started it."""
    for route in app.routes:
        # FastMCP serves its endpoint as a Route; only a Route has an endpoint.
        if isinstance(route, Route) and route.path == path:
            endpoint: Any = route.endpoint
            # With auth on, FastMCP wraps the endpoint in its RequireAuthMiddleware.
            while not hasattr(endpoint, "session_manager") and hasattr(endpoint, "app"):
                endpoint = endpoint.app
            return getattr(endpoint, "session_manager", None)
    raise LookupError(f"no MCP endpoint at {path}")


class Endpoint:
    """The MCP endpoint at `path` of the app `HighAvailability.http_app` builds: FastMCP makes its session
    manager with that app, after what needs to ask it (subscriptions) is made; `app` is set once built."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.app: Starlette | None = None

    def holds(self, session_id: str) -> bool:
        """Whether this replica holds `session_id` (False until the app runs)."""
        manager = None if self.app is None else session_manager(self.app, self.path)
        return manager is not None and holds(manager, session_id)


def running_session_manager(app: Starlette, path: str) -> StreamableHTTPSessionManager:
    """The manager behind `path`, while a request is served (the app's lifespan has started it)."""
    manager = session_manager(app, path)
    if manager is None:
        raise RuntimeError(f"no session manager at {path}: the app's lifespan has not started")
    return manager


def holds(manager: StreamableHTTPSessionManager, session_id: str) -> bool:
    return session_id in manager._server_instances


def refuses(manager: StreamableHTTPSessionManager, session_id: str, user: object) -> bool:
    """Whether the SDK will answer `user`'s request for a session it holds with 404: another principal's."""
    requestor = authorization_context(user) if isinstance(user, AuthenticatedUser) else None
    return requestor != manager._session_owners.get(session_id)


def held_count(manager: StreamableHTTPSessionManager) -> int:
    """How many sessions this replica holds a transport for (opened here or adopted)."""
    return len(manager._server_instances)


def idle(manager: StreamableHTTPSessionManager, session_id: str) -> bool:
    """Whether the transport of `session_id` (held here) serves nothing now: its idle countdown runs (the
    SDK stops it, a deadline of infinity, while any request is in flight, a GET stream included)."""
    scope = manager._server_instances[session_id].idle_scope
    return scope is not None and not scope.cancel_called and scope.deadline != math.inf


async def ended_here(manager: StreamableHTTPSessionManager, session_id: str, *, seconds: float) -> bool:
    """Wait, at most `seconds`, until a transport of `session_id` that is ending (idle, forgotten, or
    terminated) has left the SDK's table; False if it is still there. Until it leaves, the SDK answers its
    session's requests 404 "terminated", and a new transport registered under the id would be dropped by
    its discard: the session's next request must be adopted afresh, after it."""
    with anyio.move_on_after(seconds):
        while (transport := manager._server_instances.get(session_id)) is not None:
            scope = transport.idle_scope
            if not transport.is_terminated and (scope is None or not scope.cancel_called):
                return True
            await anyio.sleep(0.005)
        return True
    return False


def forget(manager: StreamableHTTPSessionManager, session_id: str) -> None:
    """End the transport of `session_id` now, as its idle timeout would: the SDK discards it, and the
    session's next request adopts it again."""
    scope = manager._server_instances[session_id].idle_scope
    if scope is not None:
        scope.cancel()


@runtime_checkable
class ResumableEvents(Protocol):
    """What the kit's event store (`streams.event_store.SessionEvents`) offers a transport beyond the SDK's
    `EventStore`: told of each response that starts streaming, and of each whose reader left; asked whether
    a request is a re-run (`streams.reruns`), and into which stream of the log."""

    async def start_stream(
        self, stream_id: str, request: JSONRPCRequest, http: Request, *, stream: str | None = None
    ) -> None: ...

    def unread(self, stream_id: str, cancel: Callable[[str], Awaitable[None]]) -> None: ...

    def rerun_into(self, stream_id: str) -> str | None: ...


class _Unstreamed(EventStore):
    """A session's event store, except for the answers of responses that have not started: nothing
    can resume those (they go out as JSON), so they are not stored. The first other message of such a
    response starts its stream: the event store, when it is the kit's (`ResumableEvents`), is told before
    that message is stored, and the transport sees that message first too."""

    def __init__(self, events: EventStore, unstreamed: dict[str, tuple[JSONRPCRequest, Request]]) -> None:
        self.events = events
        self.kit = events if isinstance(events, ResumableEvents) else None
        self.unstreamed = unstreamed
        # The responses streaming, until their answers; and the releases of the sessions held by those
        # whose connection closed first (see JsonFirstTransport's `_left`).
        self.streaming: set[str] = set()
        self.held: dict[str, Callable[[], None]] = {}

    async def start(self, stream_id: str, message: JSONRPCRequest, request: Request, stream: str | None) -> None:
        self.streaming.add(stream_id)
        if self.kit is not None:
            await self.kit.start_stream(stream_id, message, request, stream=stream)

    def rerun_into(self, stream_id: str) -> str | None:
        return None if self.kit is None else self.kit.rerun_into(stream_id)

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        if message is not None and stream_id in self.unstreamed:
            if isinstance(message, JSONRPCResponse | JSONRPCError):
                return ""  # an answer as JSON: nothing to resume
            await self.start(stream_id, *self.unstreamed.pop(stream_id), None)
        if isinstance(message, JSONRPCResponse | JSONRPCError):
            self.streaming.discard(stream_id)
            release = self.held.pop(stream_id, None)
            if release is not None:
                release()
        return await self.events.store_event(stream_id, message)

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        return await self.events.replay_events_after(last_event_id, send_callback)


class JsonFirstTransport(StreamableHTTPServerTransport):
    """The SDK's transport, answering a request as JSON unless it has something to stream first."""

    _unstreamed: dict[str, tuple[JSONRPCRequest, Request]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._serve_events(self._event_store)

    def _serve_events(self, event_store: EventStore | None) -> None:
        """Store and replay through `event_store`, except the answers of responses not yet started."""
        self._unstreamed = {}
        self._event_store = None if event_store is None else _Unstreamed(event_store, self._unstreamed)

    async def _handle_post_request(self, scope: Scope, request: Request, receive: Receive, send: Send) -> None:
        message = await self._request_of(request)
        writer = self._read_stream_writer
        if not isinstance(message, JSONRPCRequest) or message.method == "initialize" or writer is None:
            return await super()._handle_post_request(scope, request, receive, send)
        if not await self._validate_request_headers(request, send):
            return
        request_id = str(message.id)
        version = request.headers.get(MCP_PROTOCOL_VERSION_HEADER, DEFAULT_NEGOTIATED_VERSION)
        streams = anyio.create_memory_object_stream[EventMessage](REQUEST_STREAM_BUFFER_SIZE)
        self._request_streams[request_id] = streams
        events = self._event_store
        rerun = events.rerun_into(request_id) if isinstance(events, _Unstreamed) else None
        try:
            if rerun is None:
                self._unstreamed[request_id] = (message, request)
            elif isinstance(events, _Unstreamed):
                await events.start(request_id, message, request, rerun)
            await writer.send(self._create_session_message(message, request, request_id, version))
            first = await streams[1].receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            await self._clean_up_memory_streams(request_id)
            response = self._create_error_response(
                "Session terminated before the request completed", HTTPStatus.INTERNAL_SERVER_ERROR, INTERNAL_ERROR
            )
            return await response(scope, receive, send)
        finally:
            self._unstreamed.pop(request_id, None)
        if isinstance(first.message, JSONRPCResponse | JSONRPCError):
            await self._clean_up_memory_streams(request_id)
            return await self._create_json_response(first.message)(scope, receive, send)
        await self._stream(scope, receive, send, message, streams[1], first)

    async def _request_of(self, request: Request) -> JSONRPCMessage | None:
        """The JSON-RPC message a POST carries, when the kit answers it; None leaves it to the SDK."""
        if self.is_json_response_enabled or self._read_stream_writer is None or not all(check_accept_headers(request)):
            return None
        if not self._check_content_type(request):
            return None
        body = await request.body()  # read whole already: limits.BodyLimit drops a client that left
        try:
            return jsonrpc_message_adapter.validate_python(pydantic_core.from_json(body), by_name=False)
        except ValueError:  # not JSON-RPC (pydantic's ValidationError is one): the SDK answers it
            return None

    async def _stream(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        message: JSONRPCRequest,
        answers: MemoryObjectReceiveStream[EventMessage],
        first: EventMessage,
    ) -> None:
        """Something to stream: from here on, the SDK's own SSE response, `first` first."""
        request_id = str(message.id)
        event = self._create_event_data(first)
        if self._event_store is not None and self._retry_interval is not None:
            event["retry"] = self._retry_interval
        sse_writer, sse_reader = anyio.create_memory_object_stream[Any](0)
        self._sse_stream_writers[request_id] = sse_writer
        headers = {
            "Cache-Control": "no-cache, no-transform",
            "Connection": "keep-alive",
            "Content-Type": CONTENT_TYPE_SSE,
            **({MCP_SESSION_ID_HEADER: self.mcp_session_id} if self.mcp_session_id else {}),
        }
        response = EventSourceResponse(
            content=sse_reader,
            data_sender_callable=partial(self._run_sse_writer, request_id, sse_writer, answers, event),
            headers=headers,
        )
        try:
            await response(scope, receive, send)
        except Exception:
            log.exception("SSE response error")
            await sse_writer.aclose()
            await self._clean_up_memory_streams(request_id)
        finally:
            self._left(request_id, message.id)
            await sse_reader.aclose()

    def _left(self, stream_id: str, request_id: RequestId) -> None:
        """The connection reading the response `stream_id` has closed. A call still running holds its
        session until it answers (the SDK ends a session idle for its idle timeout, and its calls with it),
        and its event store, told (its `unread(stream_id, cancel)`, if it has one), may cancel it."""
        events = self._event_store
        if not isinstance(events, _Unstreamed) or stream_id not in events.streaming or stream_id in events.held:
            return
        events.held[stream_id] = self._hold()
        if events.kit is not None:
            events.kit.unread(stream_id, partial(self._cancel, request_id))

    def _hold(self) -> Callable[[], None]:
        """Counts as a request in flight, as the SDK counts them, until the release returned is called."""
        scope, idle = self.idle_scope, self._idle_timeout
        if scope is None or idle is None:
            return lambda: None
        self._requests_in_flight += 1
        scope.deadline = math.inf

        def release() -> None:
            self._requests_in_flight -= 1
            if not self._requests_in_flight:
                scope.deadline = anyio.current_time() + idle

        return release

    async def _cancel(self, request_id: RequestId, reason: str) -> None:
        """Cancel a request still running, as its client's `notifications/cancelled` would: the SDK then
        answers it with its "Request cancelled" error, which ends its stream."""
        writer = self._read_stream_writer
        if writer is None:
            return
        params = {"requestId": request_id, "reason": reason}
        cancelled = JSONRPCNotification(jsonrpc="2.0", method="notifications/cancelled", params=params)
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            await writer.send(SessionMessage(cancelled))


def bind_event_store(manager: StreamableHTTPSessionManager, session_id: str, event_store: EventStore) -> None:
    """From now on the transport of `session_id` (the SDK's, opened at initialize) stores what it sends in
    `event_store`, replays from it, and answers as JSON first (`JsonFirstTransport`)."""
    # The transport reads the attribute for each message, so setting it before
    # a message is routed is enough for that message to be stored. Its class only
    # adds a method and `_unstreamed`, so it can change under a live transport.
    transport = manager._server_instances[session_id]
    transport.__class__ = JsonFirstTransport
    cast(JsonFirstTransport, transport)._serve_events(event_store)


async def adopt(
    manager: StreamableHTTPSessionManager,
    session_id: str,
    *,
    client_params: dict[str, Any],
    protocol_version: str,
    event_store: EventStore | None,
    user: object = None,
    on_connected: Callable[[Connection], None] | None = None,
) -> None:
    """Serve `session_id` here from now on, as if this replica had answered its `initialize`.

    `user` is the request's `scope["user"]`: an authenticated one becomes the
    session's owner, as if it had sent the `initialize`. `on_connected` is
    given the session's connection once it serves (to send it notifications).
    """
    params = InitializeRequestParams.model_validate(client_params)
    transport = JsonFirstTransport(
        mcp_session_id=session_id,
        is_json_response_enabled=manager.json_response,
        event_store=event_store,
        security_settings=manager.security_settings,
        retry_interval=manager.retry_interval,
        idle_timeout=manager.session_idle_timeout,
    )

    async def serve(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with transport.connect() as (read_stream, write_stream):
            # Registered only once connected: a request that finds the session
            # held must find a transport that can take it (else the SDK 500s).
            # The owner first, so no request finds the session held but unowned.
            if isinstance(user, AuthenticatedUser):
                manager._session_owners[session_id] = authorization_context(user)
            manager._server_instances[session_id] = transport
            task_status.started()
            dispatcher = JSONRPCDispatcher(read_stream, write_stream, inline_methods=frozenset({"initialize"}))
            connection = Connection.for_loop(dispatcher, session_id=session_id, protocol_version_hint=protocol_version)
            connection.client_params = params
            connection.protocol_version = protocol_version
            connection.initialized.set()
            if on_connected is not None:
                on_connected(connection)
            try:
                with transport.idle_scope or anyio.CancelScope():
                    await serve_connection(
                        manager.app, dispatcher, connection=connection, lifespan_state=manager._lifespan_state
                    )
            finally:
                await manager._discard_session(session_id, transport)

    task_group = manager._task_group
    if task_group is None:
        raise RuntimeError("the session manager is not running: its app's lifespan has not started")
    try:
        await task_group.start(serve)
    except BaseException:
        manager._server_instances.pop(session_id, None)
        manager._session_owners.pop(session_id, None)
        raise


def add_request_handler(mcp: FastMCP, method: str, params_type: type[Any], handler: Any) -> None:
    """`handler` answers `method` on `mcp` (replacing FastMCP's answer, if it had one)."""
    mcp._mcp_server.add_request_handler(method, params_type, handler)


def add_server_middleware(mcp: FastMCP, middleware: Any) -> None:
    """Run `middleware` (an SDK server middleware) around every request `mcp` serves, outermost."""
    mcp._mcp_server.middleware.insert(0, middleware)


def add_outside_request_state_boundary(mcp: FastMCP, middleware: Any) -> None:
    """Run `middleware` (an SDK server middleware) just before the SDK opens a request's sealed state."""
    chain = mcp._mcp_server.middleware
    at = next((i for i, m in enumerate(chain) if isinstance(m, RequestStateBoundary)), None)
    if at is None:
        raise RuntimeError("FastMCP installed no RequestStateBoundary: request state would not be opened")
    chain.insert(at, middleware)


def fastmcp_session_value(state: dict[str, Any]) -> dict[str, Any]:
    """What FastMCP's `Session` reads from its store for a created session holding `state`."""
    return {"value": {fastmcp_sessions._MARKER_KEY: 0.0, fastmcp_sessions._STATE_KEY: state}}


def fastmcp_session_state(value: Any) -> dict[str, Any] | None:
    """The state a value FastMCP's `Session` writes holds; None for a value of another kind."""
    inner = value.get("value") if isinstance(value, dict) else None
    state = inner.get(fastmcp_sessions._STATE_KEY) if isinstance(inner, dict) else None
    return dict(state) if isinstance(state, dict) else None


def docket_of(mcp: FastMCP) -> Any:
    """The Docket the server's tasks extension runs (fastmcp-tasks), while its lifespan runs; else None."""
    return mcp._docket


# Request headers a task's snapshot never keeps: credentials (the worker needs none; the task's scope is its
# principal's claims, kept with the rest of its access token).
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
# A header value longer than this is not kept in a task's snapshot either (MCP's own headers are short).
MAX_SNAPSHOT_HEADER_BYTES = 1024


def scrub_task_snapshots() -> None:
    """fastmcp-tasks keeps each task's context snapshot (`TaskContextSnapshot.capture`) in Redis for the task's
    life: its caller's access token, raw bearer token included, and every request header. From now on, in this
    process, a snapshot keeps the token's claims and client without the token itself, and no credential
    header or header over MAX_SNAPSHOT_HEADER_BYTES. Idempotent."""
    from fastmcp_tasks.context import TaskContextSnapshot

    capture = TaskContextSnapshot.capture
    if getattr(capture, "mcp_ha_scrubbed", False):
        return
    original = capture.__func__  # type: ignore[attr-defined]

    def scrubbed(cls: Any, *args: Any, **kwargs: Any) -> Any:
        snapshot = original(cls, *args, **kwargs)
        token = None
        if snapshot.access_token_json is not None:
            token = json.dumps({**json.loads(snapshot.access_token_json), "token": ""})
        headers = {
            name: value
            for name, value in (snapshot.http_headers or {}).items()
            if name.lower() not in CREDENTIAL_HEADERS and len(value) <= MAX_SNAPSHOT_HEADER_BYTES
        }
        return dataclasses.replace(snapshot, access_token_json=token, http_headers=headers or None)

    scrubbed.mcp_ha_scrubbed = True  # type: ignore[attr-defined]
    TaskContextSnapshot.capture = classmethod(scrubbed)  # type: ignore[method-assign,assignment]


def supervise_worker(
    mcp: FastMCP, supervised: Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]
) -> bool:
    """Wrap what the server's Docket worker runs (`Worker._run`, which `run_forever` calls once its task
    first runs) in `supervised`; False when the server runs no worker. Call it before the lifespan next waits."""
    worker = mcp._worker
    if worker is None:
        return False
    worker._run = supervised(worker._run)
    return True


def set_reported_progress(execution: Any, progress: float) -> None:
    """Tell FastMCP's `report_progress` what a task leg's progress already stands at: it adds to Docket's
    counter only the rise over the last value it reported on that execution (`_fastmcp_last_progress`)."""
    execution._fastmcp_last_progress = int(progress)


class ToolSchemas(Middleware):
    """The tools' wire input schemas, by name, for the SDK's Mcp-Param header check (module docstring): learnt
    when the server starts and from every `tools/list` since, as FastMCP 4.2 keeps them. A tool missing from
    them (one added later and not yet listed) is served unchecked, the SDK's answer when it cannot list."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}

    def install(self, mcp: FastMCP) -> bool:
        """Serve the schemas to `mcp`'s low-level server; False, and nothing done, if it has a lookup already."""
        server = mcp._mcp_server
        if server.get_tool_input_schema is not None:
            return False
        server.get_tool_input_schema = self.schemas.get
        return True

    def learn(self, tools: Sequence[Tool]) -> None:
        # The highest version of each name, as tools/list shows it.
        for tool in dedupe_with_versions(list(tools), lambda t: t.name):
            self.schemas[tool.name] = tool.to_mcp_tool(name=tool.name).input_schema

    async def on_list_tools(
        self, context: MiddlewareContext[Any], call_next: CallNext[Any, Sequence[Tool]]
    ) -> Sequence[Tool]:
        tools = await call_next(context)
        self.learn(tools)
        return tools


class InlineClient(Client[Any]):
    """FastMCP's `Client`, never asking a server to run a call as a task, whatever the process imported:
    FastMCP's internal extensions (fastmcp-tasks' client half) left out, as FastMCP's `ProxyClient` does."""


InlineClient._auto_internal_extensions = False


def mcp_http_client(
    *, headers: dict[str, str] | None = None, timeout: Any = None, auth: Any = None
) -> httpx2.AsyncClient:
    """The HTTP client the SDK's streamable HTTP transport makes for itself (its timeouts, no redirects):
    the HA check drives the SDK's stock client through one it watches."""
    return create_mcp_http_client(headers=headers, timeout=timeout, auth=auth)
