"""Pattern: graceful drain, so stopping a replica costs no call.

On SIGTERM a replica does not stop at once. It:

1. refuses new work at once: every new request to the MCP endpoint gets 503
   before anything is done with it, and HAProxy re-sends it to another
   replica (which adopts the session). No new sessions start here;
2. lets the calls already in flight finish (at most `timeout_seconds`);
3. then answers `/health` with 503 ("draining"), waits until every load
   balancer checking it has seen that (`notice_checks` of each one's health
   checks, at most `notice_seconds`);
4. exits. Open GET streams are closed, and their clients reconnect elsewhere.

Why health fails only after the calls: a balancer may cut the requests still
open on a server when it marks it down (HAProxy must, to rescue calls stuck on
a hung replica, though the kit's config only stops sending new work to one
that answers 503), so a replica that failed its health check first could have
its own in-flight calls cut. Shedding new work with 503 moves traffic away just
as well, without that.

Only the balancers' own checks count, each balancer's on its own: a check
carries `BALANCER_CHECK_HEADER` naming the balancer that sent it (haproxy.cfg
sends it, and removes it from client requests). Each balancer marks a server
down on its own count of failed checks, so anything else polling `/health`
(Docker's HEALTHCHECK, a probe, a person with curl), or a second HAProxy's
checks, would otherwise make up the count, and the replica would exit while
a balancer still had it up; that balancer then sends it a request and cuts
the request when the refused connection marks the server down.

A second SIGTERM (or SIGINT) stops it at once. The drain takes SIGTERM from
whichever ASGI server runs the app (`drain_on_sigterm`, from the lifespan),
so mounting the app elsewhere keeps it.

The same refusal serves a replica that cannot work for another reason (its
store gone, `health.StoreHealth`): `shed(response)` refuses new work with that
answer until `shed(None)`, and `in_flight` says when what it took is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import refusal

log = logging.getLogger(__name__)

# The header the load balancers' health checks carry, naming the balancer (haproxy/haproxy.cfg).
BALANCER_CHECK_HEADER = "x-balancer-check"
# How many balancers a replica keeps track of: a handful run in front of it,
# and a client reaching a replica directly could name any number.
MAX_BALANCERS = 32
# A balancer silent for twice its time between checks and this much more is taken for gone (`Drain._watching`).
SILENCE_SLACK_SECONDS = 0.25


class Drain:
    """A replica's drain: once SIGTERM comes, new work is refused (`DrainGate`), the balancers are told
    (/health), and the calls in flight are waited for; `on_drain` ends what never ends on its own."""

    def __init__(
        self,
        *,
        on_drain: Callable[[], None] = lambda: None,
        notice_checks: int = 2,
        notice_seconds: float = 3.0,
        timeout_seconds: float = 10.0,
    ) -> None:
        self.notice_checks = notice_checks
        self.notice_seconds = notice_seconds
        self.timeout_seconds = timeout_seconds
        self.draining = False
        self.in_flight = 0
        # Per balancer: when it last checked, the time between its last two checks, and how many checks
        # it got "draining" for.
        self._last_check: dict[str, float] = {}
        self._gap: dict[str, float] = {}
        self._refused: dict[str, int] = {}
        self._shedding: ASGIApp | None = None
        self._calls_done = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Set by the balancer check that completes the notice, counted from `_notice_since` (set by `run`).
        self._notice_since: float | None = None
        self._noticed = asyncio.Event()
        # Called as the drain starts: ends what would never end on its own (listen streams).
        self.on_drain = on_drain

    def health_checked(self, *, balancer: str | None) -> bool:
        """Called by /health with the balancer the check came from (None: not a balancer's check);
        whether this replica is healthy as far as draining goes."""
        if balancer is not None:
            if balancer not in self._last_check and len(self._last_check) >= MAX_BALANCERS:
                oldest = min(self._last_check, key=self._last_check.__getitem__)
                del self._last_check[oldest]
                self._gap.pop(oldest, None)
                self._refused.pop(oldest, None)
            now = time.monotonic()
            if balancer in self._last_check:
                self._gap[balancer] = now - self._last_check[balancer]
            self._last_check[balancer] = now
            if self._calls_done:
                self._refused[balancer] = self._refused.get(balancer, 0) + 1
            if self._notice_since is not None and self._noticed_by_all(self._notice_since):
                self._noticed.set()
        return not self._calls_done

    def _watching(self, since: float) -> dict[str, float]:
        """The balancers that checked this replica lately and still do, each with when it would count as
        gone: silent for twice its time between checks and SILENCE_SLACK_SECONDS (a balancer stopped,
        as a stack going down stops its HAProxy first, sends nothing more to notice)."""
        watching = {}
        for balancer, at in self._last_check.items():
            gap = self._gap.get(balancer)
            gone = since + self.notice_seconds if gap is None else at + 2 * gap + SILENCE_SLACK_SECONDS
            if at >= since - self.notice_seconds and gone > time.monotonic():
                watching[balancer] = gone
        return watching

    def _noticed_by_all(self, since: float) -> bool:
        """Whether every balancer still watching this replica has had `notice_checks` refusals: at once
        when none is."""
        return all(self._refused.get(b, 0) >= self.notice_checks for b in self._watching(since))

    def shed(self, response: ASGIApp | None) -> None:
        """Answer new work with `response` instead of doing it; None: take work again."""
        self._shedding = response

    def turned_away(self) -> ASGIApp | None:
        """What new work is answered with instead of being done (draining, or shedding); None: do it."""
        return REFUSED if self.draining else self._shedding

    @contextmanager
    def counted(self) -> Iterator[None]:
        """A call in flight, until the block ends: the drain waits for it."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def run(self) -> None:
        """Drain; returns when it is time to exit."""
        self.draining = True
        started = time.monotonic()
        self.on_drain()
        log.info("draining: new requests are refused, %d calls in flight", self.in_flight)
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout_seconds)
        except TimeoutError:
            log.warning("drain bound reached with %d calls still in flight", self.in_flight)
        self._calls_done = True
        # Only a balancer's check can complete the notice (`health_checked`), so wait for that, not on a timer;
        # or until the balancers not yet told fall silent.
        since = self._notice_since = time.monotonic()
        while not self._noticed_by_all(since) and (left := since + self.notice_seconds - time.monotonic()) > 0:
            silent = min(self._watching(since).values(), default=since) - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._noticed.wait(), min(left, max(silent, 0.01)))
        log.info("drained in %.1f s", time.monotonic() - started)


