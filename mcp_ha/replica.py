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
  sessions this replica owns (`adoption.Ownership`); its lease; the token
  verifier when authentication is on. Nothing connects until the app runs.
- `server(name)`: a FastMCP server with that verifier, and error details
  masked (a client sees "Error calling tool", never internals); with the
  `tasks` extra installed, FastMCP's tasks extension on the kit's store, so
  `@mcp.tool(task=True)` tools run as durable tasks (`tasks.py`).
- `session(ctx, handle)`: the caller's state, always fenced by this replica's
  epoch and keyed by the call's idempotency key. The only way a tool gets one.
- `http_app(mcp)`, once per server: FastMCP's middlewares
  (`_server_middlewares`), `create_session` and `end_session` for sessionless
  clients, `/health`, `/metrics`, and the ASGI layers on the MCP route only
  (`_endpoint_layers`), each list in its order, outermost first; the order,
  with what each does, is docs/architecture.md's "A request's way in". What
  one app needs made once (the drain, the bounds' counters, subscriptions)
  is made there (`_Parts`) and given to what uses it. Its lifespan runs the
  lease, makes SIGTERM drain, sets what the process does differently while
  it serves (FastMCP's telemetry off, store refusals not logged as errors),
  and closes the store. Mount it in any ASGI server and every guarantee
  comes with it.
- `run(app)`: uvicorn with structured logs, on the settings' host and port.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any

import fastmcp
import uvicorn
from fastmcp import Context, FastMCP
from fastmcp.server.auth import TokenVerifier
from fastmcp.server.middleware import Middleware
from fastmcp.server.sessions import SessionId
from mcp.server.subscriptions import ServerEvent
from mcp_types import SubscribeRequestParams, SubscriptionsListenRequestParams, UnsubscribeRequestParams
from starlette.applications import Starlette
from starlette.middleware import Middleware as StarletteMiddleware
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _sdk, elicitation
from .adoption import AdoptSessions, Ownership, RecordSessions, RetakeFenced, Stalls, Transports
from .drain import Drain, DrainGate, drain_on_sigterm
from .elicitation import Answer, AskForInput
from .errors import ANSWERED, StoreErrors
from .fastmcp_store import FastMCPSessions
from .handles import create_handle, end_handle, session_id_for
from .health import StoreHealth, health_endpoint, livez_endpoint
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
from .whole_answers import WholeAnswers

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


# Every HTTP answer of a replica names it, so the HA check (mcp_ha.ops.check) sees which replica serves a
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
        # Watched while the app serves: just after its loop stood still, this replica takes no session over.
        self.stalls = Stalls()
        self.bus = StoreBus(self.store)
        # This replica's lease: a call it streams is run again elsewhere once the lease lapses (streams/lease.py).
        # Unmetered: renewing it twice a second is the replica's own work, not any request's.
        self.runs = Runs(store, settings.instance_id)
        self.auth: TokenVerifier | None = None
        if settings.auth != "none":
            from .auth import make_verifier

            self.auth = make_verifier(settings)
        self._servers: weakref.WeakSet[FastMCP] = weakref.WeakSet()
        # The servers `http_app` has wired: once each, or their middlewares would run twice.
        self._wired: weakref.WeakSet[FastMCP] = weakref.WeakSet()
        # How `run` ends the server it runs once drained (a clean exit); None: SIGTERM goes on to it.
        self._stop: Callable[[], None] | None = None

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

        FastMCP's OpenTelemetry spans are off while the app serves, unless FASTMCP_TELEMETRY_MODE says
        otherwise (`http_app`'s lifespan)."""
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

            restarts = self._metrics.TASK_WORKER_RESTARTS.inc if self._metrics is not None else None
            mcp.add_extension(HATasks(self.settings, self.store, self.runs, on_worker_restart=restarts))
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
        """The ASGI app serving `mcp` at `path` with every guarantee; once per server. `options` go to
        FastMCP's http_app. What it puts where, in order: docs/architecture.md, "A request's way in"."""
        if mcp not in self._servers:
            raise ValueError("serve a FastMCP made by HighAvailability.server(): it carries the auth and error masking")
        if mcp in self._wired:
            raise RuntimeError("http_app() already wired this server: call it once (its middlewares would run twice)")
        self._wired.add(mcp)
        parts = _Parts(self, mcp, path)
        for middleware in self._server_middlewares(parts):
            mcp.add_middleware(middleware)
        if parts.tool_schemas.install(mcp):
            mcp.add_middleware(parts.tool_schemas)
        _sdk.add_outside_request_state_boundary(mcp, NoteSealedState())
        _sdk.add_server_middleware(mcp, CallsRunning())
        listen = parts.subscriptions
        _sdk.add_request_handler(mcp, "subscriptions/listen", SubscriptionsListenRequestParams, listen.listen)
        _sdk.add_request_handler(mcp, "resources/subscribe", SubscribeRequestParams, listen.subscribe)
        _sdk.add_request_handler(mcp, "resources/unsubscribe", UnsubscribeRequestParams, listen.unsubscribe)
        self._add_tools(mcp)
        mcp.custom_route("/health", methods=["GET"])(health_endpoint(self.instance, parts.drain, parts.health))
        mcp.custom_route("/livez", methods=["GET"])(livez_endpoint(self.instance))
        if self._metrics is not None:
            mcp.custom_route("/metrics", methods=["GET"])(self._metrics.endpoint)
        app = mcp.http_app(
            path=path,
            # An idle session costs a replica a transport (~40 KB) until it is forgotten, and
            # adoption serves it again from the store when it comes back: forget it early.
            session_idle_timeout=self.settings.session_idle_seconds,
            **{"retry_interval": self.settings.sse_retry_ms, **options},
        )
        parts.endpoint.app = app
        on_endpoint(app, path, self._endpoint_layers(parts, path))
        app.router.lifespan_context = self._lifespan(mcp, parts, app.router.lifespan_context)
        if self._metrics is not None:
            self._metrics.watch_sessions(app, path)
            self._metrics.watch_replica(
                draining=lambda: parts.drain.draining,
                store_up=lambda: parts.health.reached and parts.health.unreachable_since is None,
            )
            self._metrics.LISTEN_STREAMS.set_function(lambda: parts.subscriptions.streams)
        # Every answer names its replica, and every line logged serving it its request, whatever the path.
        return NameReplica(RequestIds(app), self.instance)

    def _server_middlewares(self, parts: _Parts) -> list[Middleware]:
        """FastMCP's middlewares, outermost first: metrics sees what the client gets."""
        metered: list[Middleware] = [self._metrics.ToolMetrics()] if self._metrics is not None else []
        return [
            *metered,
            StoreErrors(on_fenced=self.ownership.lost),
            RetakeFenced(self.store, self.ownership, stalls=self.stalls, on_adopt=self._on_adopt),
            IdempotentCalls(),
            AskForInput(),
            RefuseReplays(self.store, ttl_seconds=self.settings.request_state_ttl_seconds),
            RecordSessions(
                self.store, self.ownership, path=parts.endpoint.path, events=parts.events, transports=parts.transports
            ),
        ]

    def _endpoint_layers(self, parts: _Parts, path: str) -> list[StarletteMiddleware]:
        """The ASGI layers on the MCP route only, outermost first; FastMCP's authentication runs before
        them, so a client is its principal."""
        s, metrics = self.settings, self._metrics
        return [
            StarletteMiddleware(DrainGate, drain=parts.drain),
            StarletteMiddleware(
                BodyLimit, max_bytes=s.max_body_bytes, max_items=s.max_request_items, max_depth=s.max_request_depth
            ),
            StarletteMiddleware(CallsInFlight, in_flight=parts.in_flight),
            StarletteMiddleware(
                SessionLimits,
                store=self.store,
                max_record_bytes=s.max_record_bytes,
                max_sessions=s.max_sessions,
                max_sessions_per_client=s.max_sessions_per_client,
            ),
            # Before adoption: a bad Last-Event-ID is answered before any replica takes the session up.
            StarletteMiddleware(
                CheckResumption,
                store=self.store,
                reruns=parts.reruns,
                max_per_session=s.max_replays_per_session,
                max_replays=s.max_replays,
                on_resume=metrics.STREAMS_RESUMED.inc if metrics else None,
            ),
            StarletteMiddleware(CutCalls),
            StarletteMiddleware(
                AdoptSessions,
                store=self.store,
                ownership=self.ownership,
                path=path,
                on_adopt=self._on_adopt,
                on_serve=parts.subscriptions.restore,
                events=parts.events,
                transports=parts.transports,
                stalls=self.stalls,
            ),
        ]

    @property
    def _on_adopt(self) -> Callable[[], None] | None:
        return self._metrics.SESSIONS_ADOPTED.inc if self._metrics is not None else None

    def _add_tools(self, mcp: FastMCP) -> None:
        """`create_session` and `end_session`: sessionless clients' handles (handles.py)."""

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

    def _lifespan(
        self, mcp: FastMCP, parts: _Parts, inner: Callable[[Any], AbstractAsyncContextManager[Any]]
    ) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
        """FastMCP's lifespan inside the replica's: the lease, the drain on SIGTERM, the process-wide
        settings while the app serves, and the store closed at the end."""

        @asynccontextmanager
        async def lifespan(starlette: Any) -> AsyncIterator[Any]:
            await _check_task_tools(mcp)
            # This replica's lease lives from before FastMCP's lifespan starts its task worker until after that
            # worker has finished the tasks it runs: while it lives, nobody takes them over (tasks.py).
            lease = asyncio.get_running_loop().create_task(self.runs.keep_alive())
            watch = asyncio.get_running_loop().create_task(self.stalls.watch())
            try:
                with _process_settings(self.settings):
                    async with inner(starlette) as state:
                        drain_on_sigterm(parts.drain, stop=self._stop)
                        parts.tool_schemas.learn(await mcp.list_tools(run_middleware=False))
                        # A template with {session_id} shows that session's state: its subscribers hear of each change.
                        templates = await mcp.list_resource_templates(run_middleware=False)
                        self.bus.session_templates = [
                            t.uri_template for t in templates if "{session_id}" in t.uri_template
                        ]
                        yield state
            finally:
                lease.cancel()
                watch.cancel()
                await self.bus.aclose()
                await self.store.aclose()

        return lifespan

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
                # httptools, writing a whole answer in one write: a kill finds it sent or not (whole_answers.py).
                http=WholeAnswers,
                # After the drain, whatever is still open (GET streams) gets this long.
                timeout_graceful_shutdown=2,
            )
        )
        # Drained, the replica exits 0: it stopped as asked, not killed by the signal.
        self._stop = lambda: setattr(server, "should_exit", True)
        server.run()


def on_endpoint(app: Starlette, path: str, layers: Sequence[StarletteMiddleware]) -> None:
    """Put `layers` (outermost first) around the MCP endpoint at `path`, and around nothing else: FastMCP's
    app-wide middleware (authentication) runs before them, and /health or /metrics never pass through."""
    route = next((r for r in app.routes if isinstance(r, Route) and r.path == path), None)
    if route is None:
        raise LookupError(f"no MCP endpoint at {path}")
    inner = route.app
    for cls, args, kwargs in reversed(layers):
        inner = cls(inner, *args, **kwargs)
    route.app = inner


class _Parts:
    """What one `http_app` makes for its server, each made once and given to what uses it."""

    def __init__(self, ha: HighAvailability, mcp: FastMCP, path: str) -> None:
        s = ha.settings
        self.endpoint = _sdk.Endpoint(path)
        self.tool_schemas = _sdk.ToolSchemas()
        self.in_flight = InFlight(
            max_per_session=s.max_calls_per_session,
            max_per_client=s.max_calls_per_client,
            queue_seconds=s.call_queue_seconds,
            max_queued_per_client=s.max_queued_calls_per_client,
            fair_share=s.fair_share_calls,
        )
        self.transports = Transports(s.max_transports_per_client)
        self.reruns = Reruns()
        self.events = functools.partial(
            SessionEvents,
            ha.store,
            max_event_bytes=s.max_event_bytes,
            feed=EventFeed(ha.store),
            on_answer=self.in_flight.release,
            runs=ha.runs,
            reruns=self.reruns,
            call_ttl_seconds=int(s.event_ttl_seconds),
            abandoned_seconds=s.abandoned_call_seconds,
        )

        async def resource_matches(uri: str) -> bool:
            resources = await mcp.list_resources(run_middleware=False)
            templates = await mcp.list_resource_templates(run_middleware=False)
            return any(str(r.uri) == uri for r in resources) or any(t.matches(uri) is not None for t in templates)

        self.subscriptions = Subscriptions(
            ha.bus,
            max_streams=s.max_listen_streams,
            max_per_client=s.max_listens_per_client,
            resource_matches=resource_matches,
            holds=self.endpoint.holds,
        )
        # Listen streams never end on their own: a drain ends them, and their clients listen elsewhere.
        self.drain = Drain(on_drain=self.subscriptions.close)
        self.health = StoreHealth(ha.store, self.drain, grace_seconds=s.redis_retry_seconds if s.uses_redis else 0.0)


async def _check_task_tools(mcp: FastMCP) -> None:
    """Refuse to start with task=True tools and no tasks extra: they would fail at their first call."""
    if tasks_installed():
        return
    tasked = [t.name for t in await mcp.get_tasks() if t.task_config.supports_tasks()]
    if tasked:
        raise RuntimeError(
            f"{', '.join(sorted(tasked))}: task=True tools need the kit's tasks extra: "
            "pip install 'mcp-ha-kit[tasks]' (fastmcp-tasks)"
        )


@contextmanager
def _process_settings(settings: Settings) -> Iterator[None]:
    """What the whole process does differently while a replica's app serves, undone after.

    FastMCP's OpenTelemetry spans are off unless FASTMCP_TELEMETRY_MODE says otherwise: with no exporter
    they go nowhere, and they cost ~8% of a replica's CPU per call (issue 16's profile). A store's refusal
    is answered (errors.py): FastMCP's logged traceback of it would bury real bugs."""
    telemetry = fastmcp.settings.telemetry_mode
    if settings.fastmcp_telemetry_mode is None:
        fastmcp.settings.telemetry_mode = "off"
    answered = Expected(*ANSWERED)
    logger = logging.getLogger("fastmcp.server.server")
    logger.addFilter(answered)
    try:
        yield
    finally:
        logger.removeFilter(answered)
        fastmcp.settings.telemetry_mode = telemetry
