"""The SessionStore contract: one suite, run against every store.

A store for another backend passes this suite or it is not a SessionStore.
The Redis store runs against a real redis-server, and again through Sentinel
with every write waiting for a Redis replica's acknowledgement.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from conftest import free_ports, move_slot, slot_owner
from redis.crc import key_slot

from mcp_ha.ops.stack import Stack
from mcp_ha.session_store import (
    OWNER,
    RESYNC,
    Conflict,
    Fenced,
    LimitExceeded,
    Op,
    OpReused,
    Resume,
    Session,
    SessionStore,
    StoreFull,
    StoreUnavailable,
    Transaction,
    is_event_id,
    is_session_id,
    mint_event_id,
)
from mcp_ha.stores.memory_store import InMemorySessionStore
from mcp_ha.stores.redis_store import CLUSTER_LIBRARY, LIBRARY, RedisSessionStore
from mcp_ha.stores.replica_wait import SHORT_RECOUNT_SECONDS, online_replicas


def new_id() -> str:
    return uuid.uuid4().hex


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sentinels_of(stack: Stack) -> list[tuple[str, int]]:
    return [(stack.config.host, port) for port in stack.config.sentinel_ports]


def nodes_of(stack: Stack) -> list[tuple[str, int]]:
    return [(stack.config.host, port) for port in stack.config.cluster_ports]


# The stores' parameters beyond memory, marked by what their fixtures start (`getfixturevalue` below, which
# conftest's hook cannot see): the memory cases stay quick.
REDIS = pytest.param("redis", marks=pytest.mark.redis)
SENTINEL = pytest.param("sentinel", marks=[pytest.mark.redis, pytest.mark.haproxy, pytest.mark.slow])
CLUSTER = pytest.param("cluster", marks=[pytest.mark.redis, pytest.mark.slow])


def auth_of(stack: Stack) -> dict[str, str]:
    """The replicas' credentials, for the servers and the sentinels."""
    return {**stack.config.redis_auth, **stack.config.sentinel_auth}


@pytest.fixture(params=["memory", REDIS, SENTINEL, CLUSTER])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield InMemorySessionStore()
        return
    # A prefix of its own per test keeps the tests' sessions and counts apart.
    prefix = f"mcp:t{new_id()[:8]}"
    if request.param == "redis":
        s = RedisSessionStore(
            request.getfixturevalue("redis_stack").config.redis_url,
            prefix=prefix,
            **request.getfixturevalue("redis_stack").config.redis_auth,
        )
    elif request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        s = RedisSessionStore(cluster_nodes=nodes_of(cluster), prefix=prefix, **cluster.config.redis_auth)
    else:
        sentinel_stack = request.getfixturevalue("sentinel_stack")
        s = RedisSessionStore(
            sentinels=sentinels_of(sentinel_stack), **auth_of(sentinel_stack), prefix=prefix, wait_replicas=1
        )
    yield s
    await s.aclose()


async def test_get_of_unset_entry_is_none(store: SessionStore) -> None:
    assert await store.get(new_id(), "counter") is None


async def test_set_then_get_round_trips_json_values(store: SessionStore) -> None:
    sid = new_id()
    value = {"total_score": 9.0, "items": [1, "two", None, True], "text": "héllo ✓ \n \x00"}
    await store.set(sid, "analysis", value)
    assert await store.get(sid, "analysis") == value
    await store.set(sid, "analysis", 3)
    assert await store.get(sid, "analysis") == 3


async def test_incr_starts_at_zero_and_returns_new_value(store: SessionStore) -> None:
    sid = new_id()
    assert await store.incr(sid, "counter") == 1
    assert await store.incr(sid, "counter", 5) == 6
    assert await store.get(sid, "counter") == 6


async def test_concurrent_increments_are_never_lost(store: SessionStore) -> None:
    sid = new_id()
    results = await asyncio.gather(*(store.incr(sid, "counter") for _ in range(200)))
    assert await store.get(sid, "counter") == 200
    assert sorted(results) == list(range(1, 201))


async def test_concurrent_appends_are_never_lost(store: SessionStore) -> None:
    sid = new_id()
    lengths = await asyncio.gather(*(store.append(sid, "notes", f"note {i}") for i in range(200)))
    notes = await store.get(sid, "notes")
    assert sorted(lengths) == list(range(1, 201))
    assert sorted(notes) == sorted(f"note {i}" for i in range(200))


async def test_append_keeps_insertion_order(store: SessionStore) -> None:
    sid = new_id()
    for i, note in enumerate(["first", "sec,ond]", 'th"ird', "[]"], start=1):
        assert await store.append(sid, "notes", note) == i
    assert await store.get(sid, "notes") == ["first", "sec,ond]", 'th"ird', "[]"]


async def test_incr_on_a_non_integer_is_a_type_error(store: SessionStore) -> None:
    sid = new_id()
    await store.append(sid, "notes", "x")
    with pytest.raises(TypeError):
        await store.incr(sid, "notes")
    assert await store.get(sid, "notes") == ["x"]


async def test_append_to_a_non_list_is_a_type_error(store: SessionStore) -> None:
    sid = new_id()
    await store.incr(sid, "counter")
    with pytest.raises(TypeError):
        await store.append(sid, "counter", "x")
    assert await store.get(sid, "counter") == 1


async def test_items_returns_every_entry(store: SessionStore) -> None:
    sid = new_id()
    assert await store.items(sid) == {}
    await store.incr(sid, "counter")
    await store.append(sid, "notes", "a")
    assert await store.items(sid) == {"counter": 1, "notes": ["a"]}


async def test_sessions_are_isolated(store: SessionStore) -> None:
    a, b = new_id(), new_id()
    await store.incr(a, "counter")
    await store.append(a, "notes", "only a")
    assert await store.items(b) == {}


async def test_copy_copies_every_entry_and_counts_them(store: SessionStore) -> None:
    old, new = new_id(), new_id()
    await store.incr(old, "counter", 4)
    await store.append(old, "notes", "kept")
    await store.set(new, "unrelated", "stays")
    assert await store.copy(old, new) == 2
    assert await store.items(new) == {"counter": 4, "notes": ["kept"], "unrelated": "stays"}
    # The copy is independent of its source.
    await store.incr(new, "counter")
    assert await store.get(old, "counter") == 4


async def test_copy_from_unknown_session_copies_nothing(store: SessionStore) -> None:
    new = new_id()
    assert await store.copy(new_id(), new) == 0
    assert await store.items(new) == {}


@pytest.mark.parametrize("pattern", ["*", "?" * 32, "[0-9a-f]*", "*:*", ""])
async def test_ids_are_data_never_patterns(store: SessionStore, pattern: str) -> None:
    victim, attacker = new_id(), new_id()
    await store.incr(victim, "counter", 7)
    await store.append(victim, "notes", "secret")
    assert await store.copy(pattern, attacker) == 0
    assert await store.items(attacker) == {}


async def test_count_sessions_counts_touched_sessions(store: SessionStore) -> None:
    before = await store.count_sessions()
    ids = [new_id() for _ in range(5)]
    for sid in ids:
        await store.touch(sid)
    await store.incr(ids[0], "counter")
    assert await store.count_sessions() == before + 5


async def test_session_wrapper_binds_one_session(store: SessionStore) -> None:
    session = Session(store, new_id(), epoch=None, call=None, owner=None)
    other = Session(store, new_id(), epoch=None, call=None, owner=None)
    assert await session.get("counter", 0) == 0
    assert await session.incr("counter") == 1
    assert await session.append("notes", "n") == 1
    await other.set("x", 1)
    assert await other.copy_from(session.id) == 2
    assert await other.items() == {"x": 1, "counter": 1, "notes": ["n"]}


RECORD = {"client": {"name": "c", "version": "1"}, "capabilities": {}, "version": "2025-11-25"}


async def test_a_recorded_session_can_be_adopted_with_a_higher_epoch(store: SessionStore) -> None:
    sid = new_id()
    assert await store.open_session(sid, RECORD) == 1
    assert await store.adopt_session(sid) == (RECORD, 2)
    assert await store.adopt_session(sid) == (RECORD, 3)


async def test_a_session_record_reads_back_without_adopting(store: SessionStore) -> None:
    sid = new_id()
    assert await store.session_record(sid) is None
    await store.open_session(sid, RECORD)
    assert await store.session_record(sid) == RECORD
    assert await store.adopt_session(sid) == (RECORD, 2)  # reading it moved no epoch
    await store.end_session(sid)
    assert await store.session_record(sid) is None


async def test_an_unrecorded_or_ended_session_cannot_be_adopted(store: SessionStore) -> None:
    sid = new_id()
    assert await store.adopt_session(sid) is None
    await store.open_session(sid, RECORD)
    assert await store.end_session(sid) is True
    assert await store.adopt_session(sid) is None
    assert await store.end_session(sid) is False


async def test_a_sessions_owner_outlives_its_record_as_long_as_its_state(store: SessionStore) -> None:
    sid, unowned = new_id(), new_id()
    assert await store.owner(sid) is None
    await store.open_session(sid, {**RECORD, "owner": "a" * 32})
    await store.open_session(unowned, RECORD)
    assert await store.owner(sid) == "a" * 32
    assert await store.owner(unowned) is None
    assert await store.session_record(sid) == {**RECORD, "owner": "a" * 32}
    await store.incr(sid, "counter")
    assert await store.end_session(sid) is True
    # The state stays after the session ends (resume_session reads it), so its owner does too.
    assert (await store.session_record(sid), await store.owner(sid)) == (None, "a" * 32)
    assert await store.items(sid) == {"counter": 1}
    assert await store.count_sessions() >= 1
    assert await store.adopt_session(sid) is None


async def test_a_stale_owner_cannot_write(store: SessionStore) -> None:
    sid = new_id()
    first = await store.open_session(sid, RECORD)
    assert await store.incr(sid, "counter", epoch=first) == 1
    _, second = await store.adopt_session(sid)
    for stale_write in (
        store.incr(sid, "counter", epoch=first),
        store.append(sid, "notes", "late", epoch=first),
        store.set(sid, "analysis", 1, epoch=first),
        store.copy(new_id(), sid, epoch=first),
        store.delete(sid, "counter", epoch=first),
        store.apply(sid, [("incr", "counter", 1)], expect={}, result="late", epoch=first),
    ):
        with pytest.raises(Fenced):
            await stale_write
    assert await store.items(sid) == {"counter": 1}
    assert await store.incr(sid, "counter", epoch=second) == 2


async def test_writes_to_an_ended_session_are_fenced(store: SessionStore) -> None:
    sid = new_id()
    epoch = await store.open_session(sid, RECORD)
    await store.end_session(sid)
    with pytest.raises(Fenced):
        await store.incr(sid, "counter", epoch=epoch)


async def test_a_repeated_op_is_applied_once_and_replays_its_result(store: SessionStore) -> None:
    sid = new_id()
    assert await store.incr(sid, "counter", op=Op("call-1:1", "d")) == 1
    assert await store.incr(sid, "counter", op=Op("call-1:1", "d")) == 1
    assert await store.append(sid, "notes", "a", op=Op("call-2:1", "d")) == 1
    assert await store.append(sid, "notes", "a", op=Op("call-2:1", "d")) == 1
    await store.set(sid, "x", 1, op=Op("call-3:1", "d"))
    await store.set(sid, "x", 2, op=Op("call-3:1", "d"))
    assert await store.items(sid) == {"counter": 1, "notes": ["a"], "x": 1}
    assert await store.incr(sid, "counter", op=Op("call-4:1", "d")) == 2


