"""The official TypeScript SDK's v2 client (`@modelcontextprotocol/client`, pinned to 2026-07-28), unmodified.

`tests/clients/ts/client.mjs` drives it; `make test` installs it (`npm ci`).
What it must get from the kit: a multi-round-trip request whose legs reach two
replicas, and a listen stream that hears changes made through another replica.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import two_replicas
from fastmcp import Client

from mcp_ha.ops.stack import Stack

pytestmark = [pytest.mark.timeout(180), pytest.mark.node]
CLIENT = Path(__file__).resolve().parent / "ts" / "client.mjs"
ROUND_TRIPS = 20


def node() -> str:
    found = shutil.which("node")
    assert found and (CLIENT.parent / "node_modules").is_dir(), (
        "node and `npm ci --prefix tests/clients/ts` (make test)"
    )
    return found


def test_elicitation_whose_legs_reach_two_replicas_succeeds_20_times(redis_stack: Stack, tmp_path: Path) -> None:
    with two_replicas(redis_stack, tmp_path) as (one, two):
        run = subprocess.run(
            [node(), str(CLIENT), "elicit", f"{one.url},{two.url}", str(ROUND_TRIPS)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    hosts = {f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"}
    assert all(len(set(legs)) == 2 and set(legs) <= hosts for legs in answer["legs"]), answer["legs"]
    assert len(answer["legs"]) == ROUND_TRIPS
    assert answer["ok"] == ROUND_TRIPS, answer["results"]


def test_a_listen_stream_hears_a_change_made_through_another_replica(redis_stack: Stack, tmp_path: Path) -> None:
    with two_replicas(redis_stack, tmp_path) as (one, two):

        async def scenario() -> list[dict]:
            async with Client(two.url) as writer:
                handle = (await writer.call_tool("create_session")).structured_content["session_id"]
                uri = f"resource://session/{handle}/summary"
                listener = await asyncio.create_subprocess_exec(
                    node(), str(CLIENT), "listen", one.url, uri, "10", stdout=asyncio.subprocess.PIPE
                )
                assert listener.stdout is not None
                lines = [json.loads(await asyncio.wait_for(listener.stdout.readline(), 30))]
                assert lines == [{"acked": True}]
                for _ in range(3):
                    await writer.call_tool("increment_counter", {"session_id": handle})
                    lines.append(json.loads(await asyncio.wait_for(listener.stdout.readline(), 5)))
                listener.terminate()
                await listener.wait()
                return lines

        lines = asyncio.run(scenario())
    assert [(line.get("event"), line.get("uri")) for line in lines[1:]] == [("resources/updated", lines[1]["uri"])] * 3
    assert lines[1]["uri"].startswith("resource://session/")
