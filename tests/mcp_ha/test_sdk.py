"""LOUD: mcp_ha/_sdk.py reaches into private parts of the MCP SDK. If this fails after an upgrade,
adoption (or resuming streams on any replica) is broken: re-read mcp/server/streamable_http_manager.py
and mcp/server/streamable_http.py, and fix mcp_ha/_sdk.py first."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import inspect
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

import httpx2
import pytest
import uvicorn
from conftest import NOT_THE_LAYER, free_ports
from fastmcp import Context, FastMCP
from fastmcp.server.auth.providers.jwt import StaticTokenVerifier
from fastmcp.server.middleware import Middleware
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.connection import Connection
from mcp.server.lowlevel import NotificationOptions
from mcp.server.runner import serve_connection
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher
from mcp_types import SubscribeRequestParams, SubscriptionsListenRequestParams
from pydantic import Field

from mcp_ha import _sdk as sdk_sessions
from mcp_ha.ops.check.wire import ACCEPT, PROTOCOL, jsonrpc_messages, last_jsonrpc_message
from mcp_ha.session_store import SessionStore
from mcp_ha.settings import Settings
from mcp_ha.stores.memory_store import InMemorySessionStore
from mcp_ha.streams.event_store import SessionEvents

WRITTEN_FOR = "2.3.0"


def session_events(store: SessionStore, session_id: str) -> SessionEvents:
    """A session's event store with the settings' defaults, as a replica makes one."""
    s = Settings()
    return SessionEvents(
        store,
        session_id,
        max_event_bytes=s.max_event_bytes,
        abandoned_seconds=s.abandoned_call_seconds,
        call_ttl_seconds=int(s.event_ttl_seconds),
    )


@pytest.mark.quick
def test_the_sdk_is_the_version_sdk_sessions_was_written_for() -> None:
    installed = importlib.metadata.version("mcp")
    assert installed == WRITTEN_FOR, (
        f"mcp {installed} is installed; mcp_ha/_sdk.py was written against mcp {WRITTEN_FOR}. "
        "Check the private attributes it uses (listed in its docstring), then update WRITTEN_FOR."
    )


LAYER = Path(__file__).resolve().parents[2] / "mcp_ha"
# `something._private` where something is not self/cls: another object's private part.
FOREIGN_PRIVATE = re.compile(r"(?:\b(?!self\b|cls\b)[A-Za-z_][A-Za-z0-9_]*|[\])])\.(_[a-z][a-z0-9_]*)")


def _inherited_private(code: str, base: type, instance: object) -> set[str]:
    """The private names a class of `code` deriving from `base` reaches through `self` that are the SDK's:
    inherited from `base` (class or instance attributes of `instance`), or its methods overridden."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == base.__name__ for b in node.bases):
            used = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            }
            defined = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            found |= {name for name in used | defined if name.startswith("_") and not name.startswith("__")}
    return {name for name in found if hasattr(instance, name)}


@pytest.mark.quick
def test_private_sdk_access_is_fenced_in_one_module_that_lists_it() -> None:
    """Every private name the layer reaches, through another object or inherited through `self`, is in
    _sdk.py's table, and nothing else is; no other module of the layer reaches one."""
    code = (LAYER / "_sdk.py").read_text()
    docstring = code.split('"""')[1]
    body = code.replace(docstring, "")
    transport = StreamableHTTPServerTransport(mcp_session_id=None)
    inherited = _inherited_private(body, StreamableHTTPServerTransport, transport)
    touched = set(FOREIGN_PRIVATE.findall(body)) | inherited
    listed = set(re.findall(r"^\| `(_[a-z_]+)` \|", docstring, flags=re.MULTILINE))
    assert inherited and touched == listed, (touched - listed, listed - touched)
    # Elsewhere, another object's private name is the kit's own when the kit defines it (a module of its
    # own, a function, an attribute it sets); any other is a library's, and belongs in _sdk.py.
    modules = [p for p in LAYER.rglob("*.py") if p.relative_to(LAYER).parts[0] not in NOT_THE_LAYER]
    own = {p.stem for p in modules} | {name for p in modules for name in _defined_private(p.read_text())}
    elsewhere = {
        str(p.relative_to(LAYER)): sorted(_reached_private(p.read_text()) - own) for p in modules if p.name != "_sdk.py"
    }
    assert {name: found for name, found in elsewhere.items() if found} == {}