async def test_concurrent_repeats_of_one_op_apply_once(store: SessionStore) -> None:
    sid = new_id()
    results = await asyncio.gather(*(store.incr(sid, "counter", op=Op("same", "d")) for _ in range(50)))
    assert set(results) == {1}
    assert await store.get(sid, "counter") == 1


async def test_op_ids_belong_to_one_session(store: SessionStore) -> None:
    a, b = new_id(), new_id()
    assert await store.incr(a, "counter", op=Op("k", "d")) == 1
    assert await store.incr(b, "counter", op=Op("k", "d")) == 1
    assert await store.get(b, "counter") == 1


async def test_a_replayed_op_is_not_fenced(store: SessionStore) -> None:
    """A retry of a write that did apply returns its result even after adoption moved on."""
    sid = new_id()
    first = await store.open_session(sid, RECORD)
    assert await store.incr(sid, "counter", epoch=first, op=Op("k", "d")) == 1
    await store.adopt_session(sid)
    assert await store.incr(sid, "counter", epoch=first, op=Op("k", "d")) == 1


async def test_a_call_key_sent_with_another_call_is_refused_and_applies_nothing(store: SessionStore) -> None:
    sid = new_id()
    assert await store.append(sid, "notes", "first", op=Op("k:1", "digest-a")) == 1
    for other_call in (
        store.append(sid, "notes", "second", op=Op("k:1", "digest-b")),
        store.incr(sid, "counter", op=Op("k:1", "digest-b", write="a write the first call never made")),
    ):
        with pytest.raises(OpReused):
            await other_call
    assert await store.items(sid) == {"notes": ["first"]}
    assert await store.append(sid, "notes", "first", op=Op("k:1", "digest-a")) == 1


@pytest.mark.parametrize("key", ["", ".epoch", ".client"])
async def test_keys_starting_with_a_dot_belong_to_the_store(store: SessionStore, key: str) -> None:
    sid = new_id()
    await store.open_session(sid, RECORD)
    for misuse in (
        store.get(sid, key),
        store.set(sid, key, 1),
        store.incr(sid, key),
        store.append(sid, key, 1),
        store.delete(sid, key),
        store.apply(sid, [("set", key, 1)], expect={}, result=None),
        store.apply(sid, [("set", "x", 1)], expect={key: None}, result=None),
    ):
        with pytest.raises(ValueError):
            await misuse
    assert await store.items(sid) == {}
    assert await store.session_record(sid) == RECORD


async def test_copy_and_items_carry_state_never_the_record(store: SessionStore) -> None:
    source, target = new_id(), new_id()
    await store.open_session(source, RECORD)
    await store.incr(source, "counter")
    target_record = {**RECORD, "client": {"name": "other", "version": "2"}}
    epoch = await store.open_session(target, target_record)
    assert await store.copy(source, target, epoch=epoch) == 1
    assert await store.items(target) == {"counter": 1}
    assert await store.session_record(target) == target_record
    assert await store.adopt_session(target) == (target_record, epoch + 1)


async def test_session_wrapper_numbers_the_writes_of_a_call(store: SessionStore) -> None:
    sid = new_id()
    epoch = await store.open_session(sid, RECORD)
    for _ in range(2):  # the same call, retried: every write replays
        session = Session(store, sid, epoch=epoch, call=("call-7", "digest"), owner=None)
        assert await session.incr("counter") == 1
        assert await session.incr("counter") == 2
    assert await store.get(sid, "counter") == 2


async def test_a_retry_that_skips_a_write_still_replays_the_others(store: SessionStore) -> None:
    """First run: set then incr. The retry reads differently and skips the set: its incr must still replay."""
    sid = new_id()
    first = Session(store, sid, epoch=None, call=("call-8", "digest"), owner=None)
    await first.set("flag", True)
    assert await first.incr("counter") == 1
    retry = Session(store, sid, epoch=None, call=("call-8", "digest"), owner=None)
    assert await retry.incr("counter") == 1
    assert await store.items(sid) == {"flag": True, "counter": 1}


async def test_counters_stay_exact_integers_past_the_14_digits_lua_prints(store: SessionStore) -> None:
    sid = new_id()
    assert await store.incr(sid, "counter", 123_456_789_012_345) == 123_456_789_012_345
    assert await store.incr(sid, "counter") == 123_456_789_012_346
    # Past 2^53 too, where a double (Lua's only number) could no longer hold them.
    assert await store.incr(sid, "big", 2**62 + 1) == 2**62 + 1
    assert await store.incr(sid, "big", 2**62 - 2) == 2**63 - 1
    assert await store.incr(sid, "big", -(2**63 - 1)) == 0
    assert await store.incr(sid, "big", -(2**63)) == -(2**63)
    assert await store.get(sid, "big") == -(2**63)


# -- delete, apply, recall, apply_once ------------------------------------------------------


async def test_delete_removes_an_entry_and_says_whether_there_was_one(store: SessionStore) -> None:
    sid = new_id()
    await store.set(sid, "x", {"a": 1})
    await store.incr(sid, "counter")
    assert await store.delete(sid, "x") is True
    assert await store.delete(sid, "x") is False
    assert await store.delete(sid, "never") is False
    assert await store.get(sid, "x") is None
    assert await store.items(sid) == {"counter": 1}
    # A deleted counter starts again at zero.
    assert await store.delete(sid, "counter") is True
    assert await store.incr(sid, "counter") == 1


async def test_a_repeated_delete_replays_its_first_answer(store: SessionStore) -> None:
    sid = new_id()
    await store.set(sid, "x", 1)
    assert await store.delete(sid, "x", op=Op("k", "d")) is True
    await store.set(sid, "x", 2)
    assert await store.delete(sid, "x", op=Op("k", "d")) is True  # replayed: not deleted again
    assert await store.get(sid, "x") == 2
    assert await store.delete(sid, "missing", op=Op("k", "d", write="2")) is False
    assert await store.delete(sid, "missing", op=Op("k", "d", write="2")) is False
    with pytest.raises(OpReused):
        await store.delete(sid, "x", op=Op("k", "other digest"))
    assert await store.get(sid, "x") == 2
    assert await store.recall(sid, Op("k", "d")) == (True, True)


async def test_delete_and_apply_mark_the_session_live(store: SessionStore) -> None:
    before = await store.count_sessions()
    await store.delete(new_id(), "x")
    await store.apply(new_id(), [], expect={}, result=None)
    await store.apply(new_id(), [("set", "x", 1)], expect={}, result=None, op=Op("k", "d"))
    assert await store.count_sessions() == before + 3


async def test_apply_applies_every_write_in_order_and_answers_its_result(store: SessionStore) -> None:
    sid = new_id()
    await store.set(sid, "gone", "soon")
    await store.set(sid, "kept", "as is")
    writes = [
        ("set", "counter", 5),
        ("incr", "counter", 2),
        ("incr", "fresh", 3),
        ("append", "notes", {"n": 1}),
        ("append", "notes", "two"),
        ("delete", "gone", None),
        ("delete", "never", None),
        ("set", "temp", 1),
        ("delete", "temp", None),
        ("delete", "recreated", None),
        ("append", "recreated", 1),
        ("set", "value", {"b": [1.5, None], "a": "x"}),
    ]
    result = {"answer": [1, "two"], "none": None}
    assert await store.apply(sid, writes, expect={}, result=result) == result
    assert await store.items(sid) == {
        "kept": "as is",
        "counter": 7,
        "fresh": 3,
        "notes": [{"n": 1}, "two"],
        "recreated": [1],
        "value": {"b": [1.5, None], "a": "x"},
    }
    assert await store.apply(sid, [], expect={}, result=None) is None
    assert await store.apply(sid, [("incr", "counter", -7)], expect={"counter": 7}, result=3.5) == 3.5
    assert await store.get(sid, "counter") == 0


async def test_apply_checks_expected_entries_against_what_is_stored(store: SessionStore) -> None:
    sid = new_id()
    value = {"b": [1.5, None, "é"], "a": {"nested": True}}
    await store.set(sid, "value", value)
    await store.incr(sid, "counter", 3)
    await store.append(sid, "notes", "a")
    await store.append(sid, "notes", {"k": [1]})
    await store.set(sid, "nothing", None)
    # What the store holds, as a reader got it back: no conflict.
    expect = {
        "value": await store.get(sid, "value"),
        "counter": 3,
        "notes": ["a", {"k": [1]}],
        "absent": None,
        "nothing": None,
    }
    assert await store.apply(sid, [("incr", "counter", 1)], expect=expect, result="ok") == "ok"
    assert await store.get(sid, "counter") == 4


@pytest.mark.parametrize(
    "expect",
    [
        {"counter": 1},  # it moved on to 2
        {"counter": 2, "notes": ["a"]},  # one entry still as read, another not
        {"absent": None, "notes": None},  # read as absent, now there
        {"counter": "2"},  # the same text, another JSON value
    ],
)
async def test_apply_refuses_when_an_expected_entry_changed_and_applies_nothing(
    store: SessionStore, expect: dict
) -> None:
    sid = new_id()
    await store.incr(sid, "counter", 2)
    await store.append(sid, "notes", "a")
    await store.append(sid, "notes", "b")
    with pytest.raises(Conflict):
        await store.apply(
            sid,
            [("set", "x", 1), ("incr", "counter", 1), ("delete", "notes", None)],
            expect=expect,
            result="r",
            op=Op("k", "d"),
        )
    assert await store.items(sid) == {"counter": 2, "notes": ["a", "b"]}
    assert await store.recall(sid, Op("k", "d")) == (False, None)  # nothing recorded: a retry applies it
    assert await store.apply(sid, [("set", "x", 1)], expect={"counter": 2}, result="r", op=Op("k", "d")) == "r"
    assert await store.get(sid, "x") == 1


@pytest.mark.parametrize(
    "writes",
    [
        [("set", "x", 1), ("incr", "notes", 1)],  # a list is no integer
        [("append", "notes", "c"), ("append", "counter", "c")],  # an integer is no list
        [("set", "x", 1), ("set", "counter", "text"), ("incr", "counter", 1)],  # as an earlier write left it
        [("incr", "fresh", 1), ("append", "fresh", "c")],
        [("append", "fresh", "c"), ("incr", "fresh", 1)],
        [("delete", "counter", None), ("set", "counter", 1.5), ("incr", "counter", 1)],
    ],
)
async def test_a_write_of_the_wrong_type_leaves_the_whole_apply_unapplied(store: SessionStore, writes: list) -> None:
    sid = new_id()
    await store.incr(sid, "counter", 2)
    await store.append(sid, "notes", "a")
    with pytest.raises(TypeError):
        await store.apply(sid, writes, expect={"counter": 2}, result="r", op=Op("k", "d"))
    assert await store.items(sid) == {"counter": 2, "notes": ["a"]}
    assert await store.recall(sid, Op("k", "d")) == (False, None)


