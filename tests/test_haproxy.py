"""HAProxy in front of the replicas: config, stickiness, spreading, failover and state that survives it."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import httpx2
import pytest

from mcp_http import RawSession
from stack import Stack

CONFIG = Path(__file__).resolve().parent.parent / "haproxy" / "haproxy.cfg"


def haproxy_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["haproxy", "-c", "-f", str(CONFIG)], env={**os.environ, **env}, capture_output=True, text=True
    )


def test_config_is_valid_with_the_local_stacks_environment(stack: Stack) -> None:
    haproxy = stack.service("haproxy")
    result = haproxy_check(haproxy.env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_rejects_a_broken_address() -> None:
    # Proves the check above can fail: the server addresses really come from the environment.
    result = haproxy_check({"MCP_SERVER_1": "127.0.0.1:not-a-port"})
    assert result.returncode != 0


def test_stick_table_expiry_follows_the_session_ttl_setting(stack: Stack) -> None:
    assert stack.service("haproxy").env["SESSION_TTL_SECONDS"] == str(stack.config.session_ttl_seconds)
    for replica in stack.config.replica_names():
        assert stack.service(replica).env["SESSION_TTL_SECONDS"] == str(stack.config.session_ttl_seconds)
    assert 'expire "${SESSION_TTL_SECONDS-1800}s"' in CONFIG.read_text()


async def test_a_session_sticks_to_one_replica(raw: RawSession) -> None:
    results = [await raw.call("increment_counter") for _ in range(10)]
    assert [r["counter"] for r in results] == list(range(1, 11))
    assert len({r["instance"] for r in results}) == 1


async def test_new_sessions_spread_across_replicas(http: httpx2.AsyncClient, mcp_url: str) -> None:
    instances = set()
    sessions = [RawSession(http, mcp_url) for _ in range(12)]
    for session in sessions:
        await session.initialize()
    # Concurrent calls keep connections open, which is what leastconn balances on.
    results = await asyncio.gather(*(s.call("analyze_data", {"num_items": 2}) for s in sessions))
    instances = {r["instance"] for r in results}
    assert len(instances) >= 2, instances


async def test_200_concurrent_increments_on_one_session_end_at_200(raw: RawSession) -> None:
    results = await asyncio.gather(*(raw.call("increment_counter") for _ in range(200)))
    assert sorted(r["counter"] for r in results) == list(range(1, 201))
    assert (await raw.call("get_counter"))["counter"] == 200


async def test_200_concurrent_notes_on_one_session_are_all_kept(raw: RawSession) -> None:
    results = await asyncio.gather(*(raw.call("add_note", {"note": f"n{i}"}) for i in range(200)))
    assert sorted(r["notes_count"] for r in results) == list(range(1, 201))
    notes = (await raw.call("list_notes"))["notes"]
    assert sorted(notes) == sorted(f"n{i}" for i in range(200))


async def test_stopping_a_sessions_replica_keeps_its_state(
    healed_stack: Stack, http: httpx2.AsyncClient, mcp_url: str
) -> None:
    old = RawSession(http, mcp_url)
    await old.initialize()
    for _ in range(3):
        replica = (await old.call("increment_counter"))["instance"]
    await old.call("add_note", {"note": "survive-crash"})

    healed_stack.stop(replica)

    new = RawSession(http, mcp_url)
    await new.initialize()
    resumed = await new.call("resume_session", {"old_session_id": old.session_id})
    assert resumed["instance"] != replica
    assert (resumed["status"], resumed["keys_copied"]) == ("resumed", 2)
    after = await new.call("increment_counter")
    assert after["counter"] == 4
    assert (await new.call("list_notes"))["notes"] == ["survive-crash"]


@pytest.mark.timeout(120)
async def test_state_survives_restarting_every_replica(healed_stack: Stack, raw: RawSession) -> None:
    await raw.call("increment_counter")
    await raw.call("add_note", {"note": "before restart"})
    for replica in healed_stack.config.replica_names():
        healed_stack.restart(replica)
    fresh = RawSession(raw.http, raw.url)
    await fresh.initialize()
    assert (await fresh.call("resume_session", {"old_session_id": raw.session_id}))["keys_copied"] == 2
    assert (await fresh.call("get_counter"))["counter"] == 1
    assert (await fresh.call("list_notes"))["notes"] == ["before restart"]


async def test_stats_page_lists_every_replica_up(stack: Stack, http: httpx2.AsyncClient) -> None:
    page = await http.get(stack.config.stats_url)
    assert page.status_code == 200
    assert stack.backend_status() == {name: "UP" for name in stack.config.replica_names()}
