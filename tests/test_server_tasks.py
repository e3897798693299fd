"""The demo's analyze_data as a durable task (server.py, mcp_ha/tasks.py), for FastMCP's Client with its tasks
extension, through HAProxy on the whole stack: the replica running it killed, or a cancel sent through another
replica. The replica running a task is the one `tasks/get` names (mcp_ha.ops.check.clients.TaskSeen reads it)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from datetime import datetime

import pytest

pytest.importorskip("fastmcp_tasks", reason="durable tasks need the kit's tasks extra (fastmcp-tasks)")

from fastmcp import Client
from fastmcp.client.transports import StreamableHttpTransport
from fastmcp_tasks import ToolTask, call_tool_task
from mcp.types import TextResourceContents

from mcp_ha.ops.check.clients import TaskSeen
from mcp_ha.ops.stack import Stack

# Kill -9 runs: TASK_KILL_RUNS=5 pytest tests/test_server_tasks.py -k outlives -s prints the figures of each.
KILL_RUNS = int(os.environ.get("TASK_KILL_RUNS", "1"))
ITEMS = 160  # 50 ms each: 8 s of work, checkpointed every 10 items
EXPECTED = {"items_processed": ITEMS, "total_score": 1.5 * ITEMS * (ITEMS + 1) / 2}
RESUMED = re.compile(r"task (\S+): Starting analysis of \d+ items on (\S+) \(resumed after item (\d+)\)")


def seen_client(stack: Stack, seen: TaskSeen) -> Client:
    """FastMCP's Client (conftest.py imported its tasks extension) whose tasks/get answers `seen` reads."""
    return Client(StreamableHttpTransport(stack.config.mcp_url, httpx_client_factory=seen.factory()), timeout=30)


async def analysis_result(client: Client, handle: str) -> dict | None:
    contents = await client.read_resource(f"resource://session/{handle}/summary")
    assert isinstance(contents[0], TextResourceContents), contents
    return json.loads(contents[0].text)["analysis_result"]


def resumed_after(stack: Stack, replica: str) -> list[tuple[str, int, float]]:
    """(task id, item, when) of each run of analyze_data on `replica` that resumed from a checkpoint, from its
    log (a task's log messages go to the server's log)."""
    found = []
    for line in (stack.config.state_dir / "logs" / f"{replica}.log").read_text().splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if (m := RESUMED.fullmatch(record.get("message", ""))) and m.group(2) == replica:
            found.append((m.group(1), int(m.group(3)), datetime.fromisoformat(record["time"]).timestamp()))
    return found


async def test_analyze_data_as_a_task_outlives_the_replica_running_it(healed_stack: Stack) -> None:
    """The issue's "done when": FastMCP's own call_tool, analyze_data run as a task; kill -9 of the replica
    running it. The call returns the right result, from another replica that resumed the work from its
    latest checkpoint instead of redoing it, and the progress the client saw never fell."""
    stack = healed_stack
    figures = []
    for _ in range(KILL_RUNS):
        seen = TaskSeen()
        async with seen_client(stack, seen) as client:
            handle = (await client.call_tool("create_session", {})).data["session_id"]
            call = asyncio.create_task(client.call_tool("analyze_data", {"num_items": ITEMS, "session_id": handle}))
            await asyncio.wait_for(seen.named.wait(), 15)
            runner = seen.runner
            assert runner is not None
            await asyncio.sleep(1.5)  # some 30 items done, and checkpointed
            killed_at = time.time()
            stack.signal(runner, signal.SIGKILL)
            try:
                result = await asyncio.wait_for(call, 60)
                done_at = time.time()
            finally:
                stack.start(runner)
            answer = dict(result.structured_content or {})
            survivor = answer.pop("instance")
            assert survivor != runner and answer == EXPECTED
            assert await analysis_result(client, handle) == EXPECTED
            task_ids = {p["task"] for p in seen.polls}
            [(item, resumed_at)] = [(i, at) for t, i, at in resumed_after(stack, survivor) if t in task_ids]
            assert 10 <= item < ITEMS and item % 10 == 0  # carried on from a checkpoint: the work applied once
            reached = [int(p["message"].split()[1].split("/")[0]) for p in seen.polls if p["message"]]
            assert reached == sorted(reached) and reached[-1] > item, reached  # progress only rose
            figures.append((round(resumed_at - killed_at, 2), round(done_at - killed_at, 2), item))
    print(f"\nanalyze_data({ITEMS}) as a task, kill -9 -> (resumed elsewhere s, result s, after item): {figures}")


async def test_a_cancel_through_another_replica_stops_analyze_data_running_as_a_task(stack: Stack) -> None:
    """tasks/cancel sent straight to a replica that is not running the task wins: the task is cancelled
    at once and its run on the other replica stops (it never stores its result)."""
    seen = TaskSeen()
    async with seen_client(stack, seen) as client:
        handle = (await client.call_tool("create_session", {})).data["session_id"]
        task = await call_tool_task(client, "analyze_data", {"num_items": 100, "session_id": handle})

        async def poll() -> None:
            while True:  # until tasks/get names the replica running it (TaskSeen notes each answer)
                await task.status()
                await asyncio.sleep(0.05)

        polling = asyncio.create_task(poll())
        try:
            await asyncio.wait_for(seen.named.wait(), 15)
        finally:
            polling.cancel()
        runner = seen.runner
        other = next(n for n in stack.config.replica_names() if n != runner)
        port = stack.config.replica_ports[stack.config.replica_names().index(other)]
        await asyncio.sleep(1.0)
        async with Client(f"http://{stack.config.host}:{port}/mcp", timeout=30) as direct:
            await ToolTask(direct, "analyze_data", task.create_result).cancel()
        assert (await task.status()).status == "cancelled"
        await asyncio.sleep(100 * 0.05)  # as long as the whole analysis would have taken
        assert (await task.status()).status == "cancelled"
        assert await analysis_result(client, handle) is None
