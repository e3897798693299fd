"""The performance benchmark's floor: the least an HTTP endpoint can do for `increment_counter`.

One route, `POST /incr` with `{"session_id": "..."}`, does exactly the store
operation `increment_counter` does (`RedisSessionStore.incr` on the session's
`counter`: one FCALL round trip, carrying HAProxy's `X-Request-Id` as its op
id like the real tool does) and answers `{"counter": n, "instance": ...}`.
No MCP, no FastMCP, no middleware: what is left is HTTP, JSON and Redis.
`GET /health` answers 200 while Redis answers, so the kit's own
`haproxy/haproxy.cfg` can sit in front of it unchanged.

`python -m tools.bench` starts and stops these processes itself (each as
`python -m tools.bench_floor`); settings come from the environment like
the replicas': INSTANCE_ID, HOST, PORT, REDIS_URL, REDIS_USERNAME, REDIS_PASSWORD
and BENCH_FLOOR_PREFIX (the store's key prefix, so the floor's keys stay apart
from the kit's).
"""

from __future__ import annotations

import json
import os
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mcp_ha.session_store import Op
from mcp_ha.stores.redis_store import RedisSessionStore
from mcp_ha.whole_answers import WholeAnswers

INSTANCE_ID = os.environ.get("INSTANCE_ID", "floor-1")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6380/0")
PREFIX = os.environ.get("BENCH_FLOOR_PREFIX", "mcp:benchfloor")

store = RedisSessionStore(
    REDIS_URL,
    prefix=PREFIX,
    username=os.environ.get("REDIS_USERNAME") or None,
    password=os.environ.get("REDIS_PASSWORD") or None,
)


async def incr(request: Request) -> Response:
    try:
        session_id = json.loads(await request.body())["session_id"]
    except (ValueError, KeyError, TypeError):
        return JSONResponse({"error": 'send {"session_id": ...}'}, status_code=400)
    op = Op(request.headers.get("x-request-id") or uuid.uuid4().hex, "incr")
    counter = await store.incr(session_id, "counter", op=op)
    return JSONResponse({"counter": counter, "instance": INSTANCE_ID})


async def health(request: Request) -> Response:
    if await store.ping():
        return JSONResponse({"status": "ok", "instance": INSTANCE_ID})
    return JSONResponse({"status": "degraded", "instance": INSTANCE_ID}, status_code=503)


app = Starlette(routes=[Route("/incr", incr, methods=["POST"]), Route("/health", health, methods=["GET"])])


if __name__ == "__main__":
    # The same server settings as the replicas'.
    uvicorn.run(
        app,
        host=os.environ.get("HOST", "127.0.0.1"),
        port=int(os.environ.get("PORT", "8000")),
        loop="uvloop",
        http=WholeAnswers,
        log_level="warning",
    )
