"""HighAvailability, the one entry point: what it wires, what it refuses, and that its app keeps every
guarantee in whichever ASGI server runs it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fastmcp import FastMCP
from fastmcp.server.server import StateValue

from mcp_ha import HighAvailability, Session, Settings
from mcp_ha.ops.check.wire import PROTOCOL, RawSession
from mcp_ha.ops.stack import free_ports
from mcp_ha.stores.memory_store import InMemorySessionStore

ROOT = Path(__file__).resolve().parents[2]


def imported_by(code: str, **env: str) -> set[str]:
    """The top-level and mcp_ha modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.process
def test_a_server_without_auth_or_metrics_imports_neither() -> None:
    modules = imported_by(
        "from mcp_ha import HighAvailability, Settings\n"
        "ha = HighAvailability(Settings(metrics=False))\n"
        "ha.http_app(ha.server('bare'))"
    )
    assert "mcp_ha.replica" in modules
    assert not {"mcp_ha.metrics", "prometheus_client", "mcp_ha.auth"} & modules


@pytest.mark.process
def test_importing_the_demo_server_connects_to_nothing() -> None:
    """Every connection a socket tries raises an audit event: the import's are recorded, and there are none
    (Redis on port 1, which refuses every connection, for one that would be tried and its failure swallowed)."""
    probe = (
        "import sys\n"
        "connects = []\n"
        "sys.addaudithook(lambda event, args: connects.append(args[1]) if event == 'socket.connect' else None)\n"
        "import server\n"
        "assert not connects, f'importing the server connected to {connects}'"
    )
    modules = imported_by(probe, REDIS_URL="redis://127.0.0.1:1/0")
    assert "mcp_ha.stores.redis_store" in modules


@pytest.mark.quick
def test_a_session_made_without_epoch_call_and_owner_fails_at_once() -> None:
    with pytest.raises(TypeError):
        Session(InMemorySessionStore(), "0" * 32)  # type: ignore[call-arg]


@pytest.mark.quick
def test_http_app_serves_only_a_server_it_made() -> None:
    ha = HighAvailability(Settings(metrics=False))
    with pytest.raises(ValueError, match=r"HighAvailability\.server"):
        ha.http_app(FastMCP("made elsewhere"))


@pytest.mark.quick
def test_a_store_of_your_own_is_used_as_given() -> None:
    store = InMemorySessionStore()
    assert HighAvailability(Settings(metrics=False), store=store).store is store


# uvicorn as docs/patterns.md runs it, with the protocol that writes a whole answer at once.
UVICORN = [sys.executable, "-m", "uvicorn", "--http", "mcp_ha.whole_answers:WholeAnswers"]


