"""The guarantees that matter, held for every server shape built on `mcp_ha`.

Each test runs against the kit's demo server (`server.py`, counters and notes)
and the cart example (`examples/cart/server.py`, read-then-write tools in
apply-once blocks), each on a whole stack of its own: redis, three replicas,
haproxy. A shape names the calls a test needs; the tests are written once.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
from conftest import running_stack
from fastmcp import Client

from mcp_ha.check.wire import RawSession, last_jsonrpc_message
from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.stack import Stack

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Shape:
    module: str
    # A call that changes the session's state, and a read that shows it.
    write: tuple[str, dict[str, Any]]
    read: tuple[str, dict[str, Any]]
    state: Callable[[dict[str, Any]], Any]
    # A call that must apply once however often it is sent, and what its effect
    # looks like in `read`'s result after `n` writes and one such call.
    once: tuple[str, dict[str, Any]]
    applied_once: Callable[[dict[str, Any], int], bool]


SHAPES = {
    "demo": Shape(
        module="server",
        write=("increment_counter", {}),
        read=("get_counter", {}),
        state=lambda r: r["counter"],
        once=("increment_counter", {}),
        applied_once=lambda r, n: r["counter"] == n + 1,
    ),
    "cart": Shape(
        module="examples.cart.server",
        write=("add_item", {"sku": "apple", "qty": 1}),
        read=("view_cart", {}),
        state=lambda r: (r["items"], r["orders"]),
        once=("checkout", {}),
        applied_once=lambda r, n: r["items"] == {} and [o["items"] for o in r["orders"]] == [{"apple": n}],
    ),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Shape, Stack]]:
    shape = SHAPES[request.param]
    with running_stack(tmp_path_factory.mktemp(request.param), server=shape.module) as s:
        yield shape, s


@pytest.fixture
def healed(shaped: tuple[Shape, Stack]) -> Iterator[tuple[Shape, Stack]]:
    yield shaped
    _shape, stack = shaped
    for svc in stack.services():
        if stack.state(svc.name) != "running":
            stack.start(svc.name)
    stack.wait_healthy("haproxy")


async def keyed(session: RawSession, call: tuple[str, dict[str, Any]], key: str) -> httpx2.Response:
    name, arguments = call
    return await session.post("tools/call", {"name": name, "arguments": arguments, "_meta": {IDEMPOTENCY_KEY: key}})


def result_of(response: httpx2.Response) -> dict[str, Any]:
    message = last_jsonrpc_message(response)
    assert "result" in message and not message["result"].get("isError"), message
    return message["result"]["structuredContent"]


async def test_a_killed_replica_keeps_the_session_and_its_state(
    healed: tuple[Shape, Stack], http: httpx2.AsyncClient
) -> None:
    shape, stack = healed
    raw = RawSession(http, stack.config.mcp_url)
    await raw.initialize()
    for _ in range(3):
        replica = (await raw.call(*shape.write))["instance"]
    before = await raw.call(*shape.read)

    stack.signal(replica, signal.SIGKILL)

    after = await raw.call(*shape.read)
    assert after["instance"] != replica
    assert shape.state(after) == shape.state(before)
    assert (await raw.call(*shape.write))["instance"] != replica  # and it takes writes, in the same session


async def test_a_retried_call_applies_once(shaped: tuple[Shape, Stack], http: httpx2.AsyncClient) -> None:
    shape, stack = shaped
    raw = RawSession(http, stack.config.mcp_url)
    await raw.initialize()
    for _ in range(2):
        await raw.call(*shape.write)
    key = uuid.uuid4().hex
    first = result_of(await keyed(raw, shape.once, key))
    again = result_of(await keyed(raw, shape.once, key))
    assert {k: v for k, v in again.items() if k != "instance"} == {k: v for k, v in first.items() if k != "instance"}
    assert shape.applied_once(await raw.call(*shape.read), 2)


async def test_a_call_whose_replica_dies_mid_call_applies_once_when_retried(
    healed: tuple[Shape, Stack], http: httpx2.AsyncClient
) -> None:
    """The call goes to its replica directly, which is killed a few milliseconds later, before or after it
    applied; the client's retry through HAProxy, with the same key, lands on another replica."""
    shape, stack = healed
    rng = random.Random(7)
    for attempt in range(3):
        raw = RawSession(http, stack.config.mcp_url)
        await raw.initialize()
        for _ in range(2):
            replica = (await raw.call(*shape.write))["instance"]
        if stack.state(replica) != "running":
            continue
        direct = raw.at(f"http://127.0.0.1:{stack.service(replica).port}/mcp")
        key = uuid.uuid4().hex
        doomed = asyncio.create_task(keyed(direct, shape.once, key))
        await asyncio.sleep(rng.uniform(0.0, 0.02))
        stack.signal(replica, signal.SIGKILL)
        try:
            await doomed
        except httpx2.TransportError:
            pass  # cut with its replica: the client cannot know whether it applied
        # The retry waits for HAProxy to take the dead replica out: one sent sooner can be cut by HAProxy's
        # own mark-down of that replica (the stock-clients issue), which is not what this test is about.
        deadline = time.monotonic() + 10
        while stack.backend_status().get(replica, "DOWN").startswith("UP") and time.monotonic() < deadline:  # noqa: ASYNC110 (HAProxy's state, in another process)
            await asyncio.sleep(0.1)
        retried = result_of(await keyed(raw, shape.once, key))
        assert retried["instance"] != replica
        assert shape.applied_once(await raw.call(*shape.read), 2), f"attempt {attempt}"
        stack.start(replica)
        stack.wait_healthy("haproxy")