def _reached_private(code: str) -> set[str]:
    """The private names `code` reaches on something other than `self` or `cls`, or imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Attribute) and not (
            isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {*node.module.split("."), *(alias.name for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {part for alias in node.names for part in alias.name.split(".")}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _defined_private(code: str) -> set[str]:
    """The private names `code` defines: functions, classes, and what it assigns to, by name or attribute."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if name.startswith("_")}


@pytest.mark.quick
def test_the_private_parts_adoption_uses_are_still_there() -> None:
    manager = StreamableHTTPSessionManager(app=FastMCP("probe")._mcp_server)
    for attribute in (
        "_server_instances",
        "_session_owners",
        "_task_group",
        "_lifespan_state",
        "_discard_session",
        "json_response",
        "security_settings",
        "retry_interval",
        "session_idle_timeout",
    ):
        assert hasattr(manager, attribute), f"StreamableHTTPSessionManager.{attribute} is gone"
    assert isinstance(manager._server_instances, dict)
    transport_args = inspect.signature(StreamableHTTPServerTransport).parameters
    for name in (
        "mcp_session_id",
        "is_json_response_enabled",
        "event_store",
        "security_settings",
        "retry_interval",
        "idle_timeout",
    ):
        assert name in transport_args, f"StreamableHTTPServerTransport no longer takes {name}"
    events = session_events(InMemorySessionStore(), uuid.uuid4().hex)
    assert StreamableHTTPServerTransport(mcp_session_id=None, event_store=events)._event_store is events, (
        "StreamableHTTPServerTransport no longer keeps its event store in _event_store (bind_event_store sets it)"
    )
    assert "protocol_version_hint" in inspect.signature(Connection.for_loop).parameters
    assert isinstance(Connection.initialize_accepted, property)
    assert {"connection", "lifespan_state"} <= set(inspect.signature(serve_connection).parameters)
    assert "inline_methods" in inspect.signature(JSONRPCDispatcher).parameters


PROBE_TOKENS = {"alice": "alice-probe-token-0123456789", "bob": "bob-probe-token-0123456789"}


@pytest.fixture(params=["no auth"])
async def probe_server(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, object]]:
    """A minimal FastMCP app served in this process, so the test can call sdk_sessions on it;
    with "static tokens", behind FastMCP's auth (PROBE_TOKENS)."""
    verifier = None
    if request.param == "static tokens":
        verifier = StaticTokenVerifier(
            tokens={token: {"client_id": name, "sub": name, "scopes": []} for name, token in PROBE_TOKENS.items()}
        )
    mcp = FastMCP("probe", auth=verifier)

    @mcp.tool
    async def whoami(ctx: Context) -> dict:
        return {"session_id": ctx.session_id}

    @mcp.tool
    async def chatty(ctx: Context) -> dict:
        await ctx.info("something to stream first")
        return {"session_id": ctx.session_id}

    app = mcp.http_app(path="/mcp", retry_interval=500, session_idle_timeout=600)
    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110  uvicorn sets a flag, not an event, once listening
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/mcp", app
    finally:
        server.should_exit = True
        await task


