"""mcp_ha/check/clients.py: the replica behind each answer, read from the header the layer adds
(mcp_ha/replica.py's NameReplica), as the clients' HTTP hook reads it."""

from __future__ import annotations

import httpx2
import pytest
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send

from mcp_ha.check.clients import KINDS, REPLICA_HEADER, STOCK_KINDS, ClientFactory, ReplicaSeen
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
    assert [k for k in KINDS if not ClientFactory.kind_class(k).session_era] == ["sessionless"]