async def test_a_drain_loses_no_call(healed: tuple[Shape, Stack], http: httpx2.AsyncClient) -> None:
    shape, stack = healed
    sessions = [RawSession(http, stack.config.mcp_url) for _ in range(4)]
    for s in sessions:
        await s.initialize()
    served: dict[str, int] = {}
    for s in sessions:
        instance = (await s.call(*shape.write))["instance"]
        served[instance] = served.get(instance, 0) + 1
    busiest = max(served, key=served.__getitem__)
    acknowledged = [1] * len(sessions)
    failures: list[str] = []

    async def steady(i: int, until: float) -> None:
        while time.monotonic() < until:
            response = await sessions[i].post("tools/call", {"name": shape.write[0], "arguments": shape.write[1]})
            message = last_jsonrpc_message(response) if response.status_code == 200 else {}
            if "result" in message and not message["result"].get("isError"):
                acknowledged[i] += 1
            else:
                failures.append(f"{response.status_code} {response.text[:200]}")

    until = time.monotonic() + 4
    load = [asyncio.create_task(steady(i, until)) for i in range(len(sessions))]
    await asyncio.sleep(0.5)
    stack.signal(busiest, signal.SIGTERM)
    await asyncio.gather(*load)
    assert failures == []
    for i, s in enumerate(sessions):
        after = await s.call(*shape.read)
        if shape.module == "server":
            assert after["counter"] == acknowledged[i]
        else:
            assert after["items"] == {"apple": acknowledged[i]}


async def test_a_sessionless_client_keeps_state_with_a_handle(shaped: tuple[Shape, Stack]) -> None:
    shape, stack = shaped
    async with Client(stack.config.mcp_url, timeout=30) as client:  # 2026-07-28: no MCP session
        handle = (await client.call_tool("create_session", {})).data["session_id"]
        name, arguments = shape.write
        instances = set()
        for _ in range(6):
            instances.add(
                (await client.call_tool(name, {**arguments, "session_id": handle})).structured_content["instance"]
            )
        read = (await client.call_tool(shape.read[0], {"session_id": handle})).structured_content
    assert len(instances) > 1, "every call landed on one replica: the test proves nothing"
    if shape.module == "server":
        assert read["counter"] == 6
    else:
        assert read["items"] == {"apple": 6}