async def test_a_type_checked_write_sees_the_writes_before_it(store: SessionStore) -> None:
    sid = new_id()
    await store.set(sid, "counter", "text")
    await store.incr(sid, "notes")
    writes = [("delete", "counter", None), ("incr", "counter", 2), ("set", "notes", []), ("append", "notes", 1)]
    assert await store.apply(sid, writes, expect={}, result=None) is None
    assert await store.items(sid) == {"counter": 2, "notes": [1]}


async def test_a_repeated_apply_replays_its_result_and_applies_nothing(store: SessionStore) -> None:
    sid = new_id()
    op = Op("call-1", "digest", "apply::1")
    first = await store.apply(sid, [("incr", "counter", 1)], expect={"counter": None}, result={"n": 1}, op=op)
    assert first == {"n": 1}
    # Replayed even though the writes, the expectations and the result differ, and no longer hold.
    again = await store.apply(
        sid, [("incr", "counter", 5), ("set", "x", 1)], expect={"counter": 40}, result={"n": 99}, op=op
    )
    assert again == {"n": 1}
    assert await store.items(sid) == {"counter": 1}
    assert await store.recall(sid, op) == (True, {"n": 1})
    # Another write of the same call applies.
    assert await store.apply(sid, [("incr", "counter", 1)], expect={}, result=2, op=Op("call-1", "digest", "2")) == 2
    assert await store.get(sid, "counter") == 2


async def test_an_apply_with_another_calls_digest_is_refused_and_applies_nothing(store: SessionStore) -> None:
    sid = new_id()
    assert await store.apply(sid, [("set", "x", 1)], expect={}, result="first", op=Op("k", "digest-a")) == "first"
    for write in ("1", "a write the first call never made"):
        with pytest.raises(OpReused):
            await store.apply(
                sid, [("set", "x", 2), ("set", "y", 2)], expect={}, result="second", op=Op("k", "digest-b", write)
            )
    assert await store.items(sid) == {"x": 1}


async def test_a_stale_apply_is_fenced_and_its_replay_is_not(store: SessionStore) -> None:
    sid = new_id()
    first = await store.open_session(sid, RECORD)
    op = Op("k", "d", "apply::1")
    assert await store.apply(sid, [("incr", "counter", 1)], expect={}, result="done", epoch=first, op=op) == "done"
    _, second = await store.adopt_session(sid)
    # A retry of the apply that did commit answers, however the epoch moved on...
    assert await store.apply(sid, [("incr", "counter", 1)], expect={}, result="x", epoch=first, op=op) == "done"
    # ...and a new one from the stale owner is refused, expectations unchecked.
    with pytest.raises(Fenced):
        await store.apply(
            sid, [("incr", "counter", 1)], expect={"counter": 99}, result="x", epoch=first, op=Op("k", "d", "apply::2")
        )
    assert await store.items(sid) == {"counter": 1}
    assert await store.apply(sid, [("incr", "counter", 1)], expect={"counter": 1}, result="y", epoch=second) == "y"
    assert await store.get(sid, "counter") == 2


async def test_recall_tells_whether_an_op_was_applied_and_its_result(store: SessionStore) -> None:
    sid = new_id()
    before = await store.count_sessions()
    assert await store.recall(sid, Op("k", "d", "apply::1")) == (False, None)
    assert await store.count_sessions() == before  # a read that wrote nothing, not even the index
    assert await store.apply(
        sid, [("set", "x", 1)], expect={}, result=[1, {"a": None}], op=Op("k", "d", "apply::1")
    ) == [1, {"a": None}]
    assert await store.recall(sid, Op("k", "d", "apply::1")) == (True, [1, {"a": None}])
    assert await store.recall(sid, Op("k", "d", "apply::2")) == (False, None)  # the call's other writes
    # A single write's op is recalled as well, with the write's answer.
    assert await store.incr(sid, "counter", 4, op=Op("k", "d", "incr:counter:1")) == 4
    assert await store.recall(sid, Op("k", "d", "incr:counter:1")) == (True, 4)
    await store.set(sid, "y", 1, op=Op("k", "d", "set:y:1"))
    assert await store.recall(sid, Op("k", "d", "set:y:1")) == (True, None)
    with pytest.raises(OpReused):
        await store.recall(sid, Op("k", "another digest", "apply::1"))
    assert await store.recall(new_id(), Op("k", "d", "apply::1")) == (False, None)  # op records are per session


def counter_block(runs: list[int], meddle: Callable[[], Awaitable[None]] | None = None):
    """An apply_once block: reads the counter, stages it plus one and a note, answers what it saw."""

    async def block(tx: Transaction) -> dict:
        runs.append(1)
        seen = await tx.get("counter", 0)
        if meddle is not None:
            await meddle()  # another writer, between the block's read and its commit
        tx.set("counter", seen + 1)
        tx.append("log", f"saw {seen}")
        return {"saw": seen}

    return block


async def test_apply_once_runs_its_block_once_per_call(store: SessionStore) -> None:
    sid = new_id()
    epoch = await store.open_session(sid, RECORD)
    runs: list[int] = []
    first = Session(store, sid, epoch=epoch, call=("call-1", "digest"), owner=None)
    assert await first.apply_once(counter_block(runs)) == {"saw": 0}
    assert len(runs) == 1
    # The call retried (say, on another replica): the block does not run, its answer is the recorded one.
    retry = Session(store, sid, epoch=epoch, call=("call-1", "digest"), owner=None)
    assert await retry.apply_once(counter_block(runs)) == {"saw": 0}
    assert len(runs) == 1
    assert await store.items(sid) == {"counter": 1, "log": ["saw 0"]}
    # Another call runs it again.
    other = Session(store, sid, epoch=epoch, call=("call-2", "digest"), owner=None)
    assert await other.apply_once(counter_block(runs)) == {"saw": 1}
    assert len(runs) == 2
    assert await store.items(sid) == {"counter": 2, "log": ["saw 0", "saw 1"]}
    # The same key sent with another call is refused, and the block does not run.
    with pytest.raises(OpReused):
        await Session(store, sid, epoch=epoch, call=("call-1", "other"), owner=None).apply_once(counter_block(runs))
    assert len(runs) == 2


async def test_apply_once_runs_its_block_again_when_what_it_read_changed(store: SessionStore) -> None:
    sid = new_id()
    runs: list[int] = []
    meddled: list[int] = []

    async def meddle_once() -> None:
        if not meddled:
            meddled.append(1)
            await store.incr(sid, "counter", 10)

    session = Session(store, sid, epoch=None, call=("call-1", "digest"), owner=None)
    assert await session.apply_once(counter_block(runs, meddle_once)) == {"saw": 10}
    assert len(runs) == 2
    assert await store.items(sid) == {"counter": 11, "log": ["saw 10"]}


async def test_apply_once_gives_up_with_a_conflict_after_its_attempts(store: SessionStore) -> None:
    sid = new_id()
    runs: list[int] = []

    async def meddle() -> None:
        await store.incr(sid, "counter")

    session = Session(store, sid, epoch=None, call=("call-1", "digest"), owner=None)
    with pytest.raises(Conflict):
        await session.apply_once(counter_block(runs, meddle), attempts=3)
    assert len(runs) == 3
    assert await store.items(sid) == {"counter": 3}  # the meddler's increments, none of the block's writes
    assert await store.recall(sid, Op("call-1", "digest", "apply::1")) == (False, None)


async def test_apply_once_without_a_call_applies_atomically_each_time(store: SessionStore) -> None:
    sid = new_id()
    runs: list[int] = []
    session = Session(store, sid, epoch=None, call=None, owner=None)
    assert await session.apply_once(counter_block(runs)) == {"saw": 0}
    assert await session.apply_once(counter_block(runs)) == {"saw": 1}
    assert len(runs) == 2
    assert await store.items(sid) == {"counter": 2, "log": ["saw 0", "saw 1"]}


async def test_concurrent_apply_once_blocks_lose_no_update(store: SessionStore) -> None:
    sid = new_id()
    runs: list[int] = []
    sessions = [Session(store, sid, epoch=None, call=(f"call-{i}", "d"), owner=None) for i in range(10)]
    answers = await asyncio.gather(*(s.apply_once(counter_block(runs), attempts=50) for s in sessions))
    assert sorted(answer["saw"] for answer in answers) == list(range(10))
    assert await store.get(sid, "counter") == 10


async def test_apply_once_of_a_stale_owner_is_fenced(store: SessionStore) -> None:
    sid = new_id()
    first = await store.open_session(sid, RECORD)
    await store.adopt_session(sid)
    runs: list[int] = []
    with pytest.raises(Fenced):
        await Session(store, sid, epoch=first, call=("c", "d"), owner=None).apply_once(counter_block(runs))
    assert await store.items(sid) == {}


async def run_steps(session: Session, steps: int, *, die_after: int | None = None) -> list[int]:
    """A job of `steps` steps that resumes from its checkpoint: each step counts in `done` and logs its
    number; a run that dies after `die_after` steps raises. The steps this run did."""
    resumed = await session.resume()
    start = resumed.checkpoint or 0
    ran = []
    for step in range(start + 1, steps + 1):
        await session.incr("done")
        await session.append("log", step)
        await session.checkpoint(step)
        ran.append(step)
        if step == die_after:
            raise RuntimeError("the replica died")
    return ran


async def test_a_rerun_resumes_from_its_checkpoint_and_applies_each_write_once(store: SessionStore) -> None:
    sid = new_id()
    epoch = await store.open_session(sid, RECORD)
    first = Session(store, sid, epoch=epoch, call=("job-1", "digest"), owner=None)
    with pytest.raises(RuntimeError):
        await run_steps(first, 10, die_after=6)
    assert await first.resume() == Resume(rerun=False)  # what it was told
    # The re-run (another replica, same call) knows it is one, and starts after step 6.
    again = Session(store, sid, epoch=epoch, call=("job-1", "digest"), owner=None)
    assert await run_steps(again, 10) == [7, 8, 9, 10]
    assert await again.resume() == Resume(rerun=True, checkpoint=6)
    # Its writes after the checkpoint applied, once: counted as the first run would have counted them.
    assert await store.items(sid) == {"done": 10, "log": list(range(1, 11))}
    # A third run of the finished call does nothing again: every write replays.
    third = Session(store, sid, epoch=epoch, call=("job-1", "digest"), owner=None)
    assert await run_steps(third, 10) == []
    assert await store.items(sid) == {"done": 10, "log": list(range(1, 11))}
    # Another call starts afresh.
    other = Session(store, sid, epoch=epoch, call=("job-2", "digest"), owner=None)
    assert await run_steps(other, 2) == [1, 2]
    assert await store.get(sid, "done") == 12


@pytest.mark.parametrize("died_after", [1, 2, 3, 5, 8, 13])
async def test_resume_finds_the_latest_checkpoint_however_many(store: SessionStore, died_after: int) -> None:
    sid = new_id()
    first = Session(store, sid, epoch=None, call=("job", "d"), owner=None)
    with pytest.raises(RuntimeError):
        await run_steps(first, 20, die_after=died_after)
    again = Session(store, sid, epoch=None, call=("job", "d"), owner=None)
    assert await run_steps(again, 20) == list(range(died_after + 1, 21))
    assert await store.items(sid) == {"done": 20, "log": list(range(1, 21))}


