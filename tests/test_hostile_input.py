"""Hostile input against a live stack, and a lost store.

Every input ends in a 4xx, a JSON-RPC error or a tool error (`isError`), within a
client timeout; never a 5xx or a hang. After each class (each test using
`unharmed`) every replica still runs under the same pid and answers /health
with 200, no replica has logged a traceback, and a bystander session and a
bystander handle hold exactly the state they had. Inputs go through HAProxy
and, where HAProxy's own limits could be all that stands, straight to a
replica. Each input is counted by class in `conftest.HOSTILE_INPUTS`, printed
at the end of the run; a test that sent nothing fails.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
from conftest import HOSTILE_INPUTS, stack_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from mcp_ha.handles import UNKNOWN_HANDLE
from mcp_ha.ops.check.wire import ACCEPT, PROTOCOL, RawSession, jsonrpc_messages, last_jsonrpc_message
from mcp_ha.ops.stack import Stack, http_status

# No answer within this long is a hang, and fails the test.
TIMEOUT = 20.0
# The documented bound on a note (server.MAX_NOTE_BYTES, in UTF-8), stated here as the contract clients see.
MAX_NOTE_BYTES = 10_000
MODERN = "2026-07-28"
MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientInfo": {"name": "hostile", "version": "1"},
    "io.modelcontextprotocol/clientCapabilities": {},
}
STATEFUL_TOOLS = {
    "increment_counter": {},
    "get_counter": {},
    "add_note": {"note": "n"},
    "list_notes": {},
    "analyze_data": {"num_items": 0},
    "watch_counter": {"duration_seconds": 0},
    "resume_session": {"old_session_id": "x"},
}
# Values no header should carry: control characters, bytes that are not UTF-8,
# non-ASCII, terminal escapes, and lengths past any sane header.
HOSTILE_HEADER_VALUES = [
    b"\x00",
    b"a\x01b",
    b"\x7f",
    b"a\rb",
    b"a\nb",
    b"\x1b[31m",
    b"\xff\xfe",
    "é日本\u202e".encode(),
    b"x" * 10_000,
    b"x" * 100_000,
]
# The same as strings, for JSON, where any of them can be sent (json.dumps escapes the lone surrogate).
HOSTILE_STRINGS = [
    "",
    "\x00",
    "a\x01b",
    "\x1b[31m",
    "\u202e",
    "é日本",
    "\ud800",
    "*",
    "?" * 32,
    "[a-f]*",
    "mcp:session:*",
    "../../etc/passwd",
    "%2e%2e%2f",
    "x" * 10_000,
    "x" * 100_000,
]


def tried(kind: str, count: int = 1) -> None:
    HOSTILE_INPUTS[kind] += count


def headers_for(session_id: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": PROTOCOL}
    if session_id:
        headers["mcp-session-id"] = session_id
    return headers


def tool_call(name: object, arguments: object) -> dict:
    return {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def modern_call(name: str, arguments: dict) -> tuple[dict, dict[str, str]]:
    """A sessionless (2026-07-28) tools/call and its headers."""
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments, "_meta": MODERN_META},
    }
    return body, {
        "Content-Type": "application/json",
        "Accept": ACCEPT,
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": "tools/call",
        "Mcp-Name": name,
    }


def assert_refused(response: httpx2.Response) -> dict | None:
    """A 4xx, or a 200 whose answer is a JSON-RPC error or a tool error; the answer, when there is one."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        return None
    assert response.status_code == 200, (response.status_code, response.text[:500])
    message = last_jsonrpc_message(response)
    assert "error" in message or message["result"].get("isError") is True, str(message)[:500]
    return message


def assert_answered(response: httpx2.Response) -> None:
    """No 5xx; a 200 carries a JSON-RPC answer (202: taken for a notification, nothing to answer)."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code == 200:
        message = jsonrpc_messages(response)[-1]
        assert "result" in message or "error" in message, str(message)[:500]


async def send_raw(port: int, request: bytes) -> tuple[int, bytes]:
    """The status and response of one HTTP/1.1 request sent as bytes, for what httpx refuses to send
    (control characters).

    The whole response is read (the request says `Connection: close`): leaving after the status line
    would cut a tool call's stream and cancel the call.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), TIMEOUT)
    finally:
        writer.close()
    assert response.startswith(b"HTTP/1.1 "), response[:100]
    return int(response.split()[1]), response


