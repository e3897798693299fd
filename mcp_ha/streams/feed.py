"""The feed that wakes the replays following a stream when an event is added to it, on any replica."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from ..session_store import RESYNC, SessionStore, StoreUnavailable

log = logging.getLogger(__name__)


class EventFeed:
    """Per replica: wakes the replays following a stream when an event is added to it, on any replica.

    One subscription (`store.watch(events=True)`) while any replay waits, whose messages name the session
    and the stream: a replay wakes for its own stream's events only, however chatty its session, and a
    thousand waiting replays cost the store nothing until their streams grow. It also marks the streams
    followed here as read (`mark_read`), once per interval per stream however many replays follow it.
    """

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._waiting: dict[tuple[str, str], set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        # Each stream followed here: when it was last marked read in the store.
        self._marked: dict[tuple[str, str], float] = {}

    def register(self, session_id: str, stream_id: str) -> asyncio.Event:
        woken = asyncio.Event()
        self._waiting.setdefault((session_id, stream_id), set()).add(woken)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._listen())
        return woken

    def forget(self, session_id: str, stream_id: str, woken: asyncio.Event) -> None:
        waiting = self._waiting.get((session_id, stream_id))
        if waiting is not None:
            waiting.discard(woken)
            if not waiting:
                del self._waiting[session_id, stream_id]
                self._marked.pop((session_id, stream_id), None)
        if not self._waiting and self._task is not None:
            self._task.cancel()
            self._task = None

    async def mark_read(self, session_id: str, stream_id: str, ttl_seconds: int) -> None:
        """Tell the replica running the stream's call that someone reads it (`SessionEvents.unread`): a
        claim for `ttl_seconds`, renewed every third of it while any replay here follows the stream."""
        now = time.monotonic()
        if now - self._marked.get((session_id, stream_id), -math.inf) < ttl_seconds / 3:
            return
        self._marked[session_id, stream_id] = now
        try:
            # Charged to nobody: a few bytes for ttl_seconds, one per stream followed, within MAX_REPLAYS.
            await self.store.claim(reading_claim(session_id, stream_id), "read", ttl_seconds)
        except StoreUnavailable as exc:
            self._marked.pop((session_id, stream_id), None)
            log.warning("stream %s of session %s not marked read: %s", stream_id, session_id, exc)

    def _wake_all(self) -> None:
        for waiting in self._waiting.values():
            for woken in waiting:
                woken.set()

    async def _listen(self) -> None:
        while self._waiting:
            try:
                async with self.store.watch(events=True) as added:
                    # Whatever was added before the subscription began is read by the replays woken here.
                    self._wake_all()
                    async for message in added:
                        if message == RESYNC:  # some events may have been missed: every replay reads
                            self._wake_all()
                            continue
                        session_id, _, stream_id = message.partition(" ")
                        for woken in self._waiting.get((session_id, stream_id), ()):
                            woken.set()
            except StoreUnavailable as exc:
                # What the feed carried while lost is gone: every replay reads afresh, now and once back.
                log.warning("event feed lost (%s); replays read again once it is back", exc)
                self._wake_all()
                await asyncio.sleep(1.0)


def reading_claim(session_id: str, stream_id: str) -> str:
    """The claim saying that a replay somewhere reads the stream (`EventFeed.mark_read`)."""
    return f"reading:{session_id}:{stream_id}"
