"""Calls run again here, whose replica died: from the replay that finds one to the transport that runs it.

A replay served here is registered for its session while it runs (`Reruns.replaying`, by
`resumption.CheckResumption`), with the request it serves and the app below that check. The session's
event store (`event_store.SessionEvents`), following the stream of a call whose runner is gone, asks
`start` to run the call again: its request is posted once more as its client would post it, under the
first run's idempotency key, through that app, so the session is adopted here and the call's writes apply
once. The transport that takes the POST asks its event store (`_sdk.ResumableEvents.rerun_into`, which
asks `take`) for the stream the request is to run into, and streams into it instead of answering as JSON.
The replay, following that stream in the store, delivers what the re-run sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Scope

log = logging.getLogger(__name__)

# Headers of the resuming GET that the re-run's POST does not carry: it sets its own.
_REPLACED = {b"last-event-id", b"content-length", b"content-type", b"accept", b"x-request-id"}


@dataclass(frozen=True)
class Rerun:
    """A call of `session_id` to run again into its stream `stream` in the log."""

    session_id: str
    stream: str
    request_id: str  # as the transport names it: str() of the JSON-RPC id
    request: str  # the JSON-RPC request, as first received
    key: str | None  # its idempotency key, the first run's
    # Ends the stream with an error saying why the call could not run again (given why).
    refused: Callable[[str], Awaitable[Any]]


class Reruns:
    """The re-runs of this replica: who can run one (the replays served here), and where each streams."""

    def __init__(self) -> None:
        # The replays served here, per session: the resuming request, and the app a re-run goes through.
        self._replays: dict[str, list[tuple[Scope, ASGIApp]]] = {}
        # The re-runs posted and not yet taken by their transport: (session, request id) -> stream.
        self._expected: dict[tuple[str, str], str] = {}
        # The re-runs running here, until they end: a resuming client that hangs up does not stop one.
        self._running: set[asyncio.Task[None]] = set()

    @contextmanager
    def replaying(self, session_id: str, scope: Scope, app: ASGIApp) -> Iterator[None]:
        """While a replay of `session_id` is served here: its request `scope`, and the `app` it goes to."""
        entry = (scope, app)
        self._replays.setdefault(session_id, []).append(entry)
        try:
            yield
        finally:
            replays = self._replays[session_id]
            replays.remove(entry)
            if not replays:
                del self._replays[session_id]

    def start(self, rerun: Rerun) -> bool:
        """Run `rerun` here, on its own; False when no replay of its session is served here to run it for
        (its request, which the session's owner sent, is what the re-run's POST is made from)."""
        replays = self._replays.get(rerun.session_id)
        if not replays:
            return False
        scope, app = replays[-1]
        log.info("re-running call %s of session %s here", rerun.stream, rerun.session_id)
        self._expected[rerun.session_id, rerun.request_id] = rerun.stream
        task = asyncio.get_running_loop().create_task(self._run(app, scope, rerun))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return True

    def take(self, session_id: str, request_id: str) -> str | None:
        """The stream a re-run of `request_id` is to run into, once: None for any other request."""
        return self._expected.pop((session_id, request_id), None)

    async def _run(self, app: ASGIApp, replay: Scope, rerun: Rerun) -> None:
        body = rerun.request.encode()
        headers = [(name, value) for name, value in replay["headers"] if name.lower() not in _REPLACED]
        headers += [
            (b"content-type", b"application/json"),
            (b"accept", b"application/json, text/event-stream"),
            (b"content-length", str(len(body)).encode()),
        ]
        if rerun.key is not None:
            headers.append((b"x-request-id", rerun.key.encode()))
        scope = {**replay, "method": "POST", "headers": headers, "query_string": b""}
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        started = asyncio.Event()

        async def receive() -> Message:
            if messages:
                return messages.pop()
            # Nobody reads the response: once it has started, its "connection" closes, and the call runs on
            # as any whose client left, for as long as a replay reads its stream (SessionEvents.unread).
            await started.wait()
            return {"type": "http.disconnect"}

        status: list[int] = []

        async def send(message: Message) -> None:
            # The stream is in the store, and the replay delivers it; only a refusal matters here.
            if message["type"] == "http.response.start":
                status.append(message["status"])
                started.set()

        try:
            await app(scope, receive, send)
        except Exception:
            log.exception("re-running call %s failed", rerun.stream)
        finally:
            self._expected.pop((rerun.session_id, rerun.request_id), None)
        if status[:1] != [200]:
            await rerun.refused(f"(the replica that would run it again answered {status[0] if status else 'nothing'})")