def raw_request(method: str, headers: dict[bytes, bytes], body: bytes = b"") -> bytes:
    lines = [
        f"{method} /mcp HTTP/1.1".encode(),
        b"Host: 127.0.0.1",
        b"Connection: close",
        b"Content-Length: " + str(len(body)).encode(),
    ]
    lines += [name + b": " + value for name, value in headers.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass
class Guard:
    """What no hostile input may change: the replicas' processes, their logs' silence, a bystander's state."""

    stack: Stack
    http: httpx2.AsyncClient
    bystander: RawSession
    handle: str
    event_ids: list[str]
    pids: dict[str, int | None] = field(default_factory=dict)
    log_offsets: dict[str, int] = field(default_factory=dict)

    def replicas(self) -> Iterator[tuple[str, int]]:
        return zip(self.stack.config.replica_names(), self.stack.config.replica_ports, strict=True)

    def tracebacks(self) -> list[str]:
        """Log lines with a traceback written since the last call (the log is one JSON object per line)."""
        found = []
        for name, _ in self.replicas():
            with (self.stack.log_dir / f"{name}.log").open("rb") as log:
                log.seek(self.log_offsets.get(name, 0))
                chunk = log.read()
            self.log_offsets[name] = self.log_offsets.get(name, 0) + len(chunk)
            found += [line.decode(errors="replace")[:2000] for line in chunk.splitlines() if b'"exc_info"' in line]
        return found

    async def check(self) -> None:
        for name, port in self.replicas():
            assert self.stack.pid(name) == self.pids[name], f"{name} restarted"
            assert (await self.http.get(f"http://127.0.0.1:{port}/health")).status_code == 200, name
        assert self.tracebacks() == []
        assert (await self.bystander.call("get_counter"))["counter"] == 1
        assert (await self.bystander.call("list_notes"))["notes"] == ["mine"]
        assert (await self.bystander.call("get_counter", {"session_id": self.handle}))["counter"] == 2
        assert (await self.bystander.call("list_notes", {"session_id": self.handle}))["notes"] == ["theirs"]


@pytest.fixture(scope="module")
async def guard(stack: Stack) -> AsyncIterator[Guard]:
    async with httpx2.AsyncClient(timeout=TIMEOUT) as http:
        bystander = RawSession(http, stack.config.mcp_url)
        await bystander.initialize()
        await bystander.call("increment_counter")
        await bystander.call("add_note", {"note": "mine"})
        handle = (await bystander.call("create_session"))["session_id"]
        for _ in range(2):
            await bystander.call("increment_counter", {"session_id": handle})
        await bystander.call("add_note", {"note": "theirs", "session_id": handle})
        async with bystander.stream("tools/call", {"name": "analyze_data", "arguments": {"num_items": 0}}) as stream:
            event_ids = [event.id async for event in stream if event.id]
        assert event_ids
        guard = Guard(
            stack,
            http,
            bystander,
            handle,
            event_ids,
            pids={name: stack.pid(name) for name in stack.config.replica_names()},
        )
        guard.tracebacks()  # from here on
        yield guard


@pytest.fixture
async def unharmed(guard: Guard) -> AsyncIterator[Guard]:
    """Fails the test unless it sent at least one hostile input and the stack and bystander came through."""
    before = sum(HOSTILE_INPUTS.values())
    yield guard
    assert sum(HOSTILE_INPUTS.values()) > before, "no hostile input was sent"
    await guard.check()


@pytest.fixture
async def attacker(guard: Guard) -> RawSession:
    """The hostile client's own session, through HAProxy."""
    session = RawSession(guard.http, guard.stack.config.mcp_url)
    await session.initialize()
    return session


def targets(stack: Stack) -> list[str]:
    """HAProxy, then each replica directly."""
    return [stack.config.mcp_url] + [f"http://127.0.0.1:{port}/mcp" for port in stack.config.replica_ports]


# -- malformed JSON, batches, wrong JSON-RPC types -------------------------------------------


def malformed_bodies() -> list[bytes]:
    valid = json.dumps(tool_call("increment_counter", {})).encode()
    truncated = [valid[:cut] for cut in range(0, len(valid), 7)]
    return [
        *truncated,
        b"not json",
        b'"just a string"',
        b"null",
        b"1",
        b"true",
        b"{",
        b"}",
        b'{"a":1}',
        b"\xff\xfe",
        b"\xef\xbb\xbf" + valid,
        valid + b"x",
        valid + valid,
        valid.replace(b'"2.0"', b"'2.0'"),
        b'{"jsonrpc":"2.0","id":1,"method":"ping\\x"}',
        b'{"jsonrpc":"2.0","id":1,"method":"\\ud800"}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping",}',
        b'{"jsonrpc":"2.0","id":01,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1,"method":"ping"' + b" " * 100_000,
    ]


async def test_malformed_and_truncated_json_is_a_4xx_json_rpc_error(unharmed: Guard, attacker: RawSession) -> None:
    for i, body in enumerate(malformed_bodies()):
        url = targets(unharmed.stack)[i % 4]
        response = await attacker.http.post(url, headers=attacker.headers(), content=body)
        assert 400 <= response.status_code < 500, (body[:80], response.status_code, response.text[:300])
        assert "error" in response.json(), body[:80]
        tried("malformed or truncated JSON body")
    # Not one truncated increment was applied.
    assert (await attacker.call("get_counter"))["counter"] == 0


async def test_batches_are_refused_with_a_4xx(unharmed: Guard, attacker: RawSession) -> None:
    call = tool_call("increment_counter", {})
    batches = [
        [],
        [call],
        [call, call],
        [{"jsonrpc": "2.0", "method": "notifications/initialized"}],
        [[call]],
        [call] * 1000,
        [{"jsonrpc": "2.0", "id": 1, "method": "ping"}, 1, None],
    ]
    for i, batch in enumerate(batches):
        response = await attacker.http.post(targets(unharmed.stack)[i % 4], headers=attacker.headers(), json=batch)
        assert 400 <= response.status_code < 500, (str(batch)[:80], response.status_code)
        tried("JSON-RPC batch")
    assert (await attacker.call("get_counter"))["counter"] == 0


WRONG_ENVELOPES = {
    "id as object": {"id": {"a": 1}},
    "id as list": {"id": [1]},
    "id as bool": {"id": True},
    "id null": {"id": None},
    "id fractional": {"id": 1.5},
    "id NaN": {"id": float("nan")},
    "jsonrpc 1.0": {"jsonrpc": "1.0"},
    "jsonrpc as number": {"jsonrpc": 2.0},
    "no jsonrpc": {"jsonrpc": ...},
    "method as number": {"method": 5},
    "method null": {"method": None},
    "method as list": {"method": ["tools/call"]},
    "method with NUL": {"method": "tools/call\x00"},
    "no method": {"method": ...},
    "params as list": {"params": [{"name": "increment_counter"}]},
    "params as string": {"params": "x"},
    "params as number": {"params": 1},
    "params null": {"params": None},
    "name as list": {"params": {"name": ["increment_counter"], "arguments": {}}},
    "name as number": {"params": {"name": 5, "arguments": {}}},
    "arguments as list": {"params": {"name": "increment_counter", "arguments": []}},
    "arguments as string": {"params": {"name": "increment_counter", "arguments": "{}"}},
    "_meta as list": {"params": {"name": "increment_counter", "arguments": {}, "_meta": []}},
    "idempotency key as object": {
        "params": {
            "name": "increment_counter",
            "arguments": {},
            "_meta": {"io.github.mcp-ha-kit/idempotency-key": {"a": 1}},
        }
    },
    "progress token as object": {
        "params": {"name": "increment_counter", "arguments": {}, "_meta": {"progressToken": {"a": 1}}}
    },
    "an error with a method": {"error": {"code": 1, "message": "m"}},
}


@pytest.mark.parametrize("variant", WRONG_ENVELOPES)
async def test_wrong_json_rpc_types_are_refused_and_never_applied(
    unharmed: Guard, attacker: RawSession, variant: str
) -> None:
    envelope = {
        k: v for k, v in {**tool_call("increment_counter", {}), **WRONG_ENVELOPES[variant]}.items() if v is not ...
    }
    for url in targets(unharmed.stack)[:2]:
        response = await attacker.http.post(url, headers=attacker.headers(), content=json.dumps(envelope))
        # The SDK takes a message whose id is not a JSON-RPC id for a notification: 202, no answer, nothing run.
        if response.status_code != 202:
            assert_refused(response)
        tried("wrong JSON-RPC types")
    assert (await attacker.call("get_counter"))["counter"] == 0


async def test_unknown_tool_is_an_error_result(raw: RawSession) -> None:
    response = await raw.post("tools/call", {"name": "no_such_tool", "arguments": {}})
    assert response.status_code == 200
    assert last_jsonrpc_message(response)["result"]["isError"] is True


async def test_unknown_method_is_method_not_found(raw: RawSession) -> None:
    response = await raw.post("no/such/method")
    assert last_jsonrpc_message(response)["error"]["code"] == -32601


# -- tool arguments -----------------------------------------------------------------------------

# Per JSON Schema type, values pydantic will not take for it (its lax mode takes "3" and True for an int).
# None is wrong for every integer here because every one is required.
WRONG_VALUES = {
    "string": [5, 1.5, True, [], {}, ["x"], {"$ne": 1}],
    "integer": ["three", 1.5, None, [], {}, [1], {"$gt": 0}, "1e3"],
}


async def test_wrong_argument_types_for_every_tool_are_tool_errors(unharmed: Guard, attacker: RawSession) -> None:
    listed = last_jsonrpc_message(await attacker.post("tools/list"))["result"]["tools"]
    assert {tool["name"] for tool in listed} >= set(STATEFUL_TOOLS)
    cases: list[tuple[str, object]] = [("analyze_data", {"num_items": -1}), ("analyze_data", {"num_items": 10**12})]
    for tool in listed:
        schema = tool["inputSchema"]
        valid = STATEFUL_TOOLS.get(tool["name"], {})
        cases += [(tool["name"], {**valid, "unexpected": 1}), (tool["name"], [1]), (tool["name"], "x")]
        cases += [(tool["name"], {k: v for k, v in valid.items() if k != name}) for name in schema.get("required", [])]
        for name, prop in schema["properties"].items():
            kind = prop.get("type") or next(option["type"] for option in prop["anyOf"] if option["type"] != "null")
            cases += [(tool["name"], {**valid, name: value}) for value in WRONG_VALUES[kind]]
    for i, (name, arguments) in enumerate(cases):
        response = await attacker.http.post(
            targets(unharmed.stack)[i % 4], headers=attacker.headers(), json=tool_call(name, arguments)
        )
        assert response.status_code == 200, (name, arguments, response.status_code)
        assert assert_refused(response) is not None
        tried("wrong argument type")
    assert len(cases) >= 100
    assert (await attacker.call("get_counter"))["counter"] == 0
    assert (await attacker.call("list_notes"))["notes"] == []


async def test_hostile_session_handles_reach_no_state(unharmed: Guard, attacker: RawSession) -> None:
    """A handle is used only if it is one create_session minted: near misses of a real one included."""
    real = unharmed.handle
    handles = [
        *HOSTILE_STRINGS,
        uuid.uuid4().hex,
        real.upper(),
        real + "\n",
        real + "\x00",
        " " + real,
        real[:-1],
        unharmed.bystander.session_id,
    ]  # a session-era id is not a handle
    i = 0
    for handle in handles:
        for tool, arguments in STATEFUL_TOOLS.items():
            url = targets(unharmed.stack)[i % 4]
            i += 1
            sessionless = modern_call(tool, {**arguments, "session_id": handle})
            session_era = (tool_call(tool, {**arguments, "session_id": handle}), attacker.headers())
            for body, headers in (sessionless, session_era):
                response = await attacker.http.post(url, headers=headers, content=json.dumps(body))
                tried("hostile session_id handle")
                if response.status_code == 400:
                    assert "\ud800" in handle  # a lone surrogate: the JSON parser refuses the body
                    continue
                message = assert_refused(response)
                assert message is not None, (tool, handle[:40], response.status_code)
                assert message["result"]["content"][0]["text"] == UNKNOWN_HANDLE, (tool, handle[:40])


async def test_hostile_old_session_ids_copy_nothing(unharmed: Guard, attacker: RawSession) -> None:
    """resume_session treats any string as data: not a session id, nothing copied (the contract's `resumed`, 0)."""
    victim = unharmed.bystander.session_id
    for i, old in enumerate([*HOSTILE_STRINGS, victim.upper(), victim + "\n", victim[:-1] + "*", " " + victim]):
        url = targets(unharmed.stack)[i % 4]
        response = await attacker.http.post(
            url, headers=attacker.headers(), content=json.dumps(tool_call("resume_session", {"old_session_id": old}))
        )
        tried("hostile old_session_id")
        if response.status_code == 400:
            assert "\ud800" in old  # a lone surrogate: the JSON parser refuses the body
            continue
        result = last_jsonrpc_message(response)["result"]["structuredContent"]
        assert (result["status"], result["keys_copied"]) == ("resumed", 0), old[:40]
    assert (await attacker.call("get_counter"))["counter"] == 0
    assert (await attacker.call("list_notes"))["notes"] == []


async def test_hostile_summary_uris_are_json_rpc_errors_and_leak_nothing(unharmed: Guard, attacker: RawSession) -> None:
    victim = unharmed.bystander.session_id
    ids = [*HOSTILE_STRINGS, victim.upper(), victim + "\n", victim[:-1] + "*", victim + "/../" + victim]
    uris = [f"resource://session/{value}/summary" for value in ids] + [
        "resource://session//summary",
        f"resource://session/{victim}/summary/extra",
        "file:///etc/passwd",
        "resource://session/x/summary" + "\x00",
        "\x00",
        "x" * 900_000,
    ]
    for i, uri in enumerate(uris):
        response = await attacker.http.post(
            targets(unharmed.stack)[i % 4],
            headers=attacker.headers(),
            content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "resources/read", "params": {"uri": uri}}),
        )
        assert_refused(response)
        assert "mine" not in response.text, uri[:80]
        tried("hostile resource URI")


