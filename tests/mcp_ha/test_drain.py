"""Graceful drain: SIGTERM takes a replica out without failing a call."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx2
import pytest

from mcp_ha.drain import MAX_BALANCERS, Drain
from mcp_ha.ops.check.wire import PROTOCOL, RawSession, last_jsonrpc_message
from mcp_ha.ops.stack import Stack

pytestmark = pytest.mark.timeout(60)


async def test_sigterm_drains_finishing_in_flight_calls_and_refusing_new_sessions(
    healed_stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    replica = (await raw.call("increment_counter"))["instance"]
    port = healed_stack.service(replica).port
    in_flight = asyncio.create_task(raw.call("analyze_data", {"num_items": 30}))  # about 1.5 s
    await asyncio.sleep(0.3)
    pid = healed_stack.pid(replica)
    healed_stack.signal(replica, signal.SIGTERM)
    await asyncio.sleep(0.1)

    # New work is refused at once, before anything is done (HAProxy re-sends it elsewhere)...
    fresh = RawSession(http, f"http://127.0.0.1:{port}/mcp")
    refused = await fresh.post(
        "initialize", {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    )
    assert refused.status_code == 503
    sticky = RawSession(http, fresh.url)
    sticky.session_id = raw.session_id
    assert (await sticky.post("tools/call", {"name": "get_counter"})).status_code == 503
    # ...while the call in flight runs to its end; only then does the health check fail.
    assert (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
    result = await in_flight
    assert result["items_processed"] == 30 and result["instance"] == replica
    # (The replica notices the call has ended a moment after the client has its answer.)
    for _ in range(50):
        health = await http.get(f"http://127.0.0.1:{port}/health")
        if health.status_code == 503:
            break
        await asyncio.sleep(0.05)
    assert health.status_code == 503 and health.json() == {"status": "draining", "instance": replica}

    deadline = time.monotonic() + 20
    while healed_stack.pid(replica) == pid and time.monotonic() < deadline:  # noqa: ASYNC110  polls another process
        await asyncio.sleep(0.1)
    assert healed_stack.pid(replica) is None
    # The session carries on elsewhere, with everything the drained replica wrote.
    after = await raw.call("increment_counter")
    assert after["instance"] != replica and after["counter"] == 2
    summary = await raw.post("resources/read", {"uri": f"resource://session/{raw.session_id}/summary"})
    contents = last_jsonrpc_message(summary)["result"]["contents"][0]["text"]
    assert '"items_processed": 30' in contents


async def test_a_rolling_restart_fails_no_call_of_a_plain_client(healed_stack: Stack, raw: RawSession) -> None:
    acknowledged, failures, stop = 0, [], asyncio.Event()

    async def keep_calling() -> None:
        nonlocal acknowledged, failures
        while not stop.is_set():
            try:
                await raw.call("increment_counter")
                acknowledged += 1
            except (AssertionError, httpx2.HTTPError) as exc:
                failures.append(repr(exc)[:300])
            await asyncio.sleep(0.02)

    load = asyncio.create_task(keep_calling())
    for replica in healed_stack.config.replica_names():
        await asyncio.to_thread(healed_stack.restart, replica)
    stop.set()
    await load
    assert failures == []
    assert acknowledged > 20
    assert (await raw.call("get_counter"))["counter"] == acknowledged


async def test_a_drain_waits_for_each_balancers_checks_and_no_one_elses() -> None:
    """Two balancers each checking every 0.4 s: the drain ends once each has had its two refusals."""
    drain = Drain(notice_checks=2, notice_seconds=30.0, timeout_seconds=1.0)
    for _ in range(2):
        for balancer in ("haproxy-a/1", "haproxy-b/1"):
            assert drain.health_checked(balancer=balancer) is True
        await asyncio.sleep(0.4)
    run = asyncio.create_task(drain.run())
    await asyncio.sleep(0.05)  # nothing in flight: the calls are done at once
    # Docker's HEALTHCHECK, a probe or a person polling /health: told "draining", but not counted.
    for _ in range(10):
        assert drain.health_checked(balancer=None) is False
    # Two checks, one from each HAProxy: neither has seen the two failures it marks a server down on.
    assert drain.health_checked(balancer="haproxy-a/1") is False
    assert drain.health_checked(balancer="haproxy-b/1") is False
    await asyncio.sleep(0.4)
    assert not run.done(), "the replica would exit while its balancers still have it up"
    assert drain.health_checked(balancer="haproxy-a/1") is False
    await asyncio.sleep(0.2)
    assert not run.done()
    assert drain.health_checked(balancer="haproxy-b/1") is False
    await asyncio.wait_for(run, 5)


@pytest.mark.quick
async def test_a_drain_waits_for_no_balancer_that_stopped_checking() -> None:
    """A balancer that fell silent (stopped: a stack going down stops HAProxy first) is not waited for
    until NOTICE seconds: only until it has been silent twice its time between checks, and a little."""
    drain = Drain(notice_checks=2, notice_seconds=30.0, timeout_seconds=1.0)
    for _ in range(3):
        assert drain.health_checked(balancer="haproxy/1") is True
        await asyncio.sleep(0.1)
    await asyncio.wait_for(drain.run(), 5)
    # And with no balancer at all, nothing to wait for.
    await asyncio.wait_for(Drain(notice_seconds=30.0).run(), 5)


@pytest.mark.quick
async def test_a_drain_keeps_track_of_a_bounded_number_of_balancers() -> None:
    """A client reaching a replica directly can name any balancer: it costs a bounded table."""
    drain = Drain()
    for n in range(MAX_BALANCERS * 4):
        drain.health_checked(balancer=f"forged-{n}")
    assert len(drain._last_check) == MAX_BALANCERS and f"forged-{MAX_BALANCERS * 4 - 1}" in drain._last_check
