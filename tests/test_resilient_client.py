"""ResilientClient against real failures: killed, hung and restarted replicas."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fastmcp.exceptions import ToolError

from mcp_ha import resilient_client
from mcp_ha.errors import SESSION_MOVED
from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.ops.stack import Stack, free_ports
from mcp_ha.resilient_client import ResilientClient, TransientFailure
from mcp_ha.session_store import STORE_UNAVAILABLE

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


@pytest.mark.quick
def test_the_constants_it_copies_are_the_servers() -> None:
    assert resilient_client.IDEMPOTENCY_KEY == IDEMPOTENCY_KEY
    assert resilient_client.SESSION_MOVED == SESSION_MOVED
    assert resilient_client.STORE_UNAVAILABLE == STORE_UNAVAILABLE


@pytest.mark.process
def test_it_imports_nothing_from_the_server_side() -> None:
    probe = (
        "import sys, mcp_ha.resilient_client; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp_ha', 'server', 'prometheus_client')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['mcp_ha', 'mcp_ha.resilient_client']"


async def test_calls_return_the_tools_result_object(mcp_url: str) -> None:
    async with ResilientClient(mcp_url, max_retries=3) as client:
        result = await client.call_tool("increment_counter", {})
        assert result.data["counter"] == 1
        assert client.session_id and client.sessions == [client.session_id]


async def test_a_killed_replica_is_ridden_through_with_state(healed_stack: Stack, mcp_url: str) -> None:
    async with ResilientClient(mcp_url, max_retries=5, call_timeout=5) as client:
        for _ in range(3):
            replica = (await client.call_tool("increment_counter", {})).data["instance"]
        await client.call_tool("add_note", {"note": "kept"})
        first_session = client.session_id

        healed_stack.signal(replica, signal.SIGKILL)

        after = (await client.call_tool("increment_counter", {})).data
        assert after["instance"] != replica
        assert after["counter"] == 4
        assert (await client.call_tool("list_notes", {})).data["notes"] == ["kept"]
        # The same session, adopted by another replica: no new session, no resume.
        assert client.sessions == [first_session]


async def test_restarting_every_replica_at_once_is_ridden_through(healed_stack: Stack, mcp_url: str) -> None:
    replicas = healed_stack.config.replica_names()
    # Bounded by time rather than attempts: the outage lasts as long as the replicas take to start.
    async with ResilientClient(mcp_url, max_retries=200, call_timeout=5, total_timeout=60) as client:
        await client.call_tool("increment_counter", {})
        await client.call_tool("add_note", {"note": "before"})
        healed_stack.stop(*replicas)

        async def start_later() -> None:
            await asyncio.sleep(1.5)
            await asyncio.to_thread(lambda: [healed_stack.start(name) for name in replicas])

        restarting = asyncio.create_task(start_later())
        result = (await client.call_tool("increment_counter", {})).data
        await restarting
        assert result["counter"] == 2
        assert (await client.call_tool("list_notes", {})).data["notes"] == ["before"]


async def test_a_hung_replica_costs_a_timeout_not_a_hang(healed_stack: Stack, mcp_url: str) -> None:
    async with ResilientClient(mcp_url, max_retries=4, call_timeout=2, total_timeout=30) as client:
        replica = (await client.call_tool("increment_counter", {})).data["instance"]
        healed_stack.signal(replica, signal.SIGSTOP)
        result = (await client.call_tool("get_counter", {})).data
        assert result["instance"] != replica
        assert result["counter"] == 1


async def test_tool_errors_are_not_retried(mcp_url: str) -> None:
    async with ResilientClient(mcp_url, max_retries=5) as client:
        with pytest.raises(ToolError):
            await client.call_tool("analyze_data", {"num_items": -1})
        assert client.reconnects == 0


@pytest.mark.quick
async def test_an_unreachable_endpoint_fails_clearly_within_the_bounds() -> None:
    (port,) = free_ports(1)
    client = ResilientClient(f"http://127.0.0.1:{port}/mcp", max_retries=2, call_timeout=1, total_timeout=5)
    with pytest.raises(TransientFailure):
        await client.call_tool("get_counter", {})