# -- size and depth -------------------------------------------------------------------------------


async def test_bodies_near_and_over_the_limit(unharmed: Guard, attacker: RawSession) -> None:
    limit = unharmed.stack.config.max_body_bytes
    padding = len(json.dumps(tool_call("resume_session", {"old_session_id": ""})))

    def body_of(size: int) -> bytes:
        return json.dumps(tool_call("resume_session", {"old_session_id": "x" * (size - padding)})).encode()

    # Just under HAProxy's limit: served (not a session id: nothing copied).
    response = await attacker.http.post(attacker.url, headers=attacker.headers(), content=body_of(limit))
    assert last_jsonrpc_message(response)["result"]["structuredContent"]["keys_copied"] == 0
    for size in (limit + 1, 2 * limit, 5 * limit):
        response = await attacker.http.post(attacker.url, headers=attacker.headers(), content=body_of(size))
        assert response.status_code == 413, size
        tried("huge body")
    # HAProxy can only count a chunked body as far as it buffers it: the replica holds it to the same
    # bound (MAX_BODY_BYTES, mcp_ha/limits.py), with a JSON-RPC error.
    for size in (2 * limit, 5 * limit):
        big = body_of(size)

        async def chunks(big: bytes = big) -> AsyncIterator[bytes]:
            for start in range(0, len(big), 65536):
                yield big[start : start + 65536]

        response = await attacker.http.post(attacker.url, headers=attacker.headers(), content=chunks())
        assert response.status_code == 413
        assert response.json()["error"]["code"] == -32600
        tried("huge body")
    # Straight to a replica: under its limit the tool's own bounds answer; over it, 413.
    direct = attacker.at(targets(unharmed.stack)[1])
    for note, status in (("x" * 900_000, 200), ("x" * 3_000_000, 413)):
        response = await direct.http.post(
            direct.url, headers=direct.headers(), json=tool_call("add_note", {"note": note})
        )
        assert response.status_code == status
        assert_refused(response)
        tried("huge body")
    # A number of 100,000 digits, and an object of 50,000 keys.
    for body in (
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"analyze_data","arguments":'
        b'{"num_items":1' + b"0" * 100_000 + b"}}}",
        json.dumps(tool_call("get_counter", {f"k{i}": i for i in range(50_000)})).encode(),
    ):
        for url in targets(unharmed.stack)[:2]:
            assert_refused(await attacker.http.post(url, headers=attacker.headers(), content=body))
            tried("huge body")
    assert (await attacker.call("list_notes"))["notes"] == []


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


