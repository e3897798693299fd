"""Whose a session is: the principal that opened it, as the layer stores and compares it.

Without authentication every request's principal is None, and nothing is
stored or refused for it. With authentication on (`auth.py` builds the
verifier), every request carries a verified principal, the (client_id,
issuer, subject) triple FastMCP and the MCP SDK use
(`fastmcp.server.sessions.current_principal`), and the layer keeps it as a
short digest: the `owner` entry of a session's or handle's record.

Every way into a session compares the caller's owner with the session's, and
refuses a stranger exactly as it refuses an id nobody minted, so an answer
never tells whether another principal's session exists. A request the auth
layer will refuse passes the layer's ASGI parts untouched (`refused_by_auth`),
so it adopts and replays nothing before it gets its 401.
"""

from __future__ import annotations

import hashlib
import json

from fastmcp.server.sessions import current_principal
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import principal_components
from starlette.datastructures import Headers
from starlette.types import Scope

from .session_store import OWNER


def _digest(principal: str | None) -> str | None:
    # Short and fixed: kept in every authenticated session's record, and a
    # Redis hash stays compact only while each value is at most 64 bytes.
    return None if principal is None else hashlib.blake2b(principal.encode(), digest_size=16).hexdigest()


def owner(scope: Scope | None = None) -> str | None:
    """Who the current request acts for, as stored in records; None when unauthenticated.

    With `scope`, for ASGI middleware (read from the request the auth layer
    has seen); without, inside a tool or FastMCP middleware.
    """
    if scope is None:
        return _digest(current_principal())
    user = scope.get("user")
    if not isinstance(user, AuthenticatedUser):
        return None
    # The same text as current_principal(), so both ways in name one owner.
    return _digest(json.dumps(principal_components(user.access_token), separators=(",", ":")))


def owned_by(owner_digest: str | None) -> dict[str, str]:
    """The record entry binding a new session or handle to `owner_digest`: none when unauthenticated."""
    return {} if owner_digest is None else {OWNER: owner_digest}


def refused_by_auth(scope: Scope) -> bool:
    """Whether the auth layer will refuse this request (401): the layer's middlewares let it pass untouched."""
    # The auth layer puts a user in the scope of every request when auth is
    # on; without auth there is none, and nothing is refused for it.
    return "user" in scope and not getattr(scope["user"], "is_authenticated", False)


def client_of(scope: Scope) -> str:
    """Who a session counts against (MAX_SESSIONS_PER_CLIENT): its principal, else the client's address.

    Behind HAProxy the address is the one HAProxy saw, the X-Forwarded-For it
    appends last (`option forwardfor`); anything a client put in that header
    itself comes before it and is ignored.
    """
    principal = owner(scope)
    if principal is not None:
        return f"principal:{principal}"
    forwarded = Headers(scope=scope).getlist("x-forwarded-for")
    if forwarded:
        return f"address:{forwarded[-1].rsplit(',', 1)[-1].strip()}"
    client = scope.get("client")
    return f"address:{client[0] if client else 'unknown'}"
