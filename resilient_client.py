"""Pattern: a client that rides through a replica's failure.

    async with ResilientClient("http://127.0.0.1:8080/mcp", max_retries=3) as client:
        result = await client.call_tool("increment_counter", {})
        result.data["counter"]

It wraps FastMCP's `Client` in session (2025-11-25, "legacy") mode and adds:

- a timeout on every call, so no call can hang, however the server fails;
- retries on transport failures only: the connection broke, the call timed
  out, the proxy answered 502/503/504, or the session is gone (404). A tool's
  own error is the answer, never retried. Backoff is exponential with jitter,
  bounded by attempts and by total time (stamina);
- after such a failure it opens a new session and calls `resume_session` with
  the old session id, so the state kept in the store follows it.

A retried call may already have been applied once (the failure can come after
the server acted), so retries suit reads and idempotent tools best.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx2
import stamina
from fastmcp import Client
from fastmcp.client.transports import StreamableHttpTransport
from mcp.shared.exceptions import MCPError

log = logging.getLogger(__name__)

# Statuses a proxy answers while a replica is failing: worth another try.
RETRYABLE_STATUSES = frozenset({502, 503, 504})
REQUEST_TIMEOUT = -32001
SESSION_GONE = ("Session terminated", "Session not found")


class TransientFailure(Exception):
    """The call failed for a reason another attempt may not share."""


class ResilientClient:
    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 3,
        call_timeout: float = 10.0,
        total_timeout: float = 30.0,
        **client_kwargs: Any,
    ) -> None:
        self.url = url
        self.max_retries = max_retries
        self.call_timeout = call_timeout
        self.total_timeout = total_timeout
        self._client_kwargs = client_kwargs
        self._client: Client | None = None
        self._last_status: int | None = None
        self.session_id: str | None = None
        # Session ids this client has had, oldest first: the history of its failovers.
        self.sessions: list[str] = []

    async def __aenter__(self) -> ResilientClient:
        await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._disconnect()

    def _http_client(self, **kwargs: Any) -> httpx2.AsyncClient:
        # The SDK turns a non-JSON error answer into a generic error without its
        # HTTP status; recording the status here tells a proxy's 503 from a bug.
        async def remember_status(response: httpx2.Response) -> None:
            self._last_status = response.status_code

        kwargs.setdefault("timeout", httpx2.Timeout(self.call_timeout))
        return httpx2.AsyncClient(**kwargs, event_hooks={"response": [remember_status]})

    async def _connect(self) -> None:
        transport = StreamableHttpTransport(self.url, httpx_client_factory=self._http_client)
        client = Client(transport, mode="legacy", timeout=self.call_timeout, **self._client_kwargs)
        async with asyncio.timeout(self.call_timeout):
            await client.__aenter__()
        self._client = client
        self.session_id = transport.get_session_id()
        if self.session_id:
            self.sessions.append(self.session_id)

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            async with asyncio.timeout(self.call_timeout):
                await client.__aexit__(None, None, None)
        except Exception as exc:  # the old session is being abandoned anyway
            log.debug("closing the old session failed: %r", exc)

    async def _reconnect(self) -> None:
        old_session = self.session_id
        await self._disconnect()
        await self._connect()
        if old_session and self._client is not None:
            result = await self._client.call_tool(
                "resume_session", {"old_session_id": old_session}, timeout=self.call_timeout
            )
            log.info("resumed %s as %s: %s", old_session, self.session_id, result.data)

    def _classify(self, exc: BaseException) -> BaseException:
        """A TransientFailure for failures worth retrying; the exception itself otherwise."""
        if isinstance(exc, (httpx2.TransportError, TimeoutError)):
            return TransientFailure(repr(exc))
        if isinstance(exc, MCPError):
            if exc.error.code == REQUEST_TIMEOUT or exc.error.message in SESSION_GONE:
                return TransientFailure(exc.error.message)
            if self._last_status in RETRYABLE_STATUSES:
                return TransientFailure(f"HTTP {self._last_status}")
        if isinstance(exc, RuntimeError) and self._client is None:
            return TransientFailure(repr(exc))  # could not connect at all
        return exc

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        needs_reconnect = self._client is None
        async for attempt in stamina.retry_context(
            on=TransientFailure,
            attempts=self.max_retries + 1,
            timeout=self.total_timeout,
            wait_initial=0.1,
            wait_max=2.0,
        ):
            with attempt:
                try:
                    async with asyncio.timeout(self.call_timeout * 2):
                        if needs_reconnect:
                            await self._reconnect()
                            needs_reconnect = False
                        assert self._client is not None
                        return await getattr(self._client, method)(*args, **kwargs)
                except Exception as exc:
                    classified = self._classify(exc)
                    if classified is exc:
                        raise
                    needs_reconnect = True
                    log.warning("%s failed (%s); attempt %d", method, classified, attempt.num)
                    raise classified from exc
        raise AssertionError("unreachable: stamina either returns or raises")

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return await self._call("call_tool", name, arguments or {}, **kwargs)

    async def read_resource(self, uri: str) -> Any:
        return await self._call("read_resource", uri)

    async def list_tools(self) -> Any:
        return await self._call("list_tools")
