"""The smallest highly available MCP server: facts a session remembers, on any replica.

python -m examples.minimal                       one replica, state in memory
REDIS_URL=redis://127.0.0.1:6379/0 python -m examples.minimal
"""

from fastmcp import Context

from mcp_ha import HighAvailability, SessionHandle

ha = HighAvailability.from_env()
mcp = ha.server("minimal")


@mcp.tool
async def remember(fact: str, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Keep a fact in this session; how many it holds now."""
    session = await ha.session(ctx, session_id)
    return {"facts": await session.append("facts", fact)}


@mcp.tool
async def recall(ctx: Context, session_id: SessionHandle = None) -> dict:
    """Every fact this session holds, oldest first."""
    session = await ha.session(ctx, session_id)
    return {"facts": await session.get("facts", [])}


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