async def test_deeply_nested_json_is_a_parse_error_not_a_recursion_error(unharmed: Guard, attacker: RawSession) -> None:
    deep = nested(10_000)
    objects = '{"a":' * 10_000 + "1" + "}" * 10_000
    bodies = [
        deep,
        objects,
        f'{{"jsonrpc":"2.0","id":{deep},"method":"ping"}}',
        f'{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{deep}}}',
        f'{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"add_note","arguments":{{"note":{deep}}}}}}}',
        f'{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"get_counter","arguments":{{}},"_meta":{objects}}}}}',
    ]
    for body in bodies:
        for url in targets(unharmed.stack):
            response = await attacker.http.post(url, headers=attacker.headers(), content=body)
            assert 400 <= response.status_code < 500, (body[:60], response.status_code)
            tried("deeply nested JSON")
    # Nested as deep as the parser takes (under its limit of 200): a tool error, or a value the tool treats as data.
    shallow = nested(150)
    for arguments in (f'{{"note":{shallow}}}', f'{{"old_session_id":{shallow}}}', f'{{"session_id":{shallow}}}'):
        name = "resume_session" if "old_session_id" in arguments else "add_note"
        body = f'{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{name}","arguments":{arguments}}}}}'
        assert_refused(await attacker.http.post(attacker.url, headers=attacker.headers(), content=body))
        tried("deeply nested JSON")


async def test_a_session_initialized_with_deeply_nested_capabilities_is_adopted_or_refused_cleanly(
    unharmed: Guard, http: httpx2.AsyncClient
) -> None:
    """Initialize params are stored for adoption and read back by another replica: depth must not break that.
    Past MAX_REQUEST_DEPTH the replica refuses the body before anything parses it (400, -32600)."""

    def initialize(depth: int) -> dict[str, Any]:
        capabilities = json.loads('{"experimental":{"x":{"deep":' + nested(depth) + "}}}")
        return {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": PROTOCOL,
                "capabilities": capabilities,
                "clientInfo": {"name": "\x1b[31m" + "é" * 1000, "version": nested(depth)},
            },
        }

    session = RawSession(http, unharmed.stack.config.mcp_url)
    refused = await http.post(session.url, headers=headers_for(None), json=initialize(150))
    tried("deeply nested JSON")
    assert refused.status_code == 400, refused.text[:300]
    assert refused.json()["error"]["code"] == -32600
    assert "MAX_REQUEST_DEPTH" in refused.json()["error"]["message"]
    # Within the bound (the envelope takes 6 levels of the default 32): stored, and adopted everywhere.
    response = await http.post(session.url, headers=headers_for(None), json=initialize(20))
    assert "result" in last_jsonrpc_message(response), response.text[:300]
    session.session_id = response.headers["mcp-session-id"]
    owner = (await session.call("increment_counter"))["instance"]
    for url, name in zip(targets(unharmed.stack)[1:], unharmed.stack.config.replica_names(), strict=True):
        if name != owner:
            assert (await session.at(url).call("increment_counter"))["instance"] == name
            tried("deeply nested JSON")
    assert (await session.call("get_counter"))["counter"] == 3