async def test_a_session_adopted_under_a_foreign_id_is_served_initialized(probe_server) -> None:
    url, app = probe_server
    manager = sdk_sessions.session_manager(app, "/mcp")
    session_id = uuid.uuid4().hex
    assert not sdk_sessions.holds(manager, session_id)
    held_before = sdk_sessions.held_count(manager)

    client_params = {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    store = InMemorySessionStore()
    await sdk_sessions.adopt(
        manager,
        session_id,
        client_params=client_params,
        protocol_version=PROTOCOL,
        event_store=session_events(store, session_id),
    )
    assert sdk_sessions.holds(manager, session_id)
    assert sdk_sessions.held_count(manager) == held_before + 1, "held_count no longer counts the SDK's transports"

    headers = {
        "Content-Type": "application/json",
        "Accept": ACCEPT,
        "MCP-Protocol-Version": PROTOCOL,
        "mcp-session-id": session_id,
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "chatty", "arguments": {}}}
    async with httpx2.AsyncClient(timeout=10) as http:
        response = await http.post(url, headers=headers, json=body)
        # No initialize was sent on this replica, yet the call is served, under the same id.
        assert response.status_code == 200, response.text
        assert last_jsonrpc_message(response)["result"]["structuredContent"] == {"session_id": session_id}
        # ...and what it streamed is in the session's event log.
        assert await stored_after_first(store, session_id, response) == ("1", jsonrpc_messages(response)[1:])

        # Ending it (DELETE) makes the SDK forget it, as for a session it created itself.
        assert (await http.delete(url, headers=headers)).status_code == 200
        assert not sdk_sessions.holds(manager, session_id)
        assert sdk_sessions.held_count(manager) == held_before
        assert (await http.post(url, headers=headers, json=body)).status_code == 404


@pytest.mark.parametrize("probe_server", ["static tokens"], indirect=True)
async def test_a_session_adopted_for_a_principal_is_served_to_it_and_to_nobody_else(probe_server) -> None:
    """adopt(user=...) sets the SDK's private `_session_owners`, which its own sessions get at initialize."""
    url, app = probe_server
    manager = sdk_sessions.session_manager(app, "/mcp")
    assert manager is not None, "session_manager no longer finds the manager behind FastMCP's RequireAuthMiddleware"
    session_id = uuid.uuid4().hex
    verifier = StaticTokenVerifier(tokens={PROBE_TOKENS["alice"]: {"client_id": "alice", "sub": "alice", "scopes": []}})
    alice = AuthenticatedUser(await verifier.verify_token(PROBE_TOKENS["alice"]))
    client_params = {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    await sdk_sessions.adopt(
        manager, session_id, client_params=client_params, protocol_version=PROTOCOL, event_store=None, user=alice
    )

    headers = {
        "Content-Type": "application/json",
        "Accept": ACCEPT,
        "MCP-Protocol-Version": PROTOCOL,
        "mcp-session-id": session_id,
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "whoami", "arguments": {}}}
    async with httpx2.AsyncClient(timeout=10) as http:
        as_alice = await http.post(
            url, headers={**headers, "Authorization": f"Bearer {PROBE_TOKENS['alice']}"}, json=body
        )
        assert as_alice.status_code == 200, "the adopted session is not bound to its principal in the SDK"
        as_bob = await http.post(url, headers={**headers, "Authorization": f"Bearer {PROBE_TOKENS['bob']}"}, json=body)
        assert as_bob.status_code == 404, "the SDK no longer refuses a session to another principal"
    # refuses() predicts that answer, so the kit can do an unknown id's store work first.
    bob = AuthenticatedUser(
        await StaticTokenVerifier(
            tokens={PROBE_TOKENS["bob"]: {"client_id": "bob", "sub": "bob", "scopes": []}}
        ).verify_token(PROBE_TOKENS["bob"])
    )
    assert sdk_sessions.refuses(manager, session_id, bob) and not sdk_sessions.refuses(manager, session_id, alice)
    assert sdk_sessions.refuses(manager, session_id, None), "an unauthenticated request would be served"
    async with httpx2.AsyncClient(timeout=10) as http:
        delete = await http.delete(url, headers={**headers, "Authorization": f"Bearer {PROBE_TOKENS['alice']}"})
        assert delete.status_code == 200
    assert session_id not in manager._session_owners, "the SDK no longer forgets an ended session's owner"


