"""A server written from FastMCP's documentation of `SessionId`, made highly available by one object.

The tools are FastMCP's own convention, unchanged: a `session_id: SessionId`
argument and `await get_session(session_id)`. The kit's `create_session` and
`end_session` mint and end the ids, and `ha.server` gives FastMCP the kit's
store behind `get_session`, so a session lives on every replica, is isolated
by principal, and a write of a read-then-write tool commits only while what
it read is unchanged.

    python stack.py up -d --server examples.fastmcp_sessions
"""

from __future__ import annotations

from fastmcp.server.dependencies import get_session
from fastmcp.server.sessions import SessionId

from mcp_ha import HighAvailability

ha = HighAvailability.from_env()
mcp = ha.server("notebook")


@mcp.tool
async def remember(fact: str, session_id: SessionId) -> dict:
    """Add a fact to this session's notebook."""
    session = await get_session(session_id)
    facts = await session.get("facts", [])
    await session.set("facts", [*facts, fact])
    return {"facts": len(facts) + 1, "instance": ha.instance}


@mcp.tool
async def recall(session_id: SessionId) -> dict:
    """Every fact in this session's notebook."""
    session = await get_session(session_id)
    return {"facts": await session.get("facts", []), "instance": ha.instance}


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
