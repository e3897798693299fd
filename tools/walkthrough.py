"""A scripted tour of a running stack (what `make demo` shows).

1. a session sticks to one replica while its counter climbs;
2. that replica is stopped (it drains first: HAProxy takes it out, in-flight
   calls finish);
3. the client carries on under the same session id: another replica adopts the
   session, with the same counter and notes;
4. the replica is started again;
5. a sessionless (MCP 2026-07-28) client keeps its counter through a handle,
   whichever replica answers.

Run it against the local stack after `python stack.py up -d`:

    python -m tools.walkthrough
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from typing import Any

from fastmcp import Client
from rich.console import Console

from mcp_ha.ops.stack import Stack
from mcp_ha.resilient_client import ResilientClient

console = Console()


def _get_json(url: str) -> tuple[int, Any]:
    """GET `url`: its status and JSON body (blocking: run it in a thread)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, json.loads(response.read())


async def tour(stack: Stack) -> None:
    c = stack.config
    status, body = await asyncio.to_thread(_get_json, f"http://{c.host}:{c.http_port}/health")
    console.print(f"[bold]GET /health[/bold] → {status} {body}")

    async with ResilientClient(c.mcp_url, max_retries=5, call_timeout=5) as client:
        console.rule("1. Stickiness: every call of one session lands on the same replica")
        console.print(f"session id {client.session_id}")
        for _ in range(5):
            result = (await client.call_tool("increment_counter", {})).data
            console.print(f"  increment_counter → counter={result['counter']} on [cyan]{result['instance']}[/cyan]")
        replica = result["instance"]
        for note in ("first note", "second note"):
            await client.call_tool("add_note", {"note": note})
        console.print(f"  notes: {(await client.call_tool('list_notes', {})).data['notes']}")

        console.rule(f"2. Stop the session's replica: python stack.py stop {replica}")
        started = time.monotonic()
        stack.stop(replica)
        console.print(
            f"  {replica} drained and stopped in {time.monotonic() - started:.1f} s; "
            f"HAProxy shows it {stack.backend_status().get(replica)}"
        )

        console.rule("3. The same session goes on, adopted by another replica")
        result = (await client.call_tool("increment_counter", {})).data
        console.print(f"  increment_counter → counter={result['counter']} on [cyan]{result['instance']}[/cyan]")
        notes = (await client.call_tool("list_notes", {})).data["notes"]
        console.print(f"  notes: {notes}")
        console.print(f"  session id {client.session_id}: unchanged, no resume needed")

    console.rule(f"4. Start it again: python stack.py start {replica}")
    stack.start(replica)
    stack.wait_healthy("haproxy")
    console.print(f"  HAProxy sees {stack.backend_status()}")

    console.rule("5. A sessionless (2026-07-28) client: state by handle, on any replica")
    async with Client(c.mcp_url, timeout=10) as sessionless:
        handle = (await sessionless.call_tool("create_session", {})).data["session_id"]
        console.print(f"  create_session → session_id={handle}")
        for _ in range(4):
            result = (await sessionless.call_tool("increment_counter", {"session_id": handle})).data
            console.print(
                f"  increment_counter(session_id) → counter={result['counter']} on [cyan]{result['instance']}[/cyan]"
            )


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(tour(Stack.load()))