async def test_an_idle_transport_is_told_from_a_busy_one_and_ended_as_its_idle_timeout_would(probe_server) -> None:
    """idle() reads the SDK's idle countdown (its public idle_scope), forget() cancels it as the timeout would."""
    url, app = probe_server
    manager = sdk_sessions.session_manager(app, "/mcp")
    headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": PROTOCOL}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }

    async def until(condition: Callable[[], bool], what: str) -> None:
        for _ in range(100):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(what)

    async with httpx2.AsyncClient(timeout=10) as http:
        session_id = (await http.post(url, headers=headers, json=initialize)).headers["mcp-session-id"]
        headers["mcp-session-id"] = session_id
        await until(lambda: sdk_sessions.idle(manager, session_id), "a session with nothing in flight is not idle")
        async with http.stream("GET", url, headers={**headers, "Accept": "text/event-stream"}) as listening:
            assert listening.status_code == 200
            await until(lambda: not sdk_sessions.idle(manager, session_id), "an open GET stream leaves it idle")
        await until(lambda: sdk_sessions.idle(manager, session_id), "idle again once the stream closed")
        sdk_sessions.forget(manager, session_id)
        await until(lambda: not sdk_sessions.holds(manager, session_id), "forget() did not end the transport")
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "whoami", "arguments": {}}}
        assert (await http.post(url, headers=headers, json=call)).status_code == 404


@pytest.mark.quick
def test_a_server_middleware_added_sees_every_request_with_its_asgi_scope() -> None:
    """add_server_middleware puts limits.CallsRunning on FastMCP's private low-level server, outermost; it finds
    what an ASGI middleware left in the request's scope (the Call it holds) on the SDK's context."""
    mcp = FastMCP("probe")

    @mcp.tool
    async def whoami(ctx: Context) -> dict:
        return {"session_id": ctx.session_id}

    seen: list[tuple[str, object]] = []

    async def middleware(ctx: Any, call_next: Any) -> Any:
        seen.append((ctx.method, getattr(ctx.request, "scope", {}).get("mcp_ha.probe")))
        return await call_next(ctx)

    sdk_sessions.add_server_middleware(mcp, middleware)
    assert mcp._mcp_server.middleware[0] is middleware
    app = mcp.http_app(path="/mcp", stateless_http=True)

    async def marking(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope["mcp_ha.probe"] = "mark"
        await app(scope, receive, send)

    async def scenario() -> None:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "whoami", "arguments": {}}}
        headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": "2026-07-28"}
        meta = {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        body["params"]["_meta"] = meta  # type: ignore[index]
        headers |= {"Mcp-Method": "tools/call", "Mcp-Name": "whoami"}
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=marking)
            async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
                response = await http.post("/mcp", headers=headers, json=body)
                assert response.status_code == 200, response.text

    asyncio.run(scenario())
    assert ("tools/call", "mark") in seen, seen


async def stored_after_first(store: InMemorySessionStore, session_id: str, response: httpx2.Response) -> tuple:
    """The stream and messages the store holds after the first event (the first id) of an SSE response."""
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers
    ids = [line[3:].strip() for line in response.text.splitlines() if line.startswith("id:")]
    assert ids, "no event id on the wire: the transport did not use the event store it was given"
    found = await store.events_after(session_id, ids[0])
    assert found is not None, "the SSE ids are not the event store's: the SDK no longer stores through it"
    stream_id, events = found
    return stream_id, [json.loads(message) for _, message in events]


async def session_bound_to(
    store: InMemorySessionStore, http: httpx2.AsyncClient, url: str, app: object
) -> tuple[str, dict[str, str]]:
    """A session opened on the probe server, its transport bound to an event store over `store`
    (bind_event_store); its id, and the headers a request on it carries."""
    headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": PROTOCOL}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    session_id = (await http.post(url, headers=headers, json=initialize)).headers["mcp-session-id"]
    manager = sdk_sessions.session_manager(app, "/mcp")
    sdk_sessions.bind_event_store(manager, session_id, session_events(store, session_id))
    return session_id, {**headers, "mcp-session-id": session_id}