async def test_notes_over_max_note_bytes_are_tool_errors_and_nothing_is_kept(
    unharmed: Guard, attacker: RawSession
) -> None:
    # "é" takes two bytes of UTF-8, an emoji four: the bound counts bytes, what the store keeps.
    assert (await attacker.call("add_note", {"note": "é" * (MAX_NOTE_BYTES // 2)}))["notes_count"] == 1
    # ~900 KB passes HAProxy's 1 MB body limit: the tool's own bound refuses it, on every replica.
    # (A NUL is 6 bytes of JSON: 150,000 of them stay within the replica's 1 MiB body bound.)
    for i, note in enumerate(
        ["é" * (MAX_NOTE_BYTES // 2 + 1), "😀" * 2_501, "x" * 100_000, "x" * 900_000, "\x00" * 150_000]
    ):
        response = await attacker.http.post(
            targets(unharmed.stack)[i % 4], headers=attacker.headers(), json=tool_call("add_note", {"note": note})
        )
        result = last_jsonrpc_message(response)["result"]
        assert result["isError"] is True
        assert f"at most {MAX_NOTE_BYTES}" in result["content"][0]["text"]
        tried("huge note")
    assert (await attacker.call("list_notes"))["notes"] == ["é" * (MAX_NOTE_BYTES // 2)]


async def test_a_huge_note_is_refused_before_it_reaches_the_store(raw: RawSession) -> None:
    response = await raw.post("tools/call", {"name": "add_note", "arguments": {"note": "x" * (5 * 1024 * 1024)}})
    assert response.status_code == 413
    assert (await raw.call("list_notes"))["notes"] == []


# -- headers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header", ["mcp-session-id", "Last-Event-ID", "MCP-Protocol-Version", "Origin", "Content-Type", "Accept"]
)
async def test_hostile_header_values_are_refused(unharmed: Guard, attacker: RawSession, header: str) -> None:
    body = json.dumps(tool_call("increment_counter", {})).encode()
    method = "GET" if header == "Last-Event-ID" else "POST"
    applied = 0
    for value in HOSTILE_HEADER_VALUES:
        headers = {name.encode(): value.encode() for name, value in attacker.headers().items()}
        headers[header.encode()] = value
        for port in (unharmed.stack.config.http_port, *unharmed.stack.config.replica_ports):
            status, response = await send_raw(port, raw_request(method, headers, body if method == "POST" else b""))
            tried("hostile header value")
            if header == "Origin" and port != unharmed.stack.config.http_port and status == 200:
                # Replicas leave Origin to HAProxy (HAPROXY_ALLOWED_ORIGINS); only what their HTTP parser
                # refuses (control characters) is refused there. (Hopping replicas, a call may be fenced
                # off instead: "moved to another replica", applied nowhere.)
                applied += b'"isError":false' in response
                continue
            assert 400 <= status < 500, (header, value[:20], port, status)
    # Every refused request applied nothing.
    assert (await attacker.call("get_counter"))["counter"] == applied


@pytest.mark.parametrize("header", ["Mcp-Method", "Mcp-Name", "MCP-Protocol-Version"])
async def test_hostile_sessionless_header_values_are_refused(
    unharmed: Guard, attacker: RawSession, header: str
) -> None:
    """A sessionless (2026-07-28) request names its method and tool in headers too; a mismatch is refused."""
    handle = (await attacker.call("create_session"))["session_id"]
    body, headers = modern_call("increment_counter", {"session_id": handle})
    for value in [*HOSTILE_HEADER_VALUES, b"", b"tools/list", b"get_counter", b"2025-11-25\x00"]:
        raw_headers = {name.encode(): text.encode() for name, text in headers.items()}
        raw_headers[header.encode()] = value
        for port in (unharmed.stack.config.http_port, unharmed.stack.config.replica_ports[0]):
            status, _ = await send_raw(port, raw_request("POST", raw_headers, json.dumps(body).encode()))
            assert 400 <= status < 500, (header, value[:20], port, status)
            tried("hostile header value")
    assert (await attacker.call("get_counter", {"session_id": handle}))["counter"] == 0


async def test_unknown_or_garbage_session_ids_get_a_4xx(unharmed: Guard, http: httpx2.AsyncClient) -> None:
    for session_id in [
        "garbage",
        "*",
        uuid.uuid4().hex,
        "a" * 5000,
        "../../etc/passwd",
        unharmed.bystander.session_id.upper(),
        unharmed.handle,
    ]:
        for url in targets(unharmed.stack):
            response = await http.post(url, headers=headers_for(session_id), json=tool_call("increment_counter", {}))
            # A header HAProxy itself refuses (too long) is a 4xx too.
            assert 400 <= response.status_code < 500, response.status_code
            tried("hostile header value")


async def test_a_request_without_a_session_id_is_refused(http: httpx2.AsyncClient, mcp_url: str) -> None:
    response = await http.post(mcp_url, headers=headers_for(None), json=tool_call("increment_counter", {}))
    assert response.status_code == 400


async def test_a_delete_naming_a_handle_ends_nothing(unharmed: Guard, http: httpx2.AsyncClient) -> None:
    """A handle is kept like a session id, but it is no MCP session: a session-era DELETE carrying one as
    `mcp-session-id` gets 404 on HAProxy and every replica, and the handle lives on (the guard reads it)."""
    for url in targets(unharmed.stack):
        response = await http.delete(url, headers={"mcp-session-id": unharmed.handle, "MCP-Protocol-Version": PROTOCOL})
        tried("hostile DELETE")
        assert response.status_code == 404, (url, response.status_code)


async def test_malformed_http_framing_is_a_4xx_and_applies_nothing_twice(unharmed: Guard, attacker: RawSession) -> None:
    """Broken or ambiguous HTTP/1.1 framing (the stuff of request smuggling), unusual methods, and a DELETE
    aimed at someone else's session."""
    body = json.dumps(tool_call("increment_counter", {})).encode()
    headers = b"".join(name.encode() + b": " + value.encode() + b"\r\n" for name, value in attacker.headers().items())
    headers += b"Connection: close\r\n"  # the answer ends with the connection, not with a keep-alive timeout
    start = b"POST /mcp HTTP/1.1\r\nHost: x\r\n" + headers
    chunked = f"{len(body):x}".encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
    sized = b"Content-Length: %d\r\n\r\n" % len(body) + body
    refused = [
        start + b"Content-Length: 10\r\n\r\n" + body,
        start + b"Content-Length: -1\r\n\r\n" + body,
        start + b"Content-Length: abc\r\n\r\n" + body,
        start + b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(body) + body,
        start + b"Content-Length: 99999999999999999999999\r\n\r\n" + body,
        start + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n",
        start + b"Transfer-Encoding : chunked\r\n" + sized,
        start + b"Bad Name: y\r\n" + sized,
        b"P\x00ST /mcp HTTP/1.1\r\nHost: x\r\n" + headers + sized,
        b"X" * 10_000 + b" /mcp HTTP/1.1\r\nHost: x\r\n" + headers + sized,
        b"POST /mcp?\x00 HTTP/1.1\r\nHost: x\r\n" + headers + sized,
        b"POST /mcp?" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n" + headers + sized,
        b"POST /x/../mcp HTTP/1.1\r\nHost: x\r\n" + headers + sized,
        b"GET /mcp\r\n\r\n",
        *(method + b" /mcp HTTP/1.1\r\nHost: x\r\n" + headers + sized for method in (b"PUT", b"PATCH", b"TRACE")),
        *(
            b"DELETE /mcp HTTP/1.1\r\nHost: x\r\nmcp-session-id: "
            + sid.encode()
            + b"\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
            for sid in (
                unharmed.bystander.session_id.upper(),
                unharmed.handle,
                unharmed.bystander.session_id[:-1] + "*",
            )
        ),
    ]
    # Ambiguous but repairable: HAProxy normalises these (Transfer-Encoding wins over Content-Length, a folded
    # header is unfolded, bare LF read as CRLF) and a replica may refuse them; either way no 5xx, and no
    # more than one call applied.
    tolerated = [
        start + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked,
        start + b"X-Fold: a\r\n b\r\n" + sized,
        (start + b"Content-Length: %d\r\n\r\n" % len(body)).replace(b"\r\n", b"\n") + body,
    ]
    # A body cut short (200 KB declared, 100 KB sent, then the connection closed): there is no one to answer.
    for port in (unharmed.stack.config.http_port, unharmed.stack.config.replica_ports[0]):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(start + b"Content-Length: 200000\r\n\r\n" + b"x" * 100_000)
        await writer.drain()
        writer.close()
        tried("malformed HTTP framing")
    applied = 0
    for request in refused + tolerated:
        for port in (unharmed.stack.config.http_port, unharmed.stack.config.replica_ports[0]):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            try:
                response = await asyncio.wait_for(reader.read(), TIMEOUT)
            finally:
                writer.close()
            tried("malformed HTTP framing")
            statuses = [int(line.split()[1]) for line in response.split(b"\r\n") if line.startswith(b"HTTP/1.")]
            assert len(statuses) == 1, (request[:80], port, statuses)
            if request in refused:
                assert 400 <= statuses[0] < 500, (request[:80], port, statuses)
            else:
                assert statuses[0] < 500, (request[:80], port, statuses)
                applied += b'"isError":false' in response
    assert (await attacker.call("get_counter"))["counter"] == applied


async def test_forged_last_event_ids_are_refused_on_every_replica(unharmed: Guard, attacker: RawSession) -> None:
    async with attacker.stream("tools/call", {"name": "analyze_data", "arguments": {"num_items": 0}}) as stream:
        own = [event.id async for event in stream if event.id][-1]
    position, _, tag = own.partition(".")
    theirs = unharmed.event_ids
    unknown = [
        f"{position[:-1]}9.{tag}",
        f"1-0.{tag}",
        f"18446744073709551615-18446744073709551615.{tag}",
        f"{position}.{theirs[0].partition('.')[2][::-1]}",
    ]
    malformed = [
        f"18446744073709551616-0.{tag}",
        position,
        f"{position}.",
        f".{tag}",
        f"-1-0.{tag}",
        f"{position}.{tag.upper()}",
        f"{own}*",
        "*",
        "1-0.*",
        "x" * 10_000,
        own + " " + own,
    ]
    for url in targets(unharmed.stack):
        for event_id, statuses in [*((i, {404}) for i in theirs + unknown), *((i, {400}) for i in malformed)]:
            response = await attacker.http.get(url, headers={**attacker.headers(), "Last-Event-ID": event_id})
            assert response.status_code in statuses, (url, event_id[:60], response.status_code, response.text)
            tried("forged Last-Event-ID")
        # The attacker's own id still resumes: the refusals above are not a refusal of everything.
        async with attacker.at(url).resume(own) as resumed:
            assert resumed.response.status_code == 200


# -- slow and many --------------------------------------------------------------------------------


async def test_slow_drip_requests_get_408_from_haproxy(unharmed: Guard, attacker: RawSession) -> None:
    """HAProxy's `timeout http-request 10s` ends a request whose headers or body trickle in."""
    body = json.dumps(tool_call("increment_counter", {})).encode()
    head = raw_request("POST", {name.encode(): value.encode() for name, value in attacker.headers().items()}, body)
    head = head[: -len(body)]

    async def drip(start: bytes, trickle: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", unharmed.stack.config.http_port)
        writer.write(start)

        async def one_byte_a_second() -> None:
            for byte in trickle:
                await asyncio.sleep(1)
                writer.write(bytes([byte]))

        sender = asyncio.create_task(one_byte_a_second())
        try:
            return await asyncio.wait_for(reader.readline(), 30)
        finally:
            sender.cancel()
            writer.close()

    answers = await asyncio.gather(
        drip(head, body), drip(b"POST /mcp HTTP/1.1\r\nHost: x\r\n", b"X-Slow: " + b"a" * 40)
    )
    tried("slow-drip request", len(answers))
    assert [answer.split()[1] for answer in answers] == [b"408", b"408"], answers
    assert (await attacker.call("get_counter"))["counter"] == 0


async def wait_until_served(http: httpx2.AsyncClient, url: str) -> None:
    """Until the address's request rate (10 s window) is back under the limit, e.g. after an earlier flood."""
    for _ in range(30):
        if (await http.get(url)).status_code == 200:
            return
        await asyncio.sleep(1)
    raise AssertionError(f"{url} still refused after 30 s")


@pytest.mark.timeout(90)
async def test_a_flood_of_tool_calls_over_the_rate_limit_gets_429_and_loses_nothing(
    limited_stack: Stack, http: httpx2.AsyncClient
) -> None:
    health = limited_stack.config.mcp_url.removesuffix("/mcp") + "/health"
    await wait_until_served(http, health)
    pid = limited_stack.pid("mcp-server-1")
    session = RawSession(http, limited_stack.config.mcp_url)
    await session.initialize()
    responses = await asyncio.gather(
        *(session.post("tools/call", {"name": "increment_counter", "arguments": {}}) for _ in range(120))
    )
    tried("flood request over the rate limit", len(responses))
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 429} and statuses[429] >= 60, statuses
    # Every call let through was applied once, every refused one not at all
    # (read on the replica: HAProxy still refuses).
    direct = session.at(f"http://127.0.0.1:{limited_stack.config.replica_ports[0]}/mcp")
    assert (await direct.call("get_counter"))["counter"] == statuses[200]
    assert limited_stack.pid("mcp-server-1") == pid and limited_stack.healthy("mcp-server-1")


# -- property-based fuzzing -----------------------------------------------------------------------

# Valid JSON only (no NaN or Infinity): malformed JSON is a class of its own, and the parser stops it at the door.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
DROP = object()


def mostly(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Four times in six a plausible value, else any JSON value or none at all (DROP), so that many
    inputs get past the envelope's validation to the layers behind it. (one_of(p, p, p, ...) would not
    weigh: hypothesis merges equal branches.)"""
    return st.sampled_from([plausible] * 4 + [JSON_VALUES, st.just(DROP)]).flatmap(lambda chosen: chosen)


def present(mapping: dict) -> dict:
    return {key: value for key, value in mapping.items() if value is not DROP}


METHODS = [
    "initialize",
    "ping",
    "tools/list",
    "tools/call",
    "resources/list",
    "resources/read",
    "resources/templates/list",
    "resources/subscribe",
    "prompts/list",
    "prompts/get",
    "logging/setLevel",
    "completion/complete",
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/progress",
    "notifications/roots/list_changed",
]
_as_int = TypeAdapter(int)


def tame(tool: object, arguments: object) -> object:
    """Valid arguments that make a tool work for long (analyze_data's items, watch_counter's seconds) made
    invalid or instant, so every call answers within the timeout: a slow valid call is no hostile input."""
    if tool not in ("analyze_data", "watch_counter") or not isinstance(arguments, dict):
        return arguments
    key = "num_items" if tool == "analyze_data" else "duration_seconds"
    try:
        value = _as_int.validate_python(arguments.get(key))
    except ValidationError:
        return arguments
    if tool == "analyze_data" and 1 < value <= 1000:
        return {**arguments, key: value + 1000}
    if tool == "watch_counter" and value > 0:
        return {**arguments, key: -value}
    return arguments


FUZZ_SETTINGS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Fuzzer:
    """Sends fuzzed requests with a sync client, from a worker thread, so hypothesis drives it simply."""

    urls: list[str]
    session_id: str

    def send(self, http: httpx2.Client, url_index: int, body: object, *, modern: bool) -> httpx2.Response:
        """Session-era: with the session's id. Sessionless: with the `_meta` and the Mcp-Method and Mcp-Name
        headers such a client sends, as far as the body has something to put in them."""
        if not modern:
            headers = headers_for(self.session_id)
        else:
            headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": MODERN}
            fields = body if isinstance(body, dict) else {}
            params = fields.get("params")
            if isinstance(params, dict):
                meta = params.get("_meta", {})
                if isinstance(meta, dict):
                    params["_meta"] = {**meta, **MODERN_META}
            for header, value in (
                ("Mcp-Method", fields.get("method")),
                ("Mcp-Name", params.get("name") if isinstance(params, dict) else None),
            ):
                if isinstance(value, str) and value.isascii() and value.isprintable():
                    headers[header] = value
        return http.post(self.urls[url_index % len(self.urls)], headers=headers, content=json.dumps(body))

    async def answers_all(self, bodies: st.SearchStrategy, kind: str) -> None:
        """Sends FUZZ_SETTINGS' count of `bodies`, to any target, in either generation: each must be answered."""
        before = HOSTILE_INPUTS[kind]

        def run() -> None:
            with httpx2.Client(timeout=TIMEOUT) as http:

                @FUZZ_SETTINGS
                @given(body=bodies, target=st.integers(0, 3), modern=st.booleans())
                def one(body: object, target: int, modern: bool) -> None:
                    response = self.send(http, target, body, modern=modern)
                    tried(kind)
                    assert_answered(response)

                one()

        await asyncio.to_thread(run)
        assert HOSTILE_INPUTS[kind] - before >= 100


@pytest.mark.timeout(120)
async def test_fuzzed_tool_arguments_are_answered(unharmed: Guard, attacker: RawSession) -> None:
    listed = last_jsonrpc_message(await attacker.post("tools/list"))["result"]["tools"]
    params = {tool["name"]: sorted(tool["inputSchema"]["properties"]) for tool in listed}

    def calls(tool: str) -> st.SearchStrategy:
        keys = st.sampled_from(params[tool]) | st.text(max_size=8) if params[tool] else st.text(max_size=8)
        return mostly(st.dictionaries(keys, JSON_VALUES, max_size=4)).map(
            lambda arguments: tool_call(tool, tame(tool, {} if arguments is DROP else arguments))
        )

    fuzzer = Fuzzer(targets(unharmed.stack), attacker.session_id)
    await fuzzer.answers_all(st.sampled_from(sorted(params)).flatmap(calls), "fuzzed tool arguments")


@pytest.mark.timeout(120)
async def test_fuzzed_json_rpc_envelopes_are_answered(unharmed: Guard, attacker: RawSession) -> None:
    tools = [*sorted(STATEFUL_TOOLS), "get_server_info", "create_session"]
    params = st.fixed_dictionaries(
        {
            "name": mostly(st.sampled_from(tools)),
            "arguments": mostly(st.dictionaries(st.text(max_size=16), JSON_VALUES, max_size=3)),
        },
        optional={
            "_meta": JSON_VALUES,
            "uri": mostly(st.just(f"resource://session/{uuid.uuid4().hex}/summary")),
            "protocolVersion": mostly(st.sampled_from([PROTOCOL, MODERN])),
            "capabilities": JSON_VALUES,
            "clientInfo": JSON_VALUES,
            "level": mostly(st.sampled_from(["debug", "info", "error"])),
            "requestId": JSON_VALUES,
            "cursor": JSON_VALUES,
        },
    ).map(present)
    envelope = st.fixed_dictionaries(
        {
            "jsonrpc": mostly(st.just("2.0")),
            "id": mostly(st.integers(0, 2**53) | st.text(max_size=20)),
            "method": mostly(st.sampled_from(METHODS)),
            "params": mostly(params),
        },
        optional={"result": JSON_VALUES, "error": JSON_VALUES},
    ).map(present)

    def tamed(body: object) -> object:
        if isinstance(body, dict) and isinstance(body.get("params"), dict) and "arguments" in body["params"]:
            body["params"]["arguments"] = tame(body["params"].get("name"), body["params"].get("arguments"))
        return body

    bodies = (
        st.sampled_from([envelope] * 4 + [st.lists(envelope, max_size=3), JSON_VALUES])
        .flatmap(lambda chosen: chosen)
        .map(tamed)
    )
    await Fuzzer(targets(unharmed.stack), attacker.session_id).answers_all(bodies, "fuzzed JSON-RPC envelope")


# -- a lost store ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_replica_that_never_reached_its_store_is_not_healthy(tmp_path: Path) -> None:
    """The grace for a Redis failover (REDIS_RETRY_SECONDS) is for a store that worked: a replica whose Redis
    has never answered fails /health from its first check, so neither compose's service_healthy nor HAProxy
    sends it calls it can only fail."""
    s = Stack(stack_config(tmp_path, replicas=1))  # its Redis is never started
    try:
        s.start("mcp-server-1", wait=False)
        url = f"http://127.0.0.1:{s.service('mcp-server-1').port}/health"
        status, deadline = None, time.monotonic() + 30
        while status is None and time.monotonic() < deadline and s.pid("mcp-server-1"):
            status = http_status(url)  # None until it listens
            time.sleep(0.05)
        assert status == 503
    finally:
        s.down()


@pytest.mark.timeout(90)
async def test_an_unreachable_store_gives_clear_errors_and_health_503_then_recovers(
    healed_stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    replica = (await raw.call("increment_counter"))["instance"]
    healed_stack.stop("redis")

    async def health_of(port: int) -> httpx2.Response:
        return await http.get(f"http://127.0.0.1:{port}/health")

    # For as long as a call would retry the store (a Sentinel failover), a replica stays in rotation...
    assert (await health_of(healed_stack.config.replica_ports[0])).status_code == 200
    # ...and a call waits that long for Redis, then is told plainly that it is not there.
    direct = RawSession(http, f"http://127.0.0.1:{healed_stack.service(replica).port}/mcp")
    direct.session_id = raw.session_id
    response = await direct.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 200
    result = last_jsonrpc_message(response)["result"]
    assert result["isError"] is True
    assert result["content"][0]["text"] == "Session store unavailable; try again shortly."
    # ...and then says why it cannot serve.
    for name, port in zip(healed_stack.config.replica_names(), healed_stack.config.replica_ports, strict=True):
        for _ in range(150):
            health = await health_of(port)
            if health.status_code != 200:
                break
            await asyncio.sleep(0.1)
        assert health.status_code == 503
        assert health.json() == {"status": "degraded", "instance": name, "store": "unreachable"}

    # Straight to the session's replica, which HAProxy has taken out by now: it sheds the call
    # before any work, saying why.
    response = await direct.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "Session store unavailable; try again shortly."
    # Through HAProxy, once it has taken every replica out: its own 503 and JSON-RPC error, never a traceback.
    for _ in range(100):
        if not healed_stack.backends_up():
            break
        await asyncio.sleep(0.1)
    response = await raw.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "No replica can serve now; retry shortly"

    healed_stack.start("redis")  # AOF brings the state back
    healed_stack.wait_healthy("haproxy")
    assert (await raw.call("get_counter"))["counter"] == 1
    assert (await raw.call("increment_counter"))["counter"] == 2
    assert all(healed_stack.pid(name) for name in healed_stack.config.replica_names())
