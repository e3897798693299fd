"""mcp_ha/ops/check/clients.py: the replica behind each answer, read from the header the layer adds
(mcp_ha/replica.py's NameReplica), as the clients' HTTP hook reads it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx2
import pytest
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send

from mcp_ha.ops.check.clients import REPLICA_HEADER, RUNNER_META, STOCK_KINDS, ClientFactory, ReplicaSeen, TaskSeen
from mcp_ha.ops.check.options import KINDS
from mcp_ha.replica import REPLICA_HEADER as LAYER_HEADER
from mcp_ha.replica import NameReplica

pytestmark = pytest.mark.quick


async def answer(scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse("ok", headers={"mcp-session-id": "abc"})(scope, receive, send)


async def test_every_answer_names_its_replica_and_the_hook_reads_it() -> None:
    assert LAYER_HEADER.decode() == REPLICA_HEADER
    seen = ReplicaSeen()
    transport = httpx2.ASGITransport(app=NameReplica(answer, "mcp-server-9"))
    async with httpx2.AsyncClient(transport=transport, event_hooks={"response": [seen]}) as http:
        response = await http.post("http://replica/mcp")
    assert response.headers[REPLICA_HEADER] == "mcp-server-9" and response.text == "ok"
    assert (seen.replica, seen.session_id) == ("mcp-server-9", "abc")


def test_every_kind_is_known_and_the_stock_ones_are_not_the_kits() -> None:
    assert set(STOCK_KINDS) < set(KINDS)
    assert [ClientFactory.kind_class(k).kind for k in KINDS] == list(KINDS)
    # Only the kit's ResilientClient retries; only the stock session-era kinds resume a stream themselves.
    assert [k for k in KINDS if ClientFactory.kind_class(k).retries] == ["resilient"]
    assert [k for k in KINDS if ClientFactory.kind_class(k).resumes_streams] == [
        "ts_sdk",
        "python_sdk",
        "fastmcp_legacy",
    ]
    assert [k for k in KINDS if not ClientFactory.kind_class(k).session_era] == ["sessionless", "fastmcp_tasks"]
    assert [k for k in KINDS if ClientFactory.kind_class(k).runs_tasks] == ["fastmcp_tasks"]


def tasks_get_answer(
    status: str, runner: str | None, *, sse: bool
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An app answering every request as a server answers `tasks/get` (JSON, or one SSE event)."""
    result = {"taskId": "t1", "status": status, "statusMessage": "step 3/8", "resultType": "complete"}
    if runner:
        result["_meta"] = {RUNNER_META: runner}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": result})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if sse:
            response = PlainTextResponse(f"event: message\ndata: {body}\n\n", media_type="text/event-stream")
        else:
            response = PlainTextResponse(body, media_type="application/json")
        await response(scope, receive, send)

    return app


@pytest.mark.parametrize("sse", [False, True])
async def test_the_task_hook_reads_which_replica_tasks_get_names(sse: bool) -> None:
    seen = TaskSeen()
    transport = httpx2.ASGITransport(
        app=NameReplica(tasks_get_answer("working", "mcp-server-2", sse=sse), "mcp-server-1")
    )
    async with httpx2.AsyncClient(transport=transport, event_hooks={"response": [seen]}) as http:
        await http.post("http://replica/mcp", headers={"mcp-method": "tools/call"})  # not a poll: not noted
        assert seen.polls == [] and not seen.named.is_set()
        response = await http.post("http://replica/mcp", headers={"mcp-method": "tasks/get"})
        assert response.status_code == 200
    assert seen.runner == "mcp-server-2" and seen.named.is_set()
    assert seen.polls == [
        {"task": "t1", "status": "working", "message": "step 3/8", "runner": "mcp-server-2", "replica": "mcp-server-1"}
    ]
    seen.forget()
    assert seen.runner is None and not seen.named.is_set()


def test_the_check_reads_the_runner_where_the_layer_writes_it() -> None:
    pytest.importorskip("fastmcp_tasks", reason="mcp_ha.tasks needs the kit's tasks extra")
    from mcp_ha.tasks import RUNNER_META as LAYER_META

    assert LAYER_META == RUNNER_META
