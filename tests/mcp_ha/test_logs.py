"""JSON log lines: a real replica's, and the id handling against hostile headers."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from conftest import replica_on

from mcp_ha.logs import MAX_REQUEST_ID, RequestFields, RequestIds, configure, json_formatter
from mcp_ha.ops.check.wire import RawSession, SessionlessSession
from mcp_ha.ops.stack import Stack


def log_lines(stack: Stack, replica: str) -> list[dict]:
    """Every line of the replica's log, each of which must be one JSON object."""
    lines = (stack.log_dir / f"{replica}.log").read_text().splitlines()
    assert lines
    return [json.loads(line) for line in lines]


async def wait_for_line(stack: Stack, replica: str, **fields: str) -> dict:
    for _ in range(50):  # the access line is written as the answer goes out: soon after the client has it
        found = [line for line in log_lines(stack, replica) if fields.items() <= line.items()]
        if found:
            return found[-1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no line of {replica} with {fields}")


async def test_every_line_is_json_and_a_requests_lines_name_its_session_and_request(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    replica = (await raw.call("increment_counter"))["instance"]
    request_id = f"test-{uuid.uuid4().hex}"
    direct = raw.at(f"http://127.0.0.1:{stack.service(replica).port}/mcp")
    old = uuid.uuid4().hex
    body = {
        "jsonrpc": "2.0",
        "id": 99,
        "method": "tools/call",
        "params": {"name": "resume_session", "arguments": {"old_session_id": old}},
    }
    response = await http.post(direct.url, headers={**direct.headers(), "X-Request-Id": request_id}, json=body)
    assert response.status_code == 200

    # The tool's own line and uvicorn's access line, both naming the request.
    tool_line = await wait_for_line(stack, replica, message="resumed 0 entries from a previous session")
    access_line = await wait_for_line(stack, replica, logger="uvicorn.access", request_id=request_id)
    for line in (tool_line, access_line):
        assert line["session_id"] == raw.session_id and line["request_id"] == request_id
        assert line["instance"] == replica and line["level"] == "INFO"
    assert "POST /mcp" in access_line["message"]
    for line in log_lines(stack, replica):
        assert {"time", "level", "logger", "message", "instance"} <= line.keys(), line
        assert line["instance"] == replica
    # A line logged outside any request (start-up) names none.
    startup = next(line for line in log_lines(stack, replica) if "Application startup complete" in line["message"])
    assert "session_id" not in startup and "request_id" not in startup


async def test_ids_a_replica_never_minted_are_kept_out_of_its_log(stack: Stack, http: httpx2.AsyncClient) -> None:
    replica = stack.config.replica_names()[0]
    marker = uuid.uuid4().hex
    forged_session = f"{marker}-../../admin"
    long_id = f"{marker}{'A' * 10_000}"
    response = await http.get(
        f"http://127.0.0.1:{stack.service(replica).port}/health",
        headers={"mcp-session-id": forged_session, "X-Request-Id": long_id},
    )
    assert response.status_code == 200
    line = await wait_for_line(stack, replica, logger="uvicorn.access", request_id=long_id[:MAX_REQUEST_ID])
    assert "session_id" not in line
    assert forged_session not in (stack.log_dir / f"{replica}.log").read_text()


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(json_formatter(instance="replica-test"))
    handler.addFilter(RequestFields())
    logger = logging.getLogger(f"test-structured-logs-{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, out
    logger.removeHandler(handler)


async def serve(app: RequestIds, headers: list[tuple[bytes, bytes]]) -> None:
    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers}

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        pass

    await app(scope, receive, send)


@pytest.mark.quick
async def test_hostile_header_values_never_reach_a_line_raw(captured) -> None:
    logger, out = captured
    hostile_request = "\x00\x1b[2J\x1b]0;owned\x07\r\nlevel=CRITICAL " + "x" * 10_000
    hostile_session = "\x1b[31m" + "a" * 31 + "\n"
    left_behind: list[asyncio.Task] = []
    request_over = asyncio.Event()

    async def app(scope, receive, send) -> None:
        logger.info("serving")

        async def later() -> None:  # like the SDK's task for a new session: it outlives the request
            await request_over.wait()
            logger.info("after the request")

        left_behind.append(asyncio.create_task(later()))

    await serve(
        RequestIds(app),
        [(b"mcp-session-id", hostile_session.encode("latin-1")), (b"x-request-id", hostile_request.encode("latin-1"))],
    )
    request_over.set()
    await left_behind[0]

    text = out.getvalue()
    assert "\x1b" not in text and "\x00" not in text and "\x07" not in text and "x" * 100 not in text
    serving, after = (json.loads(line) for line in text.splitlines())
    assert serving["message"] == "serving" and serving["instance"] == "replica-test"
    assert "session_id" not in serving
    assert len(serving["request_id"]) == MAX_REQUEST_ID and serving["request_id"].isprintable()
    assert serving["request_id"].startswith("\\x00\\x1b[2J")
    assert after["message"] == "after the request" and "request_id" not in after


@pytest.mark.quick
async def test_a_valid_session_id_and_a_plain_request_id_are_logged_as_sent(captured) -> None:
    logger, out = captured
    session_id = uuid.uuid4().hex

    async def app(scope, receive, send) -> None:
        logger.warning("inside")

    await serve(RequestIds(app), [(b"mcp-session-id", session_id.encode()), (b"x-request-id", b"7F00-1")])
    logger.warning("outside")
    inside, outside = (json.loads(line) for line in out.getvalue().splitlines())
    assert (inside["session_id"], inside["request_id"], inside["level"]) == (session_id, "7F00-1", "WARNING")
    assert "session_id" not in outside and "request_id" not in outside


@pytest.mark.quick
def test_an_unknown_log_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="LOG_FORMAT must be one of json, text"):
        configure(log_format="xml", instance="x")


async def test_clients_that_hang_up_mid_request_leave_no_error_in_the_log(redis_stack: Stack, tmp_path: Path) -> None:
    """Finding 12: HAProxy cutting 2026-07-28 requests mid-body logged ERROR "Exception in ASGI application"
    with a ClientDisconnect traceback for each. A client's doing: at most one line, below ERROR."""
    with replica_on(redis_stack, tmp_path, "cut", LOG_FORMAT="json") as replica:
        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, replica.url)
            await session.initialize()
            sessionless = SessionlessSession(http, replica.url)

            def request(client: RawSession, request_id: int) -> bytes:
                params = client._params({"name": "analyze_data", "arguments": {"num_items": 20}})
                body = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params})
                headers = client._wire_headers("tools/call", params)
                head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
                return (
                    f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}Content-Length: {len(body)}\r\n\r\n{body}"
                ).encode()

            async def cut(client: RawSession, request_id: int, where: str) -> None:
                reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
                data = request(client, request_id)
                writer.write(data[:-10] if where == "mid-body" else data)
                await writer.drain()
                if where == "mid-answer":
                    await reader.read(1)
                    await asyncio.sleep(request_id % 5 * 0.1)
                else:
                    await asyncio.sleep(0.05)
                writer.transport.abort()

            cuts = [
                cut(client, 1000 * n + i, where)
                for n, where in enumerate(("mid-body", "after-body", "mid-answer"))
                for client in (session, sessionless)
                for i in range(10)
            ]
            await asyncio.gather(*cuts)
            # Served as ever afterwards.
            assert (await sessionless.call("increment_counter", {"session_id": await sessionless.open()}))[
                "counter"
            ] == 1
            await asyncio.sleep(1.5)  # the cut calls run on to their ends
    text = replica.log.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]  # not the start-up notice
    assert [line for line in lines if line["level"] in ("ERROR", "CRITICAL") or "exc_info" in line] == []
    assert "Traceback" not in text
