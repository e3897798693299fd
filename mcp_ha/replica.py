"""The one entry point: `HighAvailability` puts every pattern of the layer around a FastMCP server.

    ha = HighAvailability.from_env()
    mcp = ha.server("cart")

    @mcp.tool
    async def add_item(sku: str, ctx: Context, session_id: SessionHandle = None) -> dict:
        session = await ha.session(ctx, session_id)
        return {"qty": await session.incr(f"cart:{sku}")}

    app = ha.http_app(mcp)
    if __name__ == "__main__":
        ha.run(app)

What each step owns:

- `HighAvailability(settings)`: the store the settings name (Redis, with
  Sentinel or not, else in memory), metered when metrics are on; the
  sessions this replica owns (`adoption.Ownership`); the drain; the token
  verifier when authentication is on. Nothing connects until the app runs.
- `server(name)`: a FastMCP server with that verifier, and error details
  masked (a client sees "Error calling tool", never internals); with the
  `tasks` extra installed, FastMCP's tasks extension on the kit's store, so
  `@mcp.tool(task=True)` tools run as durable tasks (`tasks.py`).
- `session(ctx, handle)`: the caller's state, always fenced by this replica's
  epoch and keyed by the call's idempotency key. The only way a tool gets one.
- `http_app(mcp)`: the FastMCP middlewares in their order (metrics outermost,
  so it sees what the client gets; store errors; idempotency keys; session
  records innermost), `create_session` and `end_session` for sessionless clients, `/health`,
  `/metrics`, the log filters, and the ASGI layers around the MCP endpoint,
  outermost first: request ids, drain, the body and structure bounds, (inside
  the auth layer) calls in flight, session limits, stream resumption, adoption. Its
  lifespan makes SIGTERM drain and closes the store. Mount it in any ASGI
  server and every guarantee comes with it.
- `run(app)`: uvicorn with structured logs, on the settings' host and port.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import fastmcp
import uvicorn
from fastmcp import Context, FastMCP
from fastmcp.server.auth import TokenVerifier
from fastmcp.server.sessions import SessionId
from mcp.server.subscriptions import ServerEvent
from mcp_types import SubscribeRequestParams, SubscriptionsListenRequestParams, UnsubscribeRequestParams
from starlette.middleware import Middleware as StarletteMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _sdk, elicitation
from .adoption import AdoptSessions, Ownership, RecordSessions, Transports
from .drain import Drain, drain_on_sigterm
from .elicitation import Answer, AskForInput
from .errors import ANSWERED, StoreErrors
from .fastmcp_store import FastMCPSessions
from .handles import create_handle, end_handle, session_id_for
from .health import StoreHealth, health_endpoint
from .idempotency import IdempotentCalls, current_call
from .limits import BodyLimit, CallsInFlight, CallsRunning, InFlight, SessionLimits
from .logs import Expected, RequestIds, configure
from .principals import owner
from .request_state import NoteSealedState, RefuseReplays, request_state_security
from .session_store import Session, SessionStore, StoreLimits, is_session_id
from .settings import Settings, SettingsError
from .streams.cut import CutCalls
from .streams.event_store import SessionEvents
from .streams.feed import EventFeed
from .streams.lease import Runs
from .streams.reruns import Reruns
from .streams.resumption import CheckResumption
from .subscriptions import StoreBus, Subscriptions

log = logging.getLogger(__name__)


def make_store(settings: Settings, *, on_replay: Callable[[Any], None] | None = None) -> SessionStore:
    """The store the settings name: Redis when REDIS_URL, REDIS_SENTINELS or REDIS_CLUSTER_NODES is set, in
    memory otherwise."""
    limits: StoreLimits = {
        "ttl_seconds": settings.session_ttl_seconds,
        "event_ttl_seconds": settings.event_ttl_seconds,
        "op_ttl_seconds": settings.op_ttl_seconds,
        "max_log_bytes": settings.max_log_bytes,
        "max_state_bytes": settings.max_state_bytes,
        "max_sessions": settings.max_sessions,
        "max_sessions_per_holder": settings.max_sessions_per_client,
        "max_bytes_per_holder": settings.max_bytes_per_client,
        "on_replay": on_replay,
    }
    if settings.uses_redis:
        from .stores.redis_store import RedisSessionStore

        return RedisSessionStore(
            None if settings.redis_sentinels or settings.redis_cluster_nodes else settings.redis_url,
            sentinels=settings.redis_sentinels,
            cluster_nodes=settings.redis_cluster_nodes,
            master_name=settings.redis_master_name,
            wait_replicas=settings.redis_wait_replicas,
            retry_seconds=settings.redis_retry_seconds,
            username=settings.redis_username,
            password=settings.redis_password,
            sentinel_username=settings.redis_sentinel_username,
            sentinel_password=settings.redis_sentinel_password,
            **limits,
        )
    from .stores.memory_store import InMemorySessionStore

    return InMemorySessionStore(**limits)


def tasks_installed() -> bool:
    """Whether fastmcp-tasks (the kit's `tasks` extra) is installed: `ha.server()` then serves durable tasks."""
    return importlib.util.find_spec("fastmcp_tasks") is not None


# Every HTTP answer of a replica names it, so the HA check (mcp_ha.check) sees which replica serves a
# session without any of the server's own tools reporting it. HAProxy passes it through; the name is
# INSTANCE_ID, which /health already answers to anyone.
REPLICA_HEADER = b"mcp-ha-replica"


class NameReplica:
    """ASGI middleware: the `Mcp-Ha-Replica: <INSTANCE_ID>` header on every HTTP answer."""

    def __init__(self, app: ASGIApp, instance: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER, instance.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


class HighAvailability:
    """Everything a replica needs to serve any session, from one object."""

    def __init__(self, settings: Settings | None = None, *, store: SessionStore | None = None) -> None:
        """`store`: one of your own (it then takes no settings from here); else the settings' own."""
        self.settings = settings = settings or Settings()
        self._metrics: Any = None
        if settings.metrics:
            from . import metrics

            self._metrics = metrics
        on_replay = self._metrics.count_replay if self._metrics else None
        store = store if store is not None else make_store(settings, on_replay=on_replay)
        self.store: SessionStore = self._metrics.metered(store) if self._metrics else store
        self.ownership = Ownership()
        self.drain = Drain()
        self.bus = StoreBus(self.store)
        # This replica's lease: a call it streams is run again elsewhere once the lease lapses (streams/lease.py).
        # Unmetered: renewing it twice a second is the replica's own work, not any request's.
        self.runs = Runs(store, settings.instance_id)
        self.auth: TokenVerifier | None = None
        if settings.auth != "none":
            from .auth import make_verifier

            self.auth = make_verifier(settings)
        self._servers: weakref.WeakSet[FastMCP] = weakref.WeakSet()

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, store: SessionStore | None = None
    ) -> HighAvailability:
        """From the environment's settings, for a server's start-up.

        A setting that cannot work stops the process with a message naming its
        variable, not a traceback (`Settings.from_env` raises SettingsError instead).
        """
        try:
            return cls(Settings.from_env() if environ is None else Settings.from_env(environ), store=store)
        except SettingsError as exc:
            raise SystemExit(str(exc)) from None

    @property
    def instance(self) -> str:
        """This replica's name (INSTANCE_ID)."""
        return self.settings.instance_id

    def server(self, name: str, **options: Any) -> FastMCP:
        """A FastMCP server for `http_app`: this replica's auth, error details masked, and 2026-07-28
        request state sealed so that any replica opens it (`request_state.py`). `options` go to FastMCP.

        FastMCP's OpenTelemetry spans are off unless FASTMCP_TELEMETRY_MODE says otherwise: with no
        exporter they go nowhere, and they cost ~8% of a replica's CPU per call (issue 16's profile)."""
        if self.settings.fastmcp_telemetry_mode is None:
            fastmcp.settings.telemetry_mode = "off"
        mcp = FastMCP(
            name,
            auth=self.auth,
            mask_error_details=True,
            request_state_security=request_state_security(self.settings, audience=name),
            # FastMCP's get_session(session_id) then serves the kit's handles (handles.py); a store of
            # your own keeps everything else FastMCP puts there.
            session_state_store=FastMCPSessions(self.store, others=options.pop("session_state_store", None)),
            **options,
        )
        if tasks_installed():
            # `@mcp.tool(task=True)` tools run as durable tasks on the kit's store (tasks.py).
            from .tasks import HATasks

            mcp.add_extension(HATasks(self.settings, self.store, self.runs))
        self._servers.add(mcp)
        return mcp

    async def session(self, ctx: Context, handle: str | None = None) -> Session:
        """The caller's state: its handle's (sessionless clients), else its MCP session's; fenced and keyed.

        A tool error that says what to do when the call has neither (`handles.py`).
        """
        sid = await session_id_for(ctx, handle, self.store)
        return Session(self.store, sid, epoch=self.ownership.epoch(sid), call=current_call.get(), owner=owner())

    async def elicit(
        self, ctx: Context, message: str, response_type: Any, *, name: str = "answer", answer_within: float = 120.0
    ) -> Answer:
        """Ask the user `message` and get their answer, whoever the client (`elicitation.py`):

            answer = await ha.elicit(ctx, "Delete every job?", bool, name="confirm")

        `response_type` as `ctx.elicit` takes it; `name` tells apart the questions of one tool. A
        session-era client has `answer_within` seconds to answer, and a re-run of its call gets the recorded
        answer without asking again; a 2026-07-28 client brings its answers with each leg.
        """
        return await elicitation.elicit(
            ctx, lambda c: self.session(c), message, response_type, name=name, answer_within=answer_within
        )

    async def publish(self, event: ServerEvent) -> None:
        """Tell every listener, on every replica, of `event` (e.g. `ToolsListChanged()`).

        A session's own changes need no call: every write announces them (`subscriptions.py`).
        """
        await self.bus.publish(event)

    async def state_of(self, session_id: str) -> dict[str, Any]:
        """A session's state to read, by id (a resource's): empty for an id nobody minted or another principal's."""
        if not is_session_id(session_id) or await self.store.owner(session_id) != owner():
            return {}
        return await self.store.items(session_id)

    def http_app(self, mcp: FastMCP, *, path: str = "/mcp", **options: Any) -> ASGIApp:
        """The ASGI app serving `mcp` at `path` with every guarantee. `options` go to FastMCP's http_app."""
        if mcp not in self._servers:
            raise ValueError("serve a FastMCP made by HighAvailability.server(): it carries the auth and error masking")
        metrics = self._metrics
        if metrics is not None:
            mcp.add_middleware(metrics.ToolMetrics())
        mcp.add_middleware(StoreErrors(on_fenced=self.ownership.lost))
        mcp.add_middleware(IdempotentCalls())
        mcp.add_middleware(AskForInput())
        mcp.add_middleware(RefuseReplays(self.store, ttl_seconds=self.settings.request_state_ttl_seconds))
        _sdk.add_outside_request_state_boundary(mcp, NoteSealedState())
        feed = EventFeed(self.store)
        reruns = Reruns()
        in_flight = InFlight(
            max_per_session=self.settings.max_calls_per_session, max_per_client=self.settings.max_calls_per_client
        )
        _sdk.add_server_middleware(mcp, CallsRunning())
        transports = Transports(self.settings.max_transports_per_client)
        events = functools.partial(
            SessionEvents,
            self.store,
            max_event_bytes=self.settings.max_event_bytes,
            feed=feed,
            on_answer=in_flight.release,
            runs=self.runs,
            reruns=reruns,
            call_ttl_seconds=int(self.settings.event_ttl_seconds),
            abandoned_seconds=self.settings.abandoned_call_seconds,
        )
        mcp.add_middleware(RecordSessions(self.store, self.ownership, path=path, events=events, transports=transports))

        @mcp.tool(name="create_session")
        async def create_session() -> dict[str, Any]:
            """Start a session for a sessionless (2026-07-28) client: pass the session_id it
            returns to the stateful tools. Session-era clients already have one."""
            return {"session_id": await create_handle(self.store), "instance": self.instance}

        @mcp.tool(name="end_session")
        async def end_session(session_id: SessionId) -> dict[str, Any]:
            """End a sessionless (2026-07-28) client's session: its handle no longer works, on any replica."""
            await end_handle(session_id, self.store)
            return {"ended": True, "instance": self.instance}

        async def resource_matches(uri: str) -> bool:
            resources = await mcp.list_resources(run_middleware=False)
            templates = await mcp.list_resource_templates(run_middleware=False)
            return any(str(r.uri) == uri for r in resources) or any(t.matches(uri) is not None for t in templates)

        def holds(session_id: str) -> bool:
            manager = _sdk.session_manager(app, path)
            return manager is not None and _sdk.holds(manager, session_id)

        subscriptions = Subscriptions(
            self.bus,
            max_streams=self.settings.max_listen_streams,
            max_per_client=self.settings.max_listens_per_client,
            resource_matches=resource_matches,
            holds=holds,
        )
        _sdk.add_request_handler(mcp, "subscriptions/listen", SubscriptionsListenRequestParams, subscriptions.listen)
        _sdk.add_request_handler(mcp, "resources/subscribe", SubscribeRequestParams, subscriptions.subscribe)
        _sdk.add_request_handler(mcp, "resources/unsubscribe", UnsubscribeRequestParams, subscriptions.unsubscribe)
        # Listen streams never end on their own: a drain ends them, and their clients listen elsewhere.
        self.drain.on_drain = subscriptions.close

        health = StoreHealth(
            self.store, self.drain, grace_seconds=self.settings.redis_retry_seconds if self.settings.uses_redis else 0.0
        )
        mcp.custom_route("/health", methods=["GET"])(health_endpoint(self.instance, self.drain, health))
        if metrics is not None:
            mcp.custom_route("/metrics", methods=["GET"])(metrics.endpoint)
        # A store's refusal is answered (errors.py): its traceback would bury real bugs.
        logging.getLogger("fastmcp.server.server").addFilter(Expected(*ANSWERED))

        app = mcp.http_app(
            path=path,
            middleware=[
                # First inside the auth layer: a client is its principal.
                StarletteMiddleware(CallsInFlight, in_flight=in_flight, path=path),
                StarletteMiddleware(
                    SessionLimits,
                    store=self.store,
                    max_record_bytes=self.settings.max_record_bytes,
                    max_sessions=self.settings.max_sessions,
                    max_sessions_per_client=self.settings.max_sessions_per_client,
                    path=path,
                ),
                # Outermost first: a bad Last-Event-ID is answered before any replica
                # takes the session up just to serve it.
                StarletteMiddleware(
                    CheckResumption,
                    store=self.store,
                    reruns=reruns,
                    path=path,
                    on_resume=metrics.STREAMS_RESUMED.inc if metrics else None,
                    max_per_session=self.settings.max_replays_per_session,
                    max_replays=self.settings.max_replays,
                ),
                # A sessionless call's stream names its request, so a cut one ends at once (streams/cut.py).
                StarletteMiddleware(CutCalls, path=path),
                StarletteMiddleware(
                    AdoptSessions,
                    store=self.store,
                    ownership=self.ownership,
                    path=path,
                    on_adopt=metrics.SESSIONS_ADOPTED.inc if metrics else None,
                    on_serve=subscriptions.restore,
                    events=events,
                    transports=transports,
                ),
            ],
            # An idle session costs a replica a transport (~40 KB) until it is forgotten, and
            # adoption serves it again from the store when it comes back: forget it early.
            session_idle_timeout=self.settings.session_idle_seconds,
            **{"retry_interval": self.settings.sse_retry_ms, **options},
        )
        if metrics is not None:
            metrics.watch_sessions(app, path)
            metrics.LISTEN_STREAMS.set_function(lambda: subscriptions.streams)
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(starlette: Any) -> AsyncIterator[Any]:
            if not tasks_installed():
                tasked = [t.name for t in await mcp.get_tasks() if t.task_config.supports_tasks()]
                if tasked:
                    raise RuntimeError(
                        f"{', '.join(sorted(tasked))}: task=True tools need the kit's tasks extra: "
                        "pip install 'mcp-ha-kit[tasks]' (fastmcp-tasks)"
                    )
            # This replica's lease lives from before FastMCP's lifespan starts its task worker until after that
            # worker has finished the tasks it runs: while it lives, nobody takes them over (tasks.py).
            lease = asyncio.get_running_loop().create_task(self.runs.keep_alive())
            try:
                async with inner(starlette) as state:
                    drain_on_sigterm(self.drain)
                    # A template with {session_id} shows that session's state: its subscribers hear of each change.
                    templates = await mcp.list_resource_templates(run_middleware=False)
                    self.bus.session_templates = [t.uri_template for t in templates if "{session_id}" in t.uri_template]
                    yield state
            finally:
                lease.cancel()
                await self.bus.aclose()
                await self.store.aclose()

        app.router.lifespan_context = lifespan
        return NameReplica(
            RequestIds(
                self.drain.middleware(
                    BodyLimit(
                        app,
                        max_bytes=self.settings.max_body_bytes,
                        max_items=self.settings.max_request_items,
                        max_depth=self.settings.max_request_depth,
                        path=path,
                    ),
                    path=path,
                )
            ),
            self.instance,
        )

    def run(self, app: ASGIApp) -> None:
        """Serve `app` with uvicorn on the settings' host and port, logging as LOG_FORMAT says."""
        s = self.settings
        log_config = configure(log_format=s.log_format, instance=s.instance_id, level=s.log_level.upper())
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=s.host,
                port=s.port,
                log_config=log_config,
                log_level=s.log_level,
                loop="uvloop",
                http="httptools",
                # After the drain, whatever is still open (GET streams) gets this long.
                timeout_graceful_shutdown=2,
            )
        )
        # Drained, the replica exits 0: it stopped as asked, not killed by the signal.
        self.drain.stop = lambda: setattr(server, "should_exit", True)
        server.run()