async def test_a_rerun_that_checkpointed_nothing_starts_over_and_replays_its_writes(store: SessionStore) -> None:
    sid = new_id()
    first = Session(store, sid, epoch=None, call=("job", "d"), owner=None)
    assert await first.resume() == Resume(rerun=False)
    await first.incr("done")
    again = Session(store, sid, epoch=None, call=("job", "d"), owner=None)
    assert await again.resume() == Resume(rerun=True, checkpoint=None)
    assert await again.incr("done") == 1  # the first run's write, replayed
    assert await store.get(sid, "done") == 1


async def test_without_a_call_nothing_resumes(store: SessionStore) -> None:
    sid = new_id()
    for _ in range(2):
        session = Session(store, sid, epoch=None, call=None, owner=None)
        assert await run_steps(session, 3) == [1, 2, 3]
    assert await store.get(sid, "done") == 6
    assert await store.items(sid) == {"done": 6, "log": [1, 2, 3, 1, 2, 3]}


async def test_a_stale_owners_checkpoint_is_fenced(store: SessionStore) -> None:
    sid = new_id()
    first = await store.open_session(sid, RECORD)
    stale = Session(store, sid, epoch=first, call=("job", "d"), owner=None)
    await store.adopt_session(sid)
    with pytest.raises(Fenced):
        await stale.checkpoint(1)


async def test_copy_from_copies_only_another_session_of_the_same_owner(store: SessionStore) -> None:
    mine, theirs, also_mine, unowned = new_id(), new_id(), new_id(), new_id()
    for sid, owner in ((mine, "alice"), (theirs, "bob"), (also_mine, "alice"), (unowned, None)):
        await store.open_session(sid, {**RECORD, "owner": owner} if owner else RECORD)
        await store.incr(sid, f"from {owner}")
    session = Session(store, mine, epoch=None, call=None, owner="alice")
    for not_copied in ("*", mine.upper(), "", mine, theirs, unowned, new_id()):
        assert await session.copy_from(not_copied) == 0
    assert await store.items(mine) == {"from alice": 1}
    assert await session.copy_from(also_mine) == 1
    # Unauthenticated, a session copies only unowned ones.
    anonymous = Session(store, new_id(), epoch=None, call=None, owner=None)
    assert await anonymous.copy_from(also_mine) == 0
    assert await anonymous.copy_from(unowned) == 1


@pytest.mark.quick
async def test_memory_store_slides_the_ttl_on_delete_and_apply() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(ttl_seconds=60, clock=clock)
    deleted, applied = new_id(), new_id()
    for sid in (deleted, applied):
        await store.set(sid, "x", 1)
        await store.set(sid, "y", 1)
    clock.now += 45
    await store.delete(deleted, "x")
    await store.apply(applied, [("delete", "x", None)], expect={}, result=None)
    clock.now += 30
    assert await store.count_sessions() == 2
    assert await store.items(deleted) == await store.items(applied) == {"y": 1}


async def test_redis_store_slides_the_ttl_on_delete_and_apply_and_keeps_compact_json(redis_stack: Stack) -> None:
    prefix = f"mcp:t{new_id()[:8]}"
    store = RedisSessionStore(
        redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=prefix, ttl_seconds=600
    )
    cli = ["redis-cli", "-p", str(redis_stack.config.redis_port)]

    def redis(*args: str) -> str:
        return subprocess.run(
            [*cli, *args], capture_output=True, text=True, check=True, env=redis_stack.config.redis_cli_env
        ).stdout.strip()

    try:
        sid = new_id()
        key = f"{prefix}:session:{sid}"
        await store.set(sid, "value", {"a": [1, 2.5], "b": "c d"})
        await store.append(sid, "notes", {"x": [1, {"y": None}]})
        await store.set(sid, "other", 1)
        # Compact and as given, so an apply's expected value compares as text.
        assert redis("HGET", key, "value") == '{"a":[1,2.5],"b":"c d"}'
        assert redis("HGET", key, "notes") == '[{"x":[1,{"y":null}]}]'
        for write in (
            lambda: store.delete(sid, "other"),
            lambda: store.apply(sid, [("set", "x", 1)], expect={}, result=None, op=Op("k", "d")),
        ):
            redis("EXPIRE", key, "100")
            await write()
            assert 590 <= int(redis("TTL", key)) <= 600
        (bucket,) = redis("--scan", "--pattern", f"{prefix}:ops:{sid}:*").split()
        assert store.op_ttl_seconds <= int(redis("TTL", bucket)) <= 1.5 * store.op_ttl_seconds
        assert await store.count_sessions() == 1
    finally:
        await store.aclose()


@pytest.mark.quick
async def test_memory_store_expires_idle_sessions() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(ttl_seconds=60, clock=clock)
    idle, active = new_id(), new_id()
    await store.open_session(idle, RECORD)
    await store.incr(idle, "counter")
    await store.incr(active, "counter")
    clock.now += 45
    await store.touch(active)  # sliding: the active session's clock restarts
    clock.now += 30
    assert await store.count_sessions() == 1
    assert await store.get(idle, "counter") is None
    assert await store.session_record(idle) is None
    assert await store.get(active, "counter") == 1


async def expired_within(seconds: float, read: Callable[[], Awaitable[object]], gone: object) -> None:
    """Polls `read` until it gives `gone`, for at most `seconds` (the fixed wait this replaces): a TTL of 1 s
    is seen through as soon as Redis lets it go, not 2.2 s later every time. Only for a read that slides no
    TTL (a session's reads do: its expiry test waits instead)."""
    deadline = time.monotonic() + seconds
    # Redis expires keys on its own clock: there is nothing to wait on but time.
    while (got := await read()) != gone and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    assert got == gone, f"still {got!r} {seconds} s on"


async def test_redis_store_expires_idle_sessions(redis_stack: Stack) -> None:
    store = RedisSessionStore(
        redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=f"mcp:t{new_id()[:8]}", ttl_seconds=1
    )
    try:
        sid = new_id()
        await store.open_session(sid, RECORD)
        await store.incr(sid, "counter")
        assert await store.count_sessions() == 1
        await asyncio.sleep(2.2)
        assert await store.count_sessions() == 0
        assert await store.get(sid, "counter") is None
        assert await store.session_record(sid) is None
    finally:
        await store.aclose()


async def test_redis_store_keeps_one_key_per_session_with_the_ttl(redis_stack: Stack) -> None:
    prefix = f"mcp:t{new_id()[:8]}"
    store = RedisSessionStore(
        redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=prefix, ttl_seconds=600
    )
    cli = ["redis-cli", "-p", str(redis_stack.config.redis_port)]

    def redis(*args: str) -> str:
        return subprocess.run(
            [*cli, *args], capture_output=True, text=True, check=True, env=redis_stack.config.redis_cli_env
        ).stdout.strip()

    try:
        sid = new_id()
        await store.open_session(sid, RECORD)
        await store.incr(sid, "counter")
        for note in ("one", "two", "three"):
            await store.append(sid, "notes", note)
        assert sorted(redis("--scan", "--pattern", f"{prefix}:*").split()) == sorted(
            [f"{prefix}:session:{sid}", f"{prefix}:sessions"]
        )
        # The record sits beside the state, and the whole session stays in
        # Redis's compact encoding: the point of one small field per entry.
        assert redis("OBJECT", "ENCODING", f"{prefix}:session:{sid}") == "listpack"
        assert 590 <= int(redis("TTL", f"{prefix}:session:{sid}")) <= 600
        await store.incr(sid, "counter", op=Op("k", "d"))
        # A call's records share one key per half op TTL with the session's other calls'.
        (bucket,) = redis("--scan", "--pattern", f"{prefix}:ops:{sid}:*").split()
        assert store.op_ttl_seconds <= int(redis("TTL", bucket)) <= 1.5 * store.op_ttl_seconds
        await store.incr(sid, "counter", op=Op("k2", "d"))
        assert redis("--scan", "--pattern", f"{prefix}:ops:{sid}:*").split() == [bucket]
        assert redis("HGETALL", bucket).split() == ["1:k", "d", "1:k>1", "2", "2:k2", "d", "2:k2>1", "3"]
    finally:
        await store.aclose()


@pytest.mark.timeout(20)  # a hang fails the test instead of stalling the suite
@pytest.mark.quick
@pytest.mark.parametrize("redis_mode", ["single", "cluster"])
async def test_redis_store_unreachable_raises_store_unavailable(redis_mode: str) -> None:
    """A cluster none of whose nodes answers is an outage like one Redis down (redis-py raises its own
    RedisClusterException there, which would reach the client as an internal error)."""
    (closed_port,) = free_ports(1)
    where: dict[str, Any] = (
        {"url": f"redis://127.0.0.1:{closed_port}/0"}
        if redis_mode == "single"
        else {"cluster_nodes": [("127.0.0.1", closed_port)]}
    )
    store = RedisSessionStore(**where, timeout_seconds=0.5, retry_seconds=0.5)
    try:
        assert await store.ping() is False
        with pytest.raises(StoreUnavailable):
            await store.incr(new_id(), "counter")
        with pytest.raises(StoreUnavailable):
            await store.get(new_id(), "counter")
    finally:
        await store.aclose()


@pytest.mark.timeout(20)
async def test_redis_store_retries_a_write_with_an_op_id_whose_reply_was_lost(redis_stack: Stack) -> None:
    """Redis paused past the socket timeout: the write did reach it, its reply did not.

    With an op id the retry replays the recorded result (applied once); without
    one the write is not sent again, and the caller hears the store is unavailable.
    """
    store = RedisSessionStore(
        redis_stack.config.redis_url,
        **redis_stack.config.redis_auth,
        prefix=f"mcp:t{new_id()[:8]}",
        timeout_seconds=0.5,
    )
    sid = new_id()
    try:
        await store.incr(sid, "counter")

        async def paused_for(seconds: float, write: Awaitable[int]) -> int:
            redis_stack.signal("redis", signal.SIGSTOP)
            try:
                task = asyncio.ensure_future(write)
                await asyncio.sleep(seconds)
            finally:
                redis_stack.signal("redis", signal.SIGCONT)
            return await task

        assert await paused_for(0.7, store.incr(sid, "counter", op=Op("k", "d"))) == 2
        assert await store.get(sid, "counter") == 2
        with pytest.raises(StoreUnavailable):
            await paused_for(0.7, store.incr(sid, "counter"))
    finally:
        await store.aclose()


@pytest.mark.timeout(20)
@pytest.mark.quick
async def test_once_redis_has_been_gone_the_retry_window_calls_fail_at_once() -> None:
    """The window counts from the outage's first failure: later calls do not each wait it out again."""
    (closed_port,) = free_ports(1)
    store = RedisSessionStore(f"redis://127.0.0.1:{closed_port}/0", timeout_seconds=0.5, retry_seconds=1.0)
    try:
        durations = []
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.get(new_id(), "counter")
            durations.append(time.monotonic() - started)
        assert durations[1] < durations[0] / 4, durations
    finally:
        await store.aclose()


@pytest.mark.quick
def test_a_redis_store_takes_a_url_or_sentinels_not_both() -> None:
    with pytest.raises(ValueError):
        RedisSessionStore()
    with pytest.raises(ValueError):
        RedisSessionStore("redis://127.0.0.1:1/0", sentinels=[("127.0.0.1", 1)])
    with pytest.raises(ValueError):
        RedisSessionStore("redis://127.0.0.1:1/0", wait_replicas=-1)