async def test_an_event_store_bound_to_a_live_session_keeps_its_events_and_replays_them(probe_server) -> None:
    """bind_event_store sets the transport's private `_event_store` after the SDK created it."""
    url, app = probe_server
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "chatty", "arguments": {}}}
    async with httpx2.AsyncClient(timeout=10) as http:
        store = InMemorySessionStore()
        session_id, headers = await session_bound_to(store, http, url, app)

        response = await http.post(url, headers=headers, json=call)
        assert response.status_code == 200, response.text
        assert await stored_after_first(store, session_id, response) == ("2", jsonrpc_messages(response)[1:])

        # A GET with Last-Event-ID replays from the bound store, to the call's answer.
        first = next(line[3:].strip() for line in response.text.splitlines() if line.startswith("id:"))
        replay = await http.get(url, headers={**headers, "Last-Event-ID": first})
        assert replay.status_code == 200, replay.text
        assert jsonrpc_messages(replay) == jsonrpc_messages(response)[1:]


async def test_a_call_with_nothing_to_stream_is_answered_as_json_and_stores_nothing(probe_server) -> None:
    """bind_event_store makes the SDK's transport a JsonFirstTransport (its private _handle_post_request)."""
    url, app = probe_server
    async with httpx2.AsyncClient(timeout=10) as http:
        store = InMemorySessionStore()
        added: list[tuple] = []
        add_event = store.add_event

        async def counting(*args: object) -> str:
            added.append(args)
            return await add_event(*args)

        store.add_event = counting  # type: ignore[method-assign]
        session_id, headers = await session_bound_to(store, http, url, app)
        quiet = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "whoami", "arguments": {}}}
        response = await http.post(url, headers=headers, json=quiet)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/json", response.headers
        assert response.headers["mcp-session-id"] == session_id
        assert response.json()["result"]["structuredContent"] == {"session_id": session_id}
        assert added == [], "an answer sent as JSON was stored: nothing can resume it"

        # The first notification turns the answer into SSE, with the retry field, and that one is stored.
        loud = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "chatty", "arguments": {}}}
        response = await http.post(url, headers=headers, json=loud)
        assert response.headers["content-type"].startswith("text/event-stream"), response.headers
        messages = jsonrpc_messages(response)
        assert [m.get("method") for m in messages] == ["notifications/message", None]
        assert messages[-1]["result"]["structuredContent"] == {"session_id": session_id}
        assert "retry:" in response.text, "the SSE retry field is missing"
        assert (await stored_after_first(store, session_id, response))[0] == "3"


@pytest.mark.quick
def test_request_handlers_added_to_fastmcp_answer_and_show_in_its_capabilities() -> None:
    """add_request_handler puts subscriptions.py's handlers on FastMCP's private low-level server."""
    mcp = FastMCP("probe")

    async def handler(ctx: object, params: object) -> None:
        raise AssertionError("not called here")

    sdk_sessions.add_request_handler(mcp, "subscriptions/listen", SubscriptionsListenRequestParams, handler)
    sdk_sessions.add_request_handler(mcp, "resources/subscribe", SubscribeRequestParams, handler)
    low_level = mcp._mcp_server
    assert low_level._request_handlers["subscriptions/listen"].handler is handler
    modern = low_level.get_capabilities(NotificationOptions(), protocol_version="2026-07-28")
    legacy = low_level.get_capabilities(NotificationOptions(), protocol_version="2025-11-25")
    assert modern.resources is not None and modern.resources.subscribe is True
    assert legacy.resources is not None and legacy.resources.subscribe is True


@pytest.mark.quick
def test_fastmcp_sessions_are_stored_in_the_layout_sdk_reads_and_writes() -> None:
    """FastMCP's Session keeps a created session as one value of its own layout (_MARKER_KEY, _STATE_KEY)."""
    from fastmcp.server.sessions import Session as FastMCPSession
    from key_value.aio.stores.memory import MemoryStore

    async def scenario() -> None:
        raw_store = MemoryStore()
        state_store = FastMCP("probe", session_state_store=raw_store)._state_store
        session = FastMCPSession(store=state_store, principal=None, session_id="s", public_id="s")
        await session._create()
        await session.set("facts", ["a"])
        written = await raw_store.get("session:anon:s", collection="fastmcp_state")
        assert sdk_sessions.fastmcp_session_state(written) == {"facts": ["a"]}
        await raw_store.put("session:anon:t", sdk_sessions.fastmcp_session_value({"n": 1}), collection="fastmcp_state")
        other = FastMCPSession(store=state_store, principal=None, session_id="t", public_id="t")
        assert await other._exists() and await other.get("n") == 1

    asyncio.run(scenario())