@pytest.mark.slow
def test_served_by_plain_uvicorn_the_app_still_drains_on_sigterm(tmp_path: Path) -> None:
    """`uvicorn server:app`, not `python server.py`, with the kit's protocol as patterns.md gives it: SIGTERM
    still refuses new work at once and lets the call in flight finish, and the process exits once the drain
    is done."""
    (port,) = free_ports(1)
    log = open(tmp_path / "uvicorn.log", "wb")
    proc = subprocess.Popen(
        [*UVICORN, "server:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/mcp"

    async def scenario() -> None:
        async with httpx2.AsyncClient(timeout=30) as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "uvicorn.log").read_text()
                await asyncio.sleep(0.1)
            raw = RawSession(http, url)
            await raw.initialize()
            in_flight = asyncio.create_task(raw.call("analyze_data", {"num_items": 20}))  # about 1 s
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            refused = await RawSession(http, url).post(
                "initialize",
                {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
            )
            assert refused.status_code == 503 and refused.headers.get("retry-after") == "1"
            assert (await in_flight)["items_processed"] == 20

    try:
        asyncio.run(scenario())
        proc.wait(timeout=20)  # no balancer checks it: the drain waits out its notice bound (3 s), then exits
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.quick
def test_a_session_state_store_of_your_own_keeps_what_is_not_a_handle() -> None:
    from key_value.aio.stores.memory import MemoryStore

    from mcp_ha.fastmcp_store import FastMCPSessions

    own = MemoryStore()
    ha = HighAvailability(Settings(metrics=False), store=InMemorySessionStore())
    mcp = ha.server("own-store", session_state_store=own)

    async def scenario() -> object:
        await mcp._state_store.put(key="not-a-handle", value=StateValue(value=1))
        return await own.get("not-a-handle", collection="fastmcp_state")

    assert isinstance(mcp._state_storage, FastMCPSessions)
    assert asyncio.run(scenario()) == {"value": 1}


def _documented(section: str) -> list[str]:
    """The layer names docs/architecture.md's "A request's way in" lists under `section` (a line's start)."""
    text = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    way_in = text.split("## A request's way in", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"(?m)^{section}\d+\. `(\w+)`", way_in)


def _chain(app: Any) -> list[str]:
    """The kit's ASGI layers from `app` inwards, following each one's `.app`, until one that is not the kit's."""
    names = []
    while type(app).__module__.startswith("mcp_ha."):
        names.append(type(app).__name__)
        app = app.app
    return names


@pytest.mark.quick
def test_the_layers_http_app_builds_are_the_documented_ones_in_their_order() -> None:
    from starlette.routing import Route

    ha = HighAvailability(Settings(metrics=True), store=InMemorySessionStore())
    mcp = ha.server("layers")
    app = ha.http_app(mcp)
    outer = _chain(app)
    starlette = app
    while type(starlette).__module__.startswith("mcp_ha."):
        starlette = starlette.app
    (route,) = [r for r in starlette.routes if isinstance(r, Route) and r.path == "/mcp"]
    documented = _documented("")
    assert outer + _chain(route.app) == documented, documented
    # The kit's FastMCP middlewares, in the server, outermost first (after FastMCP's own).
    kit = [type(m).__name__ for m in mcp.middleware if type(m).__module__.startswith("mcp_ha.")]
    # ToolSchemas only where FastMCP serves the SDK no schemas of its own (before 4.2), as documented.
    fastmcp_serves_schemas = FastMCP("probe")._mcp_server.get_tool_input_schema is not None
    assert kit == [name for name in _documented("    ") if not (fastmcp_serves_schemas and name == "ToolSchemas")]
    # Nothing but the MCP route passes through the endpoint's layers.
    others = [r for r in starlette.routes if isinstance(r, Route) and r.path != "/mcp"]
    assert {r.path for r in others} >= {"/health", "/metrics"}
    assert all(_chain(r.app) == [] for r in others)


@pytest.mark.quick
def test_http_app_wires_a_server_once() -> None:
    ha = HighAvailability(Settings(metrics=False), store=InMemorySessionStore())
    mcp = ha.server("once")
    ha.http_app(mcp)
    wired = list(mcp.middleware)
    with pytest.raises(RuntimeError, match="once"):
        ha.http_app(mcp)
    assert mcp.middleware == wired


@pytest.mark.quick
def test_what_the_process_does_differently_lasts_while_the_app_serves() -> None:
    """FastMCP's telemetry and the log filter are the app's lifespan's, not the server's or http_app's."""
    import logging

    import fastmcp
    from starlette.testclient import TestClient

    before = fastmcp.settings.telemetry_mode
    logger = logging.getLogger("fastmcp.server.server")
    filters = list(logger.filters)
    ha = HighAvailability(Settings(metrics=False), store=InMemorySessionStore())
    app = ha.http_app(ha.server("process"))
    assert (fastmcp.settings.telemetry_mode, logger.filters) == (before, filters)
    with TestClient(app):
        assert fastmcp.settings.telemetry_mode == "off"
        assert len(logger.filters) == len(filters) + 1
    assert (fastmcp.settings.telemetry_mode, logger.filters) == (before, filters)