def waiting_store(sentinel_stack: Stack) -> tuple[RedisSessionStore, str, str]:
    """A store whose writes wait up to 300 ms for one replica; the Redis primary's name, and its replica's."""
    store = RedisSessionStore(
        sentinels=sentinels_of(sentinel_stack),
        **auth_of(sentinel_stack),
        prefix=f"mcp:t{new_id()[:8]}",
        wait_replicas=1,
        wait_timeout_ms=300,
    )
    primary = sentinel_stack.redis_primary()
    assert primary is not None
    return store, primary, next(n for n in ("redis-1", "redis-2") if n != primary)


@pytest.mark.timeout(30)
async def test_a_write_no_replica_acknowledged_fails_and_its_retry_applies_it_once(sentinel_stack: Stack) -> None:
    """WAIT: with the Redis replica paused, a write reaches only the primary, so the call is not acknowledged.

    The write did happen there; sent again with the same op once the replica is back, it is
    replayed (counted once), and now acknowledged.
    """
    store, _, replica = waiting_store(sentinel_stack)
    sid = new_id()
    try:
        assert await store.incr(sid, "counter", op=Op("a", "d")) == 1
        assert await store.open_session(sid, {"version": "2025-11-25"}) == 1
        sentinel_stack.signal(replica, signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailable, match="0 of 1 replica"):
                await store.incr(sid, "counter", op=Op("b", "d"))
            # A session's record and an adoption are waited for too: a failover must not lose them.
            with pytest.raises(StoreUnavailable, match="0 of 1 replica"):
                await store.open_session(new_id(), {"version": "2025-11-25"})
            with pytest.raises(StoreUnavailable, match="0 of 1 replica"):
                await store.adopt_session(sid)
        finally:
            sentinel_stack.signal(replica, signal.SIGCONT)
        assert await store.incr(sid, "counter", op=Op("b", "d")) == 2
        assert await store.get(sid, "counter") == 2
        # Without waiting, the same paused replica holds nothing up.
        fast = RedisSessionStore(
            sentinels=sentinels_of(sentinel_stack), **auth_of(sentinel_stack), prefix=store._prefix
        )
        sentinel_stack.signal(replica, signal.SIGSTOP)
        try:
            assert await fast.incr(sid, "counter") == 3
        finally:
            sentinel_stack.signal(replica, signal.SIGCONT)
            await fast.aclose()
    finally:
        await store.aclose()