@pytest.mark.quick
async def test_the_docket_tasks_run_on_is_where_the_layer_reaches_it() -> None:
    """LOUD: durable tasks (mcp_ha/tasks.py) reach the Docket FastMCP's tasks extension runs through
    `_sdk.docket_of` (FastMCP's private `_docket`): they set how long a finished task is kept on it
    (`execution_ttl`) and wrap the task functions registered there (`tasks`, `register`) before its worker
    runs one. If this fails after a fastmcp, fastmcp-tasks or pydocket upgrade, tasks run unfenced and
    unkeyed: re-read fastmcp_tasks/lifespan.py and docket/docket.py, and fix mcp_ha/tasks.py first."""
    pytest.importorskip("fastmcp_tasks", reason="durable tasks need the kit's tasks extra")
    import fastmcp_tasks
    from fastmcp import Client

    from mcp_ha.replica import HighAvailability
    from mcp_ha.settings import Settings
    from mcp_ha.tasks import FENCED

    ha = HighAvailability(Settings(metrics=False, task_ttl_seconds=77))
    mcp = ha.server("probe")

    @mcp.tool(task=True)
    async def probe() -> str:
        return "probed"

    assert sdk_sessions.docket_of(mcp) is None  # the attribute exists, empty until the lifespan runs
    assert fastmcp_tasks.__version__
    async with Client(mcp) as client:
        docket = sdk_sessions.docket_of(mcp)
        assert docket is not None and docket.execution_ttl.total_seconds() == 77
        (tool,) = [t for t in await mcp.get_tasks() if t.name == "probe"]
        assert getattr(docket.tasks[tool.key], FENCED, False)  # the layer's wrapper is what the worker runs
        assert (await client.call_tool("probe", {})).data == "probed"
    assert sdk_sessions.docket_of(mcp) is None


@pytest.mark.quick
def test_task_progress_is_where_the_layer_reads_it() -> None:
    """LOUD: a run that takes a task over tells FastMCP's `report_progress` where the task's progress
    stands (its private `_fastmcp_last_progress` on the Docket execution). If this fails after an upgrade,
    progress jumps or resets on takeover: fix `_sdk.set_reported_progress` first."""
    pytest.importorskip("fastmcp_tasks", reason="durable tasks need the kit's tasks extra")
    from fastmcp.server.context import Context

    assert "_fastmcp_last_progress" in inspect.getsource(Context.report_progress)


@pytest.mark.quick
def test_a_task_snapshot_is_captured_without_credentials() -> None:
    """LOUD: fastmcp-tasks keeps a task's context snapshot (`TaskContextSnapshot.capture`: its caller's access
    token and request headers) in Redis for the task's life; `_sdk.scrub_task_snapshots` wraps `capture` so it
    keeps neither the raw token nor a credential header. If this fails after an upgrade, bearer tokens land in
    Redis (and its AOF) again: fix `_sdk.scrub_task_snapshots` first."""
    pytest.importorskip("fastmcp_tasks", reason="durable tasks need the kit's tasks extra")
    import dataclasses

    from fastmcp_tasks.context import TaskContextSnapshot
    from fastmcp_tasks.creation import create_task

    assert {"access_token_json", "http_headers"} <= {f.name for f in dataclasses.fields(TaskContextSnapshot)}
    assert "TaskContextSnapshot.capture(" in inspect.getsource(create_task)
    sdk_sessions.scrub_task_snapshots()
    sdk_sessions.scrub_task_snapshots()  # idempotent: one wrapper
    assert getattr(TaskContextSnapshot.capture, "mcp_ha_scrubbed", False)
    assert "original(cls" in inspect.getsource(TaskContextSnapshot.capture)


