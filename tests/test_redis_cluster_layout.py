"""mcp_ha/stores/redis_cluster.py's key layout: what each script touches shares one slot, and what spans
sessions spreads over the cluster. Pure Python (redis-py's own slot function), no Redis."""

from __future__ import annotations

import uuid

import pytest
from redis.crc import key_slot

from mcp_ha.session_store import payer_of
from mcp_ha.stores.redis_cluster import INDEX_SHARDS, Layout

pytestmark = pytest.mark.quick

LAYOUT = Layout("mcp")


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_every_key_of_a_session_is_in_its_slot() -> None:
    for _ in range(50):
        sid = uuid.uuid4().hex
        keys = [
            LAYOUT.session(sid),
            LAYOUT.session(sid) + ":usage",
            LAYOUT.session(sid) + ":usage:bytes",
            LAYOUT.ops(sid) + ":5901234",  # an op bucket (_WRITE)
            LAYOUT.events(sid),
            LAYOUT.events(sid) + ":bytes",
            LAYOUT.copy(sid, "nonce"),
        ]
        assert {slot(k) for k in keys} == {slot(LAYOUT.session(sid))}, keys


def test_a_holders_sessions_and_its_payers_ledger_share_a_slot() -> None:
    for holder in ("principal:abc123", "addr:127.0.0.1", "addr:10.1.2.3"):
        ledger, expiries = LAYOUT.payer(payer_of(holder))
        assert slot(LAYOUT.holder(holder)) == slot(ledger) == slot(expiries)


def test_a_claim_and_its_ledger_share_a_slot_and_a_brace_cannot_end_a_tag_early() -> None:
    key = LAYOUT.claim("job:{weird}")
    assert slot(key) == slot(key + ":usage")
    assert LAYOUT.session("a}b").count("}") == 1  # the id's own brace is escaped


def test_sessions_and_index_shards_spread_over_every_primary_of_three() -> None:
    # redis-cli --cluster create gives three primaries these ranges.
    ranges = [(0, 5460), (5461, 10922), (10923, 16383)]

    def primary(s: int) -> int:
        return next(i for i, (low, high) in enumerate(ranges) if low <= s <= high)

    shards = LAYOUT.shards()
    assert len(shards) == len({slot(s) for s in shards}) == INDEX_SHARDS
    assert {primary(slot(s)) for s in shards} == {0, 1, 2}
    sessions = [primary(slot(LAYOUT.session(uuid.uuid4().hex))) for _ in range(300)]
    assert all(sessions.count(i) > 60 for i in range(3)), [sessions.count(i) for i in range(3)]
    # Every session's shard is one of the 16.
    assert {LAYOUT.shard(uuid.uuid4().hex) for _ in range(500)} == set(shards)


def test_each_session_publishes_to_its_slots_own_feed_channel_and_a_watch_can_name_every_one() -> None:
    """A session script may SPUBLISH only to a channel in its own slot; a watch subscribes to all of them."""
    feeds = LAYOUT.feeds("changes")
    assert len(feeds) == len(set(feeds)) == 16384
    assert sorted(slot(channel) for channel in feeds) == list(range(16384))
    for session_id in (str(uuid.uuid4()) for _ in range(200)):
        for key in (LAYOUT.session(session_id), LAYOUT.events(session_id)):
            channel = LAYOUT.feed("events", key)
            assert slot(channel) == slot(key) and channel in LAYOUT.feeds("events")