REFUSED = refusal(503, "Replica draining; try another", code=-32000, retry_after=1)


class DrainGate:
    """ASGI middleware on the MCP endpoint: counts the calls in flight, and refuses new work while the
    replica drains (`REFUSED`) or sheds it (`Drain.shed`)."""

    def __init__(self, app: ASGIApp, *, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = self.drain.turned_away()
        if answer is not None:
            return await answer(scope, receive, send)
        if scope["method"] == "GET":
            # A GET stream may stay open as long as the client likes: not a call to wait for.
            return await self.app(scope, receive, send)
        with self.drain.counted():
            await self.app(scope, receive, send)


def hand_on(sig: int, previous: Any) -> None:
    """Give `sig` to the handler that had it before the drain took it (the server's: it shuts down)."""
    signal.signal(sig, previous)
    signal.raise_signal(sig)


def drain_on_sigterm(drain: Drain, *, stop: Callable[[], None] | None = None) -> None:
    """From now on SIGTERM drains first, then reaches the server serving the app, whichever it is: `stop`
    ends it once drained where the one running the app says (`HighAvailability.run`: a clean exit); None
    hands SIGTERM on to whichever server it was meant for.

    Called from the app's lifespan, after the server installed its own handlers:
    the drain runs in front of them, and a second SIGTERM (or SIGINT, which stays
    the server's) stops at once. Signals go to the main thread only; an app
    served from another thread (a test's in-process server) drains only when told.
    """
    if threading.current_thread() is not threading.main_thread():
        log.info("not serving from the main thread: SIGTERM will not drain")
        return
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:
        previous = signal.SIG_DFL

    def on_sigterm(sig: int, frame: FrameType | None) -> None:
        if drain.draining:
            return hand_on(sig, previous)
        drain.draining = True

        async def drain_then_exit() -> None:
            await drain.run()
            if stop is not None:
                stop()
            else:
                hand_on(sig, previous)

        loop.call_soon_threadsafe(lambda: tasks.add(loop.create_task(drain_then_exit())))

    tasks: set[asyncio.Task[None]] = set()
    signal.signal(signal.SIGTERM, on_sigterm)