async def without_the_replica_then_with_it(
    stack: Stack,
    store: RedisSessionStore,
    sid: str,
    primary: str,
    replica: str,
    meanwhile: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """`sid` lives on `primary`, replicated by `replica`. With the replica gone (not merely slow), writes
    go on, waiting for the replicas there are (and `meanwhile` runs); once it is back online, and past the
    recount, they wait for it again, so a paused replica holds a write up."""
    assert await store.incr(sid, "counter", op=Op("a", "d")) == 1
    stack.stop(replica)
    try:
        for n in range(2, 12):  # across more than one recount
            assert await store.incr(sid, "counter", op=Op(f"k{n}", "d")) == n
            await asyncio.sleep(0.15)
        if meanwhile is not None:
            await meanwhile()
    finally:
        stack.start(replica)
    deadline = time.monotonic() + 20
    while stack.redis_info(primary, "replication").get("slave0", "").find("state=online") < 0:
        assert time.monotonic() < deadline, "the replica did not come back"
        await asyncio.sleep(0.2)
    await asyncio.sleep(SHORT_RECOUNT_SECONDS + 0.1)
    await held_up_by_a_paused(stack, replica, store, sid)


async def held_up_by_a_paused(stack: Stack, replica: str, store: RedisSessionStore, sid: str) -> None:
    """With `replica` paused, a write to `sid` that waits for it fails: not acknowledged."""
    stack.signal(replica, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable, match="0 of 1 replica"):
            await store.incr(sid, "counter", op=Op("late", "d"))
    finally:
        stack.signal(replica, signal.SIGCONT)


@pytest.mark.timeout(60)
async def test_with_no_replica_left_writes_wait_for_none_until_one_is_back(sentinel_stack: Stack) -> None:
    """Right after a failover the new primary has no replica until the old primary is back as one and
    synced: a write that waits for a replica there failed every call for ~10 s. With the replica gone (not
    merely slow), writes wait for the replicas there are; once it is back they wait for it again."""
    store, primary, replica = waiting_store(sentinel_stack)
    try:
        await without_the_replica_then_with_it(sentinel_stack, store, new_id(), primary, replica)
    finally:
        await store.aclose()


@pytest.mark.quick
def test_only_a_primary_counts_its_replicas_online() -> None:
    """INFO replication as redis-py parses it. A node that answers as a replica (on a cluster, an old
    primary back as one, still named by a stale slot map) has fields named slave_* that are no replicas,
    and no count to lower a write's wait by."""
    primary = {
        "role": "master",
        "connected_slaves": 2,
        "slave0": {"ip": "127.0.0.1", "port": 7001, "state": "online", "offset": 10, "lag": 0},
        "slave1": {"ip": "127.0.0.1", "port": 7002, "state": "wait_bgsave", "offset": 0, "lag": 0},
        "master_repl_offset": 10,
    }
    replica = {"role": "slave", "master_link_status": "up", "slave_repl_offset": 10, "slave_priority": 100}
    assert online_replicas(primary) == 1
    assert online_replicas(replica) is None


def replica_of(cluster: Stack, primary: str) -> str:
    """The cluster node replicating `primary`."""
    port = str(cluster.service(primary).port)
    return next(
        n for n in cluster.config.redis_names() if cluster.redis_info(n, "replication").get("master_port") == port
    )


def cluster_waiting_store(cluster: Stack) -> RedisSessionStore:
    """A store on `cluster` whose writes wait up to 300 ms for one replica of their primary."""
    return RedisSessionStore(
        cluster_nodes=nodes_of(cluster),
        **cluster.config.redis_auth,
        prefix=f"mcp:t{new_id()[:8]}",
        wait_replicas=1,
        wait_timeout_ms=300,
    )


@pytest.mark.timeout(120)
async def test_on_a_cluster_a_primary_with_no_replica_left_takes_writes_until_one_is_back(own_cluster: Stack) -> None:
    """The same on a cluster, per primary: right after a shard's failover its new primary has no replica,
    and every waited write to that shard failed, each after the whole WAIT timeout. With the replica of a
    session's shard gone, writes there wait for the replicas it has, while another shard still waits for
    its own; once the replica is back, writes wait for it again."""
    store = cluster_waiting_store(own_cluster)
    sid = new_id()
    primary = slot_owner(own_cluster, key_slot(sid.encode()))
    # A session on another shard, whose replica stays.
    other = next(s for s in iter(new_id, "") if slot_owner(own_cluster, key_slot(s.encode())) != primary)
    other_replica = replica_of(own_cluster, slot_owner(own_cluster, key_slot(other.encode())))

    try:
        assert await store.incr(other, "counter", op=Op("a", "d")) == 1
        replica = replica_of(own_cluster, primary)
        other_shard_still_waits = functools.partial(held_up_by_a_paused, own_cluster, other_replica, store, other)
        await without_the_replica_then_with_it(own_cluster, store, sid, primary, replica, other_shard_still_waits)
    finally:
        await store.aclose()


@pytest.mark.timeout(120)
async def test_on_a_cluster_a_shard_whose_primary_is_killed_for_good_takes_writes_again(own_cluster: Stack) -> None:
    """kill -9 of a session's primary, never restarted: its replica is promoted and has no replica of its
    own, for good. Waited writes to that session go on there once it is promoted, each applied once."""
    store = cluster_waiting_store(own_cluster)
    sid = new_id()
    try:
        assert await store.incr(sid, "counter", op=Op("a", "d")) == 1
        own_cluster.signal(slot_owner(own_cluster, key_slot(sid.encode())), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # the same op until it is acknowledged: the promotion takes a few seconds
            try:
                assert await store.incr(sid, "counter", op=Op("b", "d")) == 2
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the shard took no write after its primary was killed"
                await asyncio.sleep(0.2)
        for n in range(3, 13):  # across more than one recount
            assert await store.incr(sid, "counter", op=Op(f"k{n}", "d")) == n
            await asyncio.sleep(0.15)
    finally:
        await store.aclose()


@pytest.mark.timeout(30)
async def test_a_burst_through_sentinel_queues_for_the_bounded_pool(sentinel_stack: Stack) -> None:
    store = RedisSessionStore(
        sentinels=sentinels_of(sentinel_stack),
        **auth_of(sentinel_stack),
        prefix=f"mcp:t{new_id()[:8]}",
        max_connections=4,
    )
    sid = new_id()
    try:
        await asyncio.gather(*(store.incr(sid, "counter") for _ in range(200)))
        assert await store.get(sid, "counter") == 200
    finally:
        await store.aclose()


@pytest.mark.quick
def test_session_ids_have_exactly_the_minted_form() -> None:
    assert is_session_id(uuid.uuid4().hex)
    for bad in ["*", "?" * 32, uuid.uuid4().hex.upper(), str(uuid.uuid4()), uuid.uuid4().hex + "0", "", None, 12]:
        assert not is_session_id(bad)


# -- session events, for resumable streams ----------------------------------------------


@pytest.fixture(params=["memory", REDIS])
async def store_of_5_events(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield InMemorySessionStore(max_events=5)
        return
    redis_stack: Stack = request.getfixturevalue("redis_stack")
    s = RedisSessionStore(
        redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=f"mcp:t{new_id()[:8]}", max_events=5
    )
    yield s
    await s.aclose()


async def test_events_after_are_that_streams_later_events_in_order(store: SessionStore) -> None:
    sid = new_id()
    priming = await store.add_event(sid, "1", None)
    first = await store.add_event(sid, "1", '{"n":1}')
    other = await store.add_event(sid, "2", '{"n":"other stream"}')
    second = await store.add_event(sid, "1", '{"n":2}')
    late_priming = await store.add_event(sid, "1", None)
    assert len({priming, first, other, second, late_priming}) == 5
    # A priming event is a place to resume from: it comes back, without a message.
    assert await store.events_after(sid, priming) == (
        "1",
        [(first, '{"n":1}'), (second, '{"n":2}'), (late_priming, None)],
    )
    assert await store.events_after(sid, second) == ("1", [(late_priming, None)])
    assert await store.events_after(sid, late_priming) == ("1", [])
    assert await store.events_after(sid, other) == ("2", [])


async def test_concurrent_events_get_distinct_ids_in_the_order_stored(store: SessionStore) -> None:
    sid = new_id()
    start = await store.add_event(sid, "s", None)
    ids = await asyncio.gather(*(store.add_event(sid, "s", str(i)) for i in range(50)))
    assert len(set(ids)) == 50
    stream_id, events = await store.events_after(sid, start)
    assert stream_id == "s" and sorted(message for _, message in events) == sorted(str(i) for i in range(50))
    # Each id reads on from its own place in that order.
    for position, (event_id, _) in enumerate(events):
        assert (await store.events_after(sid, event_id))[1] == events[position + 1 :]


async def test_an_event_id_of_another_session_finds_nothing(store: SessionStore) -> None:
    a, b = new_id(), new_id()
    # Added in the same instants: Redis can give both logs the same entry ids.
    pairs = [
        await asyncio.gather(store.add_event(a, "1", '"of a"'), store.add_event(b, "1", '"of b"')) for _ in range(5)
    ]
    for event_of_a, event_of_b in pairs:
        assert event_of_a != event_of_b
        assert await store.events_after(b, event_of_a) is None
        assert await store.events_after(a, event_of_b) is None
    assert await store.events_after(b, pairs[0][1]) == ("1", [(event_of_b, '"of b"') for _, event_of_b in pairs[1:]])


async def test_a_session_keeps_its_last_max_events(store_of_5_events: SessionStore) -> None:
    store, sid = store_of_5_events, new_id()
    ids = [await store.add_event(sid, "s", str(i)) for i in range(8)]
    for trimmed in ids[:3]:
        assert await store.events_after(sid, trimmed) is None
    assert await store.events_after(sid, ids[3]) == ("s", [(ids[i], str(i)) for i in range(4, 8)])


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "x",
        "*",
        "-",
        "+",
        "$",
        ">",
        "0-0",
        "(1-0",
        "1-0",
        "999999999999999-0",
        "1-0.",
        "1-0.zzzzzzzz",
        "1-0.ABCDEF12",
        "1-0.0123456",
        "1-0.0123456789",
        "-1-0.01234567",
        "1.5-0.01234567",
        " 1-0.01234567",
        "1-0.01234567\n",
        "18446744073709551616-0.01234567",
        "0-18446744073709551616.01234567",
        "9" * 10_000,
        "١-٠.01234567",
    ],
)
async def test_malformed_event_ids_find_nothing(store: SessionStore, bad: str) -> None:
    sid = new_id()
    await store.add_event(sid, "s", "{}")
    assert await store.events_after(sid, bad) is None


async def test_unknown_event_ids_find_nothing(store: SessionStore) -> None:
    sid = new_id()
    known = await store.add_event(sid, "s", "{}")
    assert await store.events_after(new_id(), known) is None  # a session with no events at all
    for position in ("1-7", "5-0", "18446744073709551615-18446744073709551615"):
        assert await store.events_after(sid, mint_event_id(sid, position)) is None


@pytest.mark.timeout(20)
@pytest.mark.quick
async def test_malformed_event_ids_never_reach_redis() -> None:
    """Asked of an unreachable Redis, a malformed or foreign id is answered at once; a well-formed one is not."""
    (closed_port,) = free_ports(1)
    store = RedisSessionStore(f"redis://127.0.0.1:{closed_port}/0", timeout_seconds=0.5, retry_seconds=0.5)
    sid = new_id()
    try:
        for bad in ("*", "1-0", "99999999999999999999-0.01234567", mint_event_id(new_id(), "1-0")):
            assert await store.events_after(sid, bad) is None
        with pytest.raises(StoreUnavailable):
            await store.events_after(sid, mint_event_id(sid, "1-0"))
        with pytest.raises(StoreUnavailable):
            await store.add_event(sid, "s", None)
    finally:
        await store.aclose()


@pytest.mark.quick
def test_event_ids_have_one_form() -> None:
    sid = new_id()
    minted = mint_event_id(sid, "1700000000000-3")
    assert is_event_id(minted) and is_event_id(mint_event_id(new_id(), "18446744073709551615-0"))
    # An upper-case tag: `minted.upper()` would be no change at all when the random tag holds only digits.
    upper = minted[:-8] + "ABCDEF12"
    for bad in ["1700000000000-3", upper, minted + "0", "18446744073709551616-0." + minted[-8:], None, 7]:
        assert not is_event_id(bad)


@pytest.mark.quick
async def test_memory_store_expires_event_logs_a_ttl_after_the_latest_event() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(event_ttl_seconds=60, clock=clock)
    sid = new_id()
    first = await store.add_event(sid, "s", "1")
    clock.now += 45
    second = await store.add_event(sid, "s", "2")  # sliding: the log's clock restarts
    clock.now += 30
    assert await store.events_after(sid, first) == ("s", [(second, "2")])
    clock.now += 31
    assert await store.events_after(sid, first) is None
    # A new log after the old one expired: the old ids name none of its events.
    fresh = [await store.add_event(sid, "t", str(i)) for i in range(3)]
    assert first not in fresh and second not in fresh
    assert await store.events_after(sid, second) is None


async def test_redis_store_keeps_a_sessions_events_in_one_list_with_the_event_ttl(redis_stack: Stack) -> None:
    prefix = f"mcp:t{new_id()[:8]}"
    store = RedisSessionStore(
        redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=prefix, event_ttl_seconds=600
    )
    try:
        sid = new_id()
        await store.add_event(sid, "s", None)
        await store.add_event(sid, "s", "{}")
        cli = ["redis-cli", "-p", str(redis_stack.config.redis_port)]

        async def redis_cli(*args: str) -> str:
            # In a thread, so the blocking call does not stall this event loop.
            done = await asyncio.to_thread(
                subprocess.run, [*cli, *args], capture_output=True, text=True, env=redis_stack.config.redis_cli_env
            )
            return done.stdout

        keys = sorted((await redis_cli("--scan", "--pattern", f"{prefix}:*")).split())
        # The log, and the bytes its entries take (for max_log_bytes), expiring together.
        assert keys == [f"{prefix}:events:{sid}", f"{prefix}:events:{sid}:bytes"]
        assert (await redis_cli("TYPE", keys[0])).strip() == "list"
        entries = (await redis_cli("LRANGE", keys[0], "0", "-1")).splitlines()
        assert int(await redis_cli("GET", keys[1])) == sum(len(entry.encode()) for entry in entries)
        for key in keys:
            assert 590 <= int(await redis_cli("TTL", key)) <= 600
    finally:
        await store.aclose()


async def test_redis_store_expires_event_logs(redis_stack: Stack) -> None:
    store = RedisSessionStore(
        redis_stack.config.redis_url,
        **redis_stack.config.redis_auth,
        prefix=f"mcp:t{new_id()[:8]}",
        event_ttl_seconds=1,
    )
    try:
        sid = new_id()
        first = await store.add_event(sid, "s", None)
        await store.add_event(sid, "s", "{}")
        await expired_within(2.2, lambda: store.events_after(sid, first), None)
    finally:
        await store.aclose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.redis
async def test_a_store_reports_each_write_it_replays(kind: str, request: pytest.FixtureRequest) -> None:
    replays: list[Op] = []
    if kind == "memory":
        store: SessionStore = InMemorySessionStore(on_replay=replays.append)
    else:
        store = RedisSessionStore(
            request.getfixturevalue("redis_stack").config.redis_url,
            **request.getfixturevalue("redis_stack").config.redis_auth,
            prefix=f"mcp:t{new_id()[:8]}",
            on_replay=replays.append,
        )
    sid = new_id()
    try:
        assert await store.incr(sid, "counter", op=Op("k", "d")) == 1
        assert replays == []
        assert await store.incr(sid, "counter", op=Op("k", "d")) == 1
        assert await store.incr(sid, "counter", op=Op("k", "d", write="2")) == 2  # another write of the call
        assert replays == [Op("k", "d")]
        op = Op("k", "d", write="apply::1")
        assert await store.apply(sid, [("incr", "counter", 1)], expect={}, result="r", op=op) == "r"
        assert await store.apply(sid, [], expect={}, result="other", op=op) == "r"
        assert await store.recall(sid, op) == (True, "r")  # a read, not a replay
        assert replays == [Op("k", "d"), op]

        async def block(tx: Transaction) -> str:
            raise AssertionError("a retry of a committed block must not run it")

        assert await Session(store, sid, epoch=None, call=("k", "d"), owner=None).apply_once(block) == "r"
        assert replays == [Op("k", "d"), op, op]
        assert await store.get(sid, "counter") == 3
    finally:
        await store.aclose()


@pytest.mark.timeout(30)
async def test_an_outage_that_ended_leaves_later_calls_their_whole_retry_window(redis_stack: Stack) -> None:
    """A ping after Redis came back ends the outage, so a later blip is retried, not failed at once."""
    store = RedisSessionStore(
        redis_stack.config.redis_url,
        **redis_stack.config.redis_auth,
        prefix=f"mcp:t{new_id()[:8]}",
        timeout_seconds=0.3,
        retry_seconds=1.5,
    )
    sid = new_id()
    try:
        assert await store.ping()
        redis_stack.signal("redis", signal.SIGSTOP)
        try:
            assert not await store.ping()  # the outage begins
            await asyncio.sleep(1.6)  # longer than the window
        finally:
            redis_stack.signal("redis", signal.SIGCONT)
        assert await store.ping()  # ...and ends
        redis_stack.signal("redis", signal.SIGSTOP)
        try:
            later = asyncio.ensure_future(store.incr(sid, "counter", op=Op("k", "d")))
            await asyncio.sleep(0.5)  # a blip shorter than the window
        finally:
            redis_stack.signal("redis", signal.SIGCONT)
        assert await later == 1
    finally:
        await store.aclose()


async def test_writes_after_redis_restarted_find_no_connection_it_closed(redis_stack: Stack) -> None:
    """A restarted Redis closed every connection. Once the store notices the outage (a replica's health
    checks and lease renewals do within a second), it drops its idle ones: writes after it, never retried,
    each get a live connection (CI lost a stream's event to one left in the pool)."""
    store = RedisSessionStore(
        redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=f"mcp:t{new_id()[:8]}"
    )
    sid = new_id()
    try:
        await asyncio.gather(*(store.add_event(sid, "s", "before") for _ in range(8)))  # 8 connections, then idle
        redis_stack.restart("redis")
        assert not await store.ping()  # a connection Redis closed: the outage is noticed
        await asyncio.gather(*(store.add_event(sid, "s", "after") for _ in range(8)))
    finally:
        await store.aclose()


async def test_a_watcher_hears_each_change_and_each_message_in_order(store: SessionStore) -> None:
    sid, other = new_id(), new_id()
    async with store.watch() as messages:
        await store.set(sid, "a", 1)
        await store.publish("hello")
        await store.incr(other, "n")
        await store.append(sid, "l", "x")
        await store.apply(sid, [("set", "b", 2)], expect={}, result=None)
        await store.delete(sid, "a")
        await store.copy(sid, other)
        heard = [await asyncio.wait_for(anext(messages), 5) for _ in range(7)]
    assert heard == [sid, "hello", other, sid, sid, sid, other]


async def test_a_watch_on_a_cluster_follows_a_session_whose_slot_moves(redis_cluster: Stack) -> None:
    """The feeds are sharded (a session's channel is its slot's): a node that loses a slot drops its
    channel's subscribers, and the watch subscribes again at the slot's new owner."""
    store = RedisSessionStore(
        cluster_nodes=nodes_of(redis_cluster), prefix=f"mcp:t{new_id()[:8]}", **redis_cluster.config.redis_auth
    )
    sid = new_id()
    await store.set(sid, "n", 0)
    slot = key_slot(f"{{{sid}}}".encode())
    source = slot_owner(redis_cluster, slot)
    target = next(name for name in redis_cluster.cluster_primaries() if name != source)
    heard: asyncio.Queue[str] = asyncio.Queue()

    async def hear(messages: AsyncIterator[str]) -> None:
        async for message in messages:
            heard.put_nowait(message)

    try:
        async with store.watch() as messages:
            listening = asyncio.get_running_loop().create_task(hear(messages))
            await store.set(sid, "n", 1)
            assert await asyncio.wait_for(heard.get(), 5) == sid
            move_slot(redis_cluster, slot, source, target)
            assert slot_owner(redis_cluster, slot) == target
            # What the session publishes in the moment before the watch subscribes at the new owner is
            # missed: the watch says so (RESYNC) once it hears the slot again, and hears every change after.
            await store.set(sid, "n", 2)
            heard_now = [await asyncio.wait_for(heard.get(), 5)]
            if heard_now[0] == sid:
                heard_now.append(await asyncio.wait_for(heard.get(), 5))
            assert heard_now[-1] == RESYNC, heard_now
            for n in range(3, 6):
                await store.set(sid, "n", n)
                assert await asyncio.wait_for(heard.get(), 5) == sid
            assert not listening.done(), listening
            listening.cancel()
        assert await store.get(sid, "n") == 5
    finally:
        move_slot(redis_cluster, slot, target, source)
        await store.aclose()


async def test_what_changes_nothing_is_not_announced(store: SessionStore) -> None:
    sid = new_id()
    op = Op("call-1:1", "d")
    await store.set(sid, "n", "text")
    await store.incr(sid, "k", op=op)
    async with store.watch() as messages:
        with pytest.raises(TypeError):
            await store.incr(sid, "n")  # refused
        await store.incr(sid, "k", op=op)  # replayed, not applied
        await store.get(sid, "k")
        await store.publish("after")
        assert await asyncio.wait_for(anext(messages), 5) == "after"


async def test_a_name_is_claimed_by_one_holder_until_its_claim_expires(store: SessionStore) -> None:
    name = f"state:{new_id()}"
    assert await store.claim(name, "first", 1)
    assert await store.claim(name, "first", 1)  # the same holder again: a retry
    assert not await store.claim(name, "second", 1)
    assert await store.claim(f"state:{new_id()}", "second", 1)
    await asyncio.sleep(1.2)
    assert await store.claim(name, "second", 1)


async def test_concurrent_claims_of_one_name_have_one_winner(store: SessionStore) -> None:
    name = f"state:{new_id()}"
    won = await asyncio.gather(*(store.claim(name, f"holder-{i}", 5) for i in range(20)))
    assert sum(won) == 1


async def test_a_records_entries_can_be_updated_but_not_its_owner(store: SessionStore) -> None:
    sid = new_id()
    assert not await store.update_record(sid, {"subscriptions": ["x://a"]})
    await store.open_session(sid, {"version": "v", OWNER: "alice"})
    assert await store.update_record(sid, {"subscriptions": ["x://a"], OWNER: "mallory"})
    assert await store.update_record(sid, {"subscriptions": ["x://a", "x://b"]})
    assert await store.session_record(sid) == {"version": "v", OWNER: "alice", "subscriptions": ["x://a", "x://b"]}
    assert await store.owner(sid) == "alice"
    record, _ = await store.adopt_session(sid) or ({}, 0)
    assert record["subscriptions"] == ["x://a", "x://b"]
    await store.end_session(sid)
    assert not await store.update_record(sid, {"subscriptions": []})


# -- bounds: nothing one client sends can take what every client shares -----------------


@pytest.fixture(params=["memory", REDIS, CLUSTER])
async def bounded_store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    limits = {"max_state_bytes": 200, "max_log_bytes": 300, "max_sessions": 6, "max_sessions_per_holder": 2}
    if request.param == "memory":
        yield InMemorySessionStore(**limits)  # type: ignore[arg-type]
        return
    if request.param == "cluster":
        cluster: Stack = request.getfixturevalue("redis_cluster")
        s = RedisSessionStore(
            cluster_nodes=nodes_of(cluster), **cluster.config.redis_auth, prefix=f"mcp:t{new_id()[:8]}", **limits
        )
        yield s
        await s.aclose()
        return
    redis_stack: Stack = request.getfixturevalue("redis_stack")
    s = RedisSessionStore(
        redis_stack.config.redis_url,
        **redis_stack.config.redis_auth,
        prefix=f"mcp:t{new_id()[:8]}",
        **limits,  # type: ignore[arg-type]
    )
    yield s
    await s.aclose()


async def test_a_write_past_the_state_bound_is_refused_and_changes_nothing(bounded_store: SessionStore) -> None:
    sid = new_id()
    await bounded_store.set(sid, "a", "x" * 100)
    with pytest.raises(LimitExceeded, match="at most 200"):
        await bounded_store.set(sid, "b", "y" * 100)
    with pytest.raises(LimitExceeded):
        await bounded_store.apply(sid, [("set", "c", "z"), ("append", "d", "w" * 120)], expect={}, result=None)
    assert await bounded_store.items(sid) == {"a": "x" * 100}
    # Replacing an entry counts what it frees: shrinking and same-size writes always pass.
    await bounded_store.set(sid, "a", "y" * 150)
    await bounded_store.set(sid, "a", "short")
    await bounded_store.set(sid, "b", "y" * 150)
    await bounded_store.delete(sid, "b")
    assert await bounded_store.items(sid) == {"a": "short"}


async def test_a_copy_past_the_state_bound_is_refused(bounded_store: SessionStore) -> None:
    source, target = new_id(), new_id()
    await bounded_store.set(source, "a", "x" * 120)
    await bounded_store.set(target, "b", "y" * 120)
    with pytest.raises(LimitExceeded):
        await bounded_store.copy(source, target)
    assert await bounded_store.items(target) == {"b": "y" * 120}


async def test_an_append_past_max_items_is_refused_and_counts_stay_right(store: SessionStore) -> None:
    sid = new_id()
    assert [await store.append(sid, "l", n, max_items=3) for n in range(3)] == [1, 2, 3]
    with pytest.raises(LimitExceeded, match="3 items"):
        await store.append(sid, "l", 3, max_items=3)
    assert await store.get(sid, "l") == [0, 1, 2]
    # A list set whole, or copied, or rebuilt by an apply, is counted right by the next append.
    await store.set(sid, "l", ["a", "b"])
    assert await store.append(sid, "l", "c") == 3
    other = new_id()
    await store.set(other, "l", [1, 2, 3, 4, 5])
    await store.copy(other, sid)
    assert await store.append(sid, "l", 6) == 6
    await store.apply(sid, [("delete", "l", None), ("append", "l", "x")], expect={}, result=None)
    assert await store.append(sid, "l", "y") == 2
    assert await store.get(sid, "l") == ["x", "y"]


async def test_an_event_log_keeps_its_latest_events_within_its_bytes(bounded_store: SessionStore) -> None:
    sid = new_id()
    ids = [await bounded_store.add_event(sid, "s", json.dumps({"n": n, "pad": "x" * 60})) for n in range(10)]
    # ~85 bytes an entry within 300: the oldest went, the latest three or so stay.
    assert await bounded_store.events_after(sid, ids[0]) is None
    found = await bounded_store.events_after(sid, ids[-3])
    assert found is not None
    assert [json.loads(m or "")["n"] for _, m in found[1]] == [8, 9]


async def test_sessions_are_bounded_per_holder_and_in_all(bounded_store: SessionStore) -> None:
    a1, a2, a3 = new_id(), new_id(), new_id()
    await bounded_store.open_session(a1, {"v": 1}, holder="alice")
    await bounded_store.open_session(a2, {"v": 1}, holder="alice")
    with pytest.raises(LimitExceeded, match="2 open sessions"):
        await bounded_store.open_session(a3, {"v": 1}, holder="alice")
    assert await bounded_store.session_record(a3) is None
    assert await bounded_store.count_sessions(holder="alice") == 2
    # Ending one frees its place; another holder has places of its own.
    await bounded_store.end_session(a1, holder="alice")
    await bounded_store.open_session(a3, {"v": 1}, holder="alice")
    for _ in range(2):
        await bounded_store.open_session(new_id(), {"v": 1}, holder="bob")
    await bounded_store.open_session(new_id(), {"v": 1})
    # Six in the index now (a1's state lives on): the next is one too many for anyone.
    assert await bounded_store.count_sessions() == 6
    with pytest.raises(LimitExceeded, match="6 sessions"):
        await bounded_store.open_session(new_id(), {"v": 1}, holder="carol")


# Quotas: everything the store keeps for a holder, in bytes (MAX_CLIENT_BYTES). 20,000 bytes here: a few
# 6 KB entries, or some tens of small keys (each key is charged ~500 bytes beyond what it holds).
QUOTA = 20_000
QUOTA_REFUSAL = (
    r"this client's stored data would take [\d,]+ bytes; the store keeps at most 20,000 per client \(MAX_CLIENT_BYTES\)"
)


@pytest.fixture(params=["memory", REDIS, CLUSTER])
async def quota_store(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., SessionStore]]:
    """Stores with a 20,000-byte quota per holder (and any other limits a test gives)."""
    made: list[SessionStore] = []

    def make(**limits: Any) -> SessionStore:
        limits = {"max_bytes_per_holder": QUOTA, **limits}
        if request.param == "memory":
            made.append(InMemorySessionStore(**limits))
        elif request.param == "cluster":
            cluster: Stack = request.getfixturevalue("redis_cluster")
            prefix = f"mcp:t{new_id()[:8]}"
            made.append(
                RedisSessionStore(cluster_nodes=nodes_of(cluster), **cluster.config.redis_auth, prefix=prefix, **limits)
            )
        else:
            redis_stack: Stack = request.getfixturevalue("redis_stack")
            config = redis_stack.config
            made.append(
                RedisSessionStore(config.redis_url, **config.redis_auth, prefix=f"mcp:t{new_id()[:8]}", **limits)
            )
        return made[-1]

    yield make
    for s in made:
        await s.aclose()


