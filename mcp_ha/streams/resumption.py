"""The check in front of every resuming GET: a bad Last-Event-ID is answered before the SDK streams."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import refusal
from ..principals import owner, refused_by_auth
from ..session_store import SessionStore, StoreUnavailable, is_event_id, is_session_id
from .cut import answer_cut, cut_call_named, sessionless
from .reruns import Reruns

MALFORMED = (
    "Malformed Last-Event-ID: send the id of the last event received on this session's stream, "
    "or open a new stream without one."
)
UNKNOWN = (
    "This session has no event with that Last-Event-ID (it may have expired), so the stream cannot be "
    "resumed: send the request again (a tools/call with the same idempotency key is applied once)."
)
UNAVAILABLE = "Session store unavailable; try again shortly."


def resumes_stream(scope: Scope) -> bool:
    """Whether the request resumes a stream (GET with a Last-Event-ID): it reads, and changes nothing."""
    return scope["method"] == "GET" and bool(Headers(scope=scope).get("last-event-id"))


class CheckResumption:
    """ASGI middleware in front of the MCP endpoint: a resuming GET is checked against the store first.

    Without it, the SDK answers any Last-Event-ID with a 200 stream, empty
    when the id is unknown, and the client cannot tell a lost stream from a
    quiet one.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: SessionStore,
        reruns: Reruns,
        max_per_session: int,
        max_replays: int,
        on_resume: Callable[[], None] | None = None,
    ) -> None:
        """`reruns`: where a replay served here is registered, for the re-runs of calls it finds ended."""
        self.app = app
        self.store = store
        self.reruns = reruns
        self.on_resume = on_resume
        self.max_per_session = max_per_session
        self.max_replays = max_replays
        # Replays running here, per session (a Counter drops none by itself: `_done` does).
        self._running: Counter[str] = Counter()
        self._total = 0

    def _busy(self) -> JSONResponse:
        message = f"This replica is resuming {self.max_replays} streams, the most it may; try again shortly."
        return refusal(503, message, retry_after=1, bound="MAX_REPLAYS")

    def _crowded(self) -> JSONResponse:
        message = (
            f"This session has {self.max_per_session} streams being resumed, the most it may; "
            "close one, or try again shortly."
        )
        return refusal(429, message, retry_after=1, bound="MAX_REPLAYS_PER_SESSION")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if resumes_stream(scope) and not refused_by_auth(scope):
            headers = Headers(scope=scope)
            cut = cut_call_named(headers.get("last-event-id")) if sessionless(scope) else None
            if cut is not None:
                # A cut sessionless call (CutCalls): nothing to read anywhere, the call has ended.
                return await answer_cut(send, *cut)
            session_id = headers.get("mcp-session-id")
            # No session, or one this kit never mints: the SDK answers as usual (400 / 404).
            if is_session_id(session_id):
                last_event_id = headers.get("last-event-id")
                if not is_event_id(last_event_id):
                    return await refusal(400, MALFORMED)(scope, receive, send)
                if self._total >= self.max_replays:  # before any read: a flood costs the store nothing
                    return await self._busy()(scope, receive, send)
                try:
                    # The owner first, for everyone: a stranger's answer takes as long as an unknown id's.
                    found = None
                    if await self.store.owner(session_id) == owner(scope):
                        # Past the owner, so a stranger learns nothing from it; before the log is read.
                        if self._running[session_id] >= self.max_per_session:
                            return await self._crowded()(scope, receive, send)
                        found = await self.store.events_after(session_id, last_event_id)
                except StoreUnavailable:
                    return await refusal(503, UNAVAILABLE)(scope, receive, send)
                if found is None:
                    return await refusal(404, UNKNOWN)(scope, receive, send)
                # Again: others may have started while the store answered.
                if self._total >= self.max_replays:
                    return await self._busy()(scope, receive, send)
                if self._running[session_id] >= self.max_per_session:
                    return await self._crowded()(scope, receive, send)
                if self.on_resume is not None:
                    self.on_resume()
                self._running[session_id] += 1
                self._total += 1
                try:
                    # A call whose runner is gone is run again through this replay (reruns.py).
                    with self.reruns.replaying(session_id, scope, self.app):
                        return await self.app(scope, receive, send)
                finally:
                    self._total -= 1
                    self._running[session_id] -= 1
                    if not self._running[session_id]:
                        del self._running[session_id]
        await self.app(scope, receive, send)
