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

Resumable streams (`streams.py`) need one more: an event store per
session. The SDK takes one store for all transports (FastMCP's wraps it with
a random prefix per transport, which no other replica can know), so the
session's own store is set on its transport (`_event_store`) instead: at
`initialize`, before the answer is sent, and when a session is adopted.

Subscriptions (`subscriptions.py`) need the server to answer
`subscriptions/listen`, `resources/subscribe` and `resources/unsubscribe`.
FastMCP registers none of them and has no public way to add a request
handler, so they go on its low-level server (`_mcp_server`), whose
`add_request_handler` is public; that also makes the capabilities say so.
Refusing a replayed request state (`request_state.py`) needs a middleware
of the same server's, just outside the SDK's `RequestStateBoundary`, which
is where the sealed state is still on the request.

FastMCP's `get_session` reads a session from its `session_state_store` as
one value whose layout is FastMCP's own (`handles.FastMCPSessions` serves it
from the kit's store): a creation mark and the state under
`fastmcp.server.sessions._MARKER_KEY` and `._STATE_KEY`.

Every private attribute touched here, and nowhere else in the kit:

| attribute | of | why |
|---|---|---|
| `_server_instances` | the session manager | which sessions this replica holds; registering an adopted one |
| `_session_owners` | the session manager | the principal an adopted session is bound to |
| `_discard_session` | the session manager | forgetting an adopted session when it ends |
| `_task_group` | the session manager | running an adopted session's connection beside the SDK's own |
| `_lifespan_state` | the session manager | the server's lifespan state, for that connection |
| `_event_store` | a transport | the session's own event store |
| `_MARKER_KEY` | `fastmcp.server.sessions` | the creation mark in a FastMCP session's stored value |
| `_STATE_KEY` | `fastmcp.server.sessions` | where that value holds the session's state |
| `_mcp_server` | a FastMCP server | its low-level server, to add request handlers and a middleware to |

`tests/mcp_ha/test_sdk.py` checks each of these against the installed SDK;
if an upgrade moves them, that test fails first and says which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import fastmcp.server.sessions as fastmcp_sessions
from anyio.abc import TaskStatus
from fastmcp import FastMCP
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, authorization_context
from mcp.server.connection import Connection
from mcp.server.request_state import RequestStateBoundary
from mcp.server.runner import serve_connection
from mcp.server.streamable_http import EventStore, StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher
from mcp_types import InitializeRequestParams
from starlette.applications import Starlette
from starlette.routing import Route


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


def bind_event_store(manager: StreamableHTTPSessionManager, session_id: str, event_store: EventStore) -> None:
    """From now on the transport of `session_id` stores what it sends in `event_store`, and replays from it."""
    # The transport reads the attribute for each message, so setting it before
    # a message is routed is enough for that message to be stored.
    manager._server_instances[session_id]._event_store = event_store


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
    transport = StreamableHTTPServerTransport(
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