@pytest.mark.quick
def test_an_inline_client_never_asks_for_tasks() -> None:
    """LOUD: the HA check's sessionless kind is FastMCP's Client without its tasks extension, whatever the
    process imported (`_sdk.InlineClient`, through FastMCP's private `_auto_internal_extensions`). If this
    fails after an upgrade, that kind runs task tools as tasks: fix `_sdk.InlineClient` first."""
    pytest.importorskip("fastmcp_tasks", reason="the tasks extension is what an inline client leaves out")
    import fastmcp_tasks  # noqa: F401  FastMCP's Client asks for tasks once this is imported
    from fastmcp import Client
    from fastmcp.utilities.tasks import TASKS_EXTENSION_ID

    def extensions(client: Client) -> set[str]:
        capabilities = client._build_extension_kwargs().get("extensions") or {}
        return set(capabilities)

    assert TASKS_EXTENSION_ID in extensions(Client("http://127.0.0.1:9/mcp"))
    assert TASKS_EXTENSION_ID not in extensions(sdk_sessions.InlineClient("http://127.0.0.1:9/mcp"))


@pytest.mark.quick
def test_tool_schemas_check_mcp_param_headers_without_listing_tools_per_call() -> None:
    """ToolSchemas serves the SDK's `get_tool_input_schema` on FastMCP's private low-level server: a 2026-07-28
    call with arguments is checked against its tool's Mcp-Param header (a mismatch is a 400), with no `tools/list`
    run for it; a tool added later is learnt from the next listing; a server with a lookup of its own keeps it."""
    mcp = FastMCP("probe")

    @mcp.tool
    async def route(region: Annotated[str, Field(json_schema_extra={"x-mcp-header": "Region"})]) -> str:
        return region

    listed: list[int] = []

    class CountLists(Middleware):
        async def on_list_tools(self, context: Any, call_next: Any) -> Any:
            listed.append(1)
            return await call_next(context)

    mcp.add_middleware(CountLists())
    # FastMCP 4.2 serves the SDK its own (make test-newest): ToolSchemas then stands aside, and the same holds.
    fastmcp_serves_schemas = mcp._mcp_server.get_tool_input_schema is not None
    schemas = sdk_sessions.ToolSchemas()
    assert schemas.install(mcp) is not fastmcp_serves_schemas
    if not fastmcp_serves_schemas:
        mcp.add_middleware(schemas)
    app = mcp.http_app(path="/mcp", stateless_http=True)
    meta = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }

    async def call(http: httpx2.AsyncClient, tool: str, region: str, header: str) -> httpx2.Response:
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": tool, "arguments": {"region": region}, "_meta": meta},
        }
        headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": "2026-07-28"}
        headers |= {"Mcp-Method": "tools/call", "Mcp-Name": tool, "Mcp-Param-Region": header}
        return await http.post("/mcp", headers=headers, json=body)

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            if not fastmcp_serves_schemas:
                schemas.learn(await mcp.list_tools(run_middleware=False))
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
                for _ in range(3):
                    agreed = await call(http, "route", "eu", "eu")
                    assert agreed.status_code == 200 and '"eu"' in agreed.text, agreed.text
                refused = await call(http, "route", "eu", "us")
                assert refused.status_code == 400, refused.text
                assert listed == [], "a tools/list ran for a tools/call"

                @mcp.tool
                async def later(region: Annotated[str, Field(json_schema_extra={"x-mcp-header": "Region"})]) -> str:
                    return region

                await mcp.list_tools()
                assert (await call(http, "later", "eu", "us")).status_code == 400

    asyncio.run(scenario())
    own = FastMCP("own")
    own._mcp_server.get_tool_input_schema = lookup = {}.get
    assert not sdk_sessions.ToolSchemas().install(own)
    assert own._mcp_server.get_tool_input_schema is lookup
