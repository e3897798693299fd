"""Pattern: a client that rides through a replica's failure, and never applies a call twice.

    async with ResilientClient("http://127.0.0.1:8080/mcp", max_retries=3) as client:
        result = await client.call_tool("increment_counter", {})
        result.data["counter"]

It wraps FastMCP's `Client` in session (2025-11-25, "legacy") mode and adds:

- **a timeout on every call** (`call_timeout`), so no call hangs, however the
  server fails;
- **an idempotency key on every `tools/call`** (in `_meta`, see
  `mcp_ha/idempotency.py`), the same on each retry of that call: the server applies
  the call at most once and answers a repeat with the recorded result;
- **retries on transport failures only**: the connection broke, the call timed
  out, the proxy answered 502/503/504, the session is gone (404), the
  server said the session moved mid-call (nothing applied), or its session
  store was unavailable (a Redis failover or outage; the key makes a repeat
  safe whether or not the call was applied). A tool's own error is its
  answer, never retried. Backoff is exponential with jitter, bounded by
  attempts and by total time (stamina);
- **the same session after a failure**: it reconnects with the same
  `mcp-session-id`, and the replica that gets the next request adopts the
  session (`mcp_ha/adoption.py`). Only if the session is gone for good (404)
  does it open a new one and copy the old state over with `resume_session`.

Abandoning a broken connection must not end the session, so the DELETE the
SDK sends on close is held back; `aclose()` ends the session once, at the end.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import httpx2
import stamina
from fastmcp import Client
from fastmcp.client.transports import StreamableHttpTransport
from fastmcp.exceptions import ToolError
from mcp.shared.exceptions import MCPError

log = logging.getLogger(__name__)

# What the server says, copied rather than imported: the client stands alone, and
# tests/test_resilient_client.py holds each equal to the server's own.
IDEMPOTENCY_KEY = "io.github.mcp-ha-kit/idempotency-key"  # mcp_ha.idempotency.IDEMPOTENCY_KEY
SESSION_MOVED = "This session moved to another replica; call again."  # mcp_ha.errors.SESSION_MOVED
STORE_UNAVAILABLE = "Session store unavailable; try again shortly."  # session_store.STORE_UNAVAILABLE

RETRYABLE_STATUSES = frozenset({502, 503, 504})
REQUEST_TIMEOUT = -32001
CONNECTION_CLOSED = -32000
# The server cancelled the request (after the client's own timeout asked it to).
REQUEST_CANCELLED = -32800
SESSION_GONE = ("Session terminated", "Session not found")
DEFAULT_PROTOCOL = "2025-11-25"


class TransientFailure(Exception):
    """The call failed for a reason another attempt may not share."""


class SessionGone(TransientFailure):
    """The server no longer knows the session: a new one is needed."""


class _HttpTransport(httpx2.AsyncHTTPTransport):
    """Records each answer's status, and holds back the SDK's DELETE once the connection is abandoned."""

    def __init__(self, owner: ResilientClient) -> None:
        super().__init__()
        self.owner = owner
        self.abandoned = False

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self.abandoned and request.method == "DELETE":
            return httpx2.Response(204, request=request)
        response = await super().handle_async_request(request)
        # The SDK turns a non-JSON error answer into a generic error without its
        # status; the status tells a proxy's 503 from a server's bug.
        self.owner._last_status = response.status_code
        return response


class ResilientClient:
    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 3,
        call_timeout: float = 10.0,
        total_timeout: float = 30.0,
        auth: str | None = None,
        **client_kwargs: Any,
    ) -> None:
        self.url = url
        # A bearer token (mcp_ha/auth.py): the calls carry it, and so must the DELETE
        # that ends the session, or the server answers 401 and the session
        # lingers until its TTL.
        self._auth = {"Authorization": f"Bearer {auth}"} if auth else {}
        self.max_retries = max_retries
        self.call_timeout = call_timeout
        self.total_timeout = total_timeout
        self._client_kwargs = client_kwargs
        self._client: Client[StreamableHttpTransport] | None = None
        self._http: _HttpTransport | None = None
        self._last_status: int | None = None
        self._protocol = DEFAULT_PROTOCOL
        self.session_id: str | None = None
        # Every session id this client has had, oldest first: a new one appears
        # only when a session was lost for good and resumed into a new one.
        self.sessions: list[str] = []
        self.reconnects = 0

    async def __aenter__(self) -> ResilientClient:
        await self._open(rejoin=False)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection and end the session on the server."""
        await self._abandon()
        if self.session_id:
            headers = {"mcp-session-id": self.session_id, "mcp-protocol-version": self._protocol, **self._auth}
            try:
                async with httpx2.AsyncClient(timeout=self.call_timeout) as http:
                    await http.delete(self.url, headers=headers)
            except httpx2.HTTPError as exc:
                log.debug("ending the session failed: %r", exc)

    async def _open(self, *, rejoin: bool) -> None:
        """A new connection: to the current session (`rejoin`), or with a new session."""
        http = _HttpTransport(self)

        # McpHttpClientFactory's parameters, and **kwargs for what fastmcp passes beyond them
        # (follow_redirects). The timeout is this client's, whatever the transport asks for.
        def factory(
            headers: dict[str, str] | None = None,
            timeout: httpx2.Timeout | None = None,
            auth: httpx2.Auth | None = None,
            **kwargs: Any,
        ) -> httpx2.AsyncClient:
            return httpx2.AsyncClient(
                headers=headers, auth=auth, **kwargs, timeout=httpx2.Timeout(self.call_timeout), transport=http
            )

        headers: dict[str, str] = {}
        if rejoin:
            if self.session_id is None:
                raise RuntimeError("cannot rejoin: this client has no session id")
            headers = {"mcp-session-id": self.session_id, "mcp-protocol-version": self._protocol}
        transport = StreamableHttpTransport(self.url, headers={**headers, **self._auth}, httpx_client_factory=factory)
        client = Client(
            transport, mode="legacy", timeout=self.call_timeout, auto_initialize=not rejoin, **self._client_kwargs
        )
        async with asyncio.timeout(self.call_timeout):
            await client.__aenter__()  # type: ignore[no-untyped-call]  # unannotated in FastMCP
        self._client, self._http = client, http
        if not rejoin:
            self.session_id = transport.get_session_id()
            if client.initialize_result is not None:
                self._protocol = client.initialize_result.protocol_version
            if self.session_id:
                self.sessions.append(self.session_id)

    async def _abandon(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        if self._http is not None:
            self._http.abandoned = True
        try:
            async with asyncio.timeout(self.call_timeout):
                await client.__aexit__(None, None, None)  # type: ignore[no-untyped-call]  # unannotated in FastMCP
        except Exception as exc:  # a broken connection is being dropped anyway
            log.debug("closing the old connection failed: %r", exc)

    async def _recover(self, failure: TransientFailure) -> None:
        self.reconnects += 1
        await self._abandon()
        if not isinstance(failure, SessionGone) and self.session_id:
            await self._open(rejoin=True)
            return
        old_session = self.session_id
        await self._open(rejoin=False)
        if old_session and self._client is not None:
            result = await self._client.call_tool(
                "resume_session", {"old_session_id": old_session}, timeout=self.call_timeout
            )
            log.info("session %s was gone; resumed it as %s: %s", old_session, self.session_id, result.data)

    def _classify(self, exc: BaseException) -> TransientFailure | None:
        """A TransientFailure for failures worth retrying; None otherwise."""
        if isinstance(exc, (httpx2.TransportError, TimeoutError)):
            return TransientFailure(repr(exc))
        if isinstance(exc, MCPError):
            if exc.error.message in SESSION_GONE:
                return SessionGone(exc.error.message)
            if exc.error.code in (REQUEST_TIMEOUT, CONNECTION_CLOSED, REQUEST_CANCELLED):
                return TransientFailure(exc.error.message)
            if self._last_status in RETRYABLE_STATUSES:
                return TransientFailure(f"HTTP {self._last_status}")
        if isinstance(exc, RuntimeError) and ("not connected" in str(exc) or "failed to connect" in str(exc)):
            return TransientFailure(repr(exc))
        if isinstance(exc, ToolError) and str(exc) in (SESSION_MOVED, STORE_UNAVAILABLE):
            return TransientFailure(str(exc))
        return None

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        failure: TransientFailure | None = None if self._client else TransientFailure("not connected")
        async for attempt in stamina.retry_context(
            on=TransientFailure,
            attempts=self.max_retries + 1,
            timeout=self.total_timeout,
            # Failover takes HAProxy about a second: retry soon, and often.
            wait_initial=0.05,
            wait_max=0.5,
            wait_jitter=0.1,
        ):
            with attempt:
                try:
                    async with asyncio.timeout(self.call_timeout * 2):
                        if failure is not None:
                            await self._recover(failure)
                            failure = None
                        assert self._client is not None
                        return await getattr(self._client, method)(*args, **kwargs)
                except Exception as exc:
                    classified = self._classify(exc)
                    if classified is None:
                        raise
                    failure = classified
                    log.warning("%s failed (%s); attempt %d", method, classified, attempt.num)
                    raise classified from exc
        raise AssertionError("unreachable: stamina either returns or raises")

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Call a tool; retried calls carry the same idempotency key, so it applies at most once."""
        meta = {IDEMPOTENCY_KEY: uuid.uuid4().hex, **(kwargs.pop("meta", None) or {})}
        return await self._call("call_tool", name, arguments or {}, meta=meta, **kwargs)

    async def read_resource(self, uri: str) -> Any:
        return await self._call("read_resource", uri)

    async def list_tools(self) -> Any:
        return await self._call("list_tools")