async def opened(store: SessionStore, holder: str | None) -> str:
    sid = new_id()
    await store.open_session(sid, RECORD, holder=holder)
    return sid


async def test_a_write_past_the_holders_quota_is_refused_and_changes_nothing(
    quota_store: Callable[..., SessionStore],
) -> None:
    store = quota_store()
    sid, other = await opened(store, "alice"), await opened(store, "alice")
    await store.set(sid, "a", "x" * 6000)
    await store.set(other, "b", "x" * 6000)
    for refused in (
        lambda: store.set(sid, "c", "y" * 9000),
        lambda: store.append(other, "l", "y" * 9000),
        lambda: store.apply(sid, [("set", "c", "y" * 4000), ("set", "d", "y" * 5000)], expect={}, result=1),
        lambda: store.set(sid, "c", "y" * 9000, op=Op("k", "d")),
    ):
        with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
            await refused()
    assert await store.items(sid) == {"a": "x" * 6000}
    assert await store.items(other) == {"b": "x" * 6000}
    assert await store.recall(sid, Op("k", "d")) == (False, None)
    # What frees room makes room: a write that shrinks always passes, and then a larger one fits.
    await store.set(sid, "a", "short")
    await store.set(sid, "c", "y" * 9000)
    await store.delete(other, "b")
    await store.append(other, "l", "y" * 5000)
    # Another holder has a quota of its own, and a session opened for nobody is charged to nobody.
    bob = await opened(store, "bob")
    await store.set(bob, "a", "z" * 15_000)
    nobody = await opened(store, None)
    for key in "abcd":
        await store.set(nobody, key, "n" * 15_000)


