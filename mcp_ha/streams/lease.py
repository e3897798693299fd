"""This replica's lease in the store: a call it streams is run again elsewhere once the lease lapses."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from ..session_store import SessionStore, StoreUnavailable

log = logging.getLogger(__name__)

# How often the replays of a quiet call on one replica ask, together, whether the replica running it lives.
RUNNER_CHECK_SECONDS = 0.25


class Runs:
    """This replica's lease in the store, renewed while it runs: a lapsed one means the replica is gone.

    The calls it streams are recorded under its run id (`SessionEvents.start_stream`), so a replay on
    another replica knows, within `ttl_seconds`, that nobody will finish them, and runs them again.
    """

    # A lease lapses a second after its last renewal: a replica whose loop stalls that long (four renewals
    # missed) is taken for gone, and a call it streams may run twice, its writes applied once (same key).
    def __init__(self, store: SessionStore, instance: str, *, ttl_seconds: int = 1, renew_seconds: float = 0.25):
        self.store = store
        # A restarted replica is another run: the calls of the one before are not its to finish.
        self.run_id = f"{instance}/{secrets.token_hex(6)}"
        self.ttl_seconds = ttl_seconds
        self.renew_seconds = renew_seconds
        # Each run asked about lately: when, and the answer (shared by everyone who asks meanwhile).
        self._asked: dict[str, tuple[float, asyncio.Future[bool]]] = {}
        # The re-runs this run has claimed, until their claims lapse: each is run once here, however many
        # replays here find its runner gone.
        self._claimed: dict[str, float] = {}

    async def keep_alive(self) -> None:
        while True:
            try:
                await self.store.claim(f"alive:{self.run_id}", self.run_id, self.ttl_seconds)
            except StoreUnavailable as exc:
                log.debug("lease not renewed: %s", exc)
            await asyncio.sleep(self.renew_seconds)

    async def alive(self, run_id: str) -> bool:
        """Whether `run_id`'s lease is live. The store is asked at most once per RUNNER_CHECK_SECONDS
        per run, however many replays here wait on its calls."""
        if run_id == self.run_id:
            return True
        now = time.monotonic()
        asked = self._asked.get(run_id)
        if asked is None or now - asked[0] >= RUNNER_CHECK_SECONDS:
            if len(self._asked) >= 256:  # runs no replay asked about lately (dead ones, mostly)
                self._asked = {r: a for r, a in self._asked.items() if now - a[0] < RUNNER_CHECK_SECONDS}
            answer = asyncio.ensure_future(self._ask(run_id))
            # Read here, so an answer nobody awaits any more (its replay ended) is not logged as lost.
            answer.add_done_callback(lambda done: done.cancelled() or done.exception())
            asked = self._asked[run_id] = (now, answer)
        # Shielded: one asker cancelled (its client gone) must not cancel the answer for the others.
        return await asyncio.shield(asked[1])

    async def _ask(self, run_id: str) -> bool:
        return await self.store.claimed(f"alive:{run_id}") == run_id

    async def claim_rerun(self, name: str, ttl_seconds: int) -> bool:
        """Take the re-run `name` for this run: True for one caller, here and on every replica."""
        now = time.monotonic()
        self._claimed = {n: until for n, until in self._claimed.items() if until > now}
        if name in self._claimed:
            return False  # another replay here runs it again
        self._claimed[name] = now + ttl_seconds  # before the store answers: a replay here may ask meanwhile
        try:
            taken = await self.store.claim(name, self.run_id, ttl_seconds)
        except BaseException:
            del self._claimed[name]
            raise
        if not taken:
            del self._claimed[name]
        return taken

    async def runner_of(self, call: str, first: str) -> str:
        """The latest run of a call that `first` ran first: each re-run is claimed by the one who runs it."""
        runner = first
        for _ in range(64):  # each link is a replica that died; far fewer in practice
            after = await self.store.claimed(f"rerun:{call}:{runner}")
            if after is None:
                return runner
            runner = after
        return runner