async def test_a_copy_is_charged_what_it_copies_to_the_holder_of_its_target(
    quota_store: Callable[..., SessionStore],
) -> None:
    store = quota_store()
    source, target = await opened(store, "alice"), await opened(store, "alice")
    await store.set(source, "big", "x" * 11_000)
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        await store.copy(source, target)
    assert await store.items(target) == {}
    # Into bob's session, bob pays: alice's quota is untouched, and bob's own bounds what he copies.
    bobs = await opened(store, "bob")
    assert await store.copy(source, bobs) == 1
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        await store.copy(source, await opened(store, "bob"))
    await store.set(source, "more", "x" * 4000)


async def test_a_calls_op_records_count_against_its_sessions_holder(quota_store: Callable[..., SessionStore]) -> None:
    store = quota_store()
    sid = await opened(store, "alice")
    applied = 0
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        for n in range(400):  # each call's record: its two fields, digest and result, ~150 bytes
            await store.incr(sid, "counter", op=Op(f"call-{n}", "d"))
            applied += 1
    assert 80 < applied < 160
    assert await store.get(sid, "counter") == applied
    assert await store.recall(sid, Op(f"call-{applied}", "d")) == (False, None)
    # Without ops the same writes keep no records: only the state counts.
    bob = await opened(store, "bob")
    for _ in range(100):
        await store.incr(bob, "counter")
    assert await store.get(bob, "counter") == 100


async def test_a_sessions_events_count_against_its_holder(quota_store: Callable[..., SessionStore]) -> None:
    store = quota_store()
    sid = await opened(store, "alice")
    ids: list[str] = []
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        for n in range(100):
            ids.append(await store.add_event(sid, "s", json.dumps({"n": n, "pad": "x" * 1000})))
    assert 5 < len(ids) < 20
    found = await store.events_after(sid, ids[0])
    assert found is not None
    assert [json.loads(m or "")["n"] for _, m in found[1]] == list(range(1, len(ids)))  # the refused one is not there
    # The log's own bound still trims it: at that bound, an event takes the room of those it pushes out.
    bounded = quota_store(max_log_bytes=5000)
    sid = await opened(bounded, "alice")
    for n in range(100):
        await bounded.add_event(sid, "s", json.dumps({"n": n, "pad": "x" * 1000}))


async def test_claims_count_against_their_holder_until_released(quota_store: Callable[..., SessionStore]) -> None:
    store = quota_store()
    names = [f"call:{new_id()}" for _ in range(20)]
    taken = 0
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        for name in names:
            await store.claim(name, "r" * 3000, 60, holder="alice")
            taken += 1
    assert 3 <= taken < 8
    assert await store.claimed(names[taken]) is None
    assert await store.claim(names[0], "r" * 3000, 60, holder="alice")  # renewing costs nothing more
    await store.release(names[0])
    assert await store.claimed(names[0]) is None
    assert await store.claim(names[taken], "r" * 3000, 60, holder="alice")
    # Unheld names release to nothing; claims of nobody's and other holders' are not alice's.
    await store.release(f"call:{new_id()}")
    assert await store.claim(f"call:{new_id()}", "r" * 3000, 60, holder="bob")
    for _ in range(10):
        assert await store.claim(f"call:{new_id()}", "r" * 3000, 60)


async def test_a_claim_charges_what_its_claimant_keeps_elsewhere(quota_store: Callable[..., SessionStore]) -> None:
    """`charge`: bytes kept outside the store (a durable task's data) counted with the claim, so they fill
    the holder's quota; its claimant's renewal charges its own `charge`, lowering it too."""
    store = quota_store()
    name = f"task:{new_id()}"
    assert await store.claim(name, "c", 60, holder="alice", charge=12_000)
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        await store.claim(f"task:{new_id()}", "c", 60, holder="alice", charge=12_000)
    assert await store.claim(name, "c", 60, holder="alice", charge=1_000)  # lowered: room again
    assert await store.claim(f"task:{new_id()}", "c", 60, holder="alice", charge=12_000)
    await store.release(name)
    assert await store.claim(f"task:{new_id()}", "c", 60, holder="alice", charge=5_000)


async def test_what_expires_or_ends_frees_its_holders_quota(quota_store: Callable[..., SessionStore]) -> None:
    store = quota_store(ttl_seconds=1, op_ttl_seconds=1, event_ttl_seconds=1)
    sid = await opened(store, "alice")
    await store.set(sid, "a", "x" * 6000, op=Op("k", "d"))
    await store.add_event(sid, "s", "x" * 3000)
    await store.claim(f"call:{new_id()}", "r" * 3000, 1, holder="alice")
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        await store.set(await opened(store, "alice"), "a", "x" * 6000)
    await asyncio.sleep(2.2)
    # The state, its call's record, the log and the claim are gone, and so are their charges.
    await store.set(await opened(store, "alice"), "a", "x" * 17_000)


async def test_ending_a_session_frees_what_its_record_held(quota_store: Callable[..., SessionStore]) -> None:
    store = quota_store()
    records: list[str] = []
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        for _ in range(100):  # each record, with its key, ~950 bytes
            records.append(new_id())
            await store.open_session(records[-1], RECORD, holder="carol")
    assert await store.session_record(records.pop()) is None
    assert 10 < len(records) < 30
    # The key stays until its state expires, and is charged: ending five frees what their records held, room
    # for at least one new session, but not for five (whatever room was left below the quota, under one).
    for sid in records[:5]:
        assert await store.end_session(sid, holder="carol")
    reopened = 0
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        for _ in range(10):
            await opened(store, "carol")
            reopened += 1
    assert 1 <= reopened < 5


async def test_ending_a_session_drops_its_log_and_call_records_and_their_charges(
    quota_store: Callable[..., SessionStore],
) -> None:
    """A request naming an ended session gets 404: nothing resumes its log or replays its calls, so both go
    with it and their charges are free again. Its state stays (`resume_session` may still copy it)."""
    store = quota_store()
    sid = await opened(store, "alice")
    first = await store.add_event(sid, "s", "x" * 6000)
    for n in range(30):  # each call's record ~150 bytes
        await store.incr(sid, "counter", op=Op(f"call-{n}", "d"))
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        await store.set(await opened(store, "alice"), "a", "x" * 9000)
    assert await store.end_session(sid, holder="alice")
    assert await store.events_after(sid, first) is None
    assert await store.recall(sid, Op("call-0", "d")) == (False, None)
    assert await store.get(sid, "counter") == 30
    await store.set(await opened(store, "alice"), "a", "x" * 9000)


async def test_a_charge_lasts_as_long_as_reads_keep_what_it_counts(quota_store: Callable[..., SessionStore]) -> None:
    store = quota_store(ttl_seconds=2)
    sid = await opened(store, "alice")
    await store.set(sid, "a", "x" * 15_000)
    for _ in range(8):  # 4 s of reads, twice the TTL: the state lives on, and so does its charge
        await asyncio.sleep(0.5)
        assert await store.get(sid, "a") == "x" * 15_000
    with pytest.raises(LimitExceeded, match=QUOTA_REFUSAL):
        await store.set(await opened(store, "alice"), "a", "x" * 6000)


async def test_a_write_past_redis_maxmemory_is_store_full_and_evicts_nothing(redis_stack: Stack) -> None:
    prefix = f"mcp:t{new_id()[:8]}"
    store = RedisSessionStore(redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=prefix)

    async def admin(*args: str) -> str:
        done = await asyncio.to_thread(
            subprocess.run,
            ["redis-cli", "-p", str(redis_stack.config.redis_port), *args],
            capture_output=True,
            text=True,
            check=True,
            env=redis_stack.config.redis_cli_env,
        )
        return done.stdout.split()[-1]

    sid = new_id()
    await store.set(sid, "kept", "value")
    used, _ = await store.memory() or (0, 0)
    assert used > 0
    was = {name: await admin("CONFIG", "GET", name) for name in ("maxmemory", "maxmemory-policy")}
    await admin("CONFIG", "SET", "maxmemory", str(used))
    await admin("CONFIG", "SET", "maxmemory-policy", "noeviction")
    try:
        refused = False
        for _ in range(1000):  # bounded: the first write past the bound is refused
            try:
                await store.set(new_id(), "filler", "x" * 10_000)
            except StoreFull:
                refused = True
                break
        assert refused
        assert (await store.memory() or (0, 0))[1] == used
        # Full, it still reads, and ends sessions (which frees memory).
        assert await store.get(sid, "kept") == "value"
        assert await store.items(sid) == {"kept": "value"}
        assert await store.end_session(new_id()) is False
    finally:
        for name, value in was.items():
            await admin("CONFIG", "SET", name, value)
    assert await store.get(sid, "kept") == "value"
    await store.aclose()


async def test_the_kits_user_calls_functions_an_admin_loaded_and_says_so_when_none_are(redis_stack: Stack) -> None:
    """The kit's Redis user may only FCALL (docs/security.md): with the library missing it gets a clear
    StoreUnavailable saying how to load it; a user allowed to load it (the admin) loads it itself."""
    prefix = f"mcp:t{new_id()[:8]}"
    kit = RedisSessionStore(redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=prefix)
    admin = RedisSessionStore(
        redis_stack.config.redis_url, password=redis_stack.config.redis_admin_password, prefix=prefix
    )
    sid = new_id()
    try:
        assert redis_stack.redis_command("redis", "FUNCTION", "DELETE", LIBRARY) == "OK"
        with pytest.raises(StoreUnavailable, match="FUNCTION LOAD"):
            await kit.set(sid, "a", 1)
        await admin.set(sid, "a", 1)  # loads the library, then writes
        assert await kit.get(sid, "a") == 1
    finally:
        redis_stack.load_functions("redis")
        await kit.aclose()
        await admin.aclose()


async def test_on_a_cluster_a_primary_without_the_library_is_said_so_or_loaded(redis_cluster: Stack) -> None:
    """A primary missing the kit's functions (one added by hand, say): the kit's user gets the same clear
    StoreUnavailable as on one Redis; a user allowed to load them loads them on every primary."""
    nodes = nodes_of(redis_cluster)
    prefix = f"mcp:t{new_id()[:8]}"
    kit = RedisSessionStore(cluster_nodes=nodes, **redis_cluster.config.redis_auth, prefix=prefix)
    admin = RedisSessionStore(cluster_nodes=nodes, password=redis_cluster.config.redis_admin_password, prefix=prefix)
    sid = new_id()
    primary = slot_owner(redis_cluster, key_slot(f"{{{sid}}}".encode()))
    try:
        assert redis_cluster.redis_command(primary, "FUNCTION", "DELETE", CLUSTER_LIBRARY) == "OK"
        with pytest.raises(StoreUnavailable, match="FUNCTION LOAD"):
            await kit.set(sid, "a", 1)
        await admin.set(sid, "a", 1)  # loads the library, then writes
        assert await kit.get(sid, "a") == 1
    finally:
        redis_cluster.load_functions(primary)
        await kit.aclose()
        await admin.aclose()
