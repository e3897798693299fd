"""Pattern: sessions that belong to someone.

Without authentication, a session id (or a sessionless handle) is a bearer
capability: whoever holds it can use the session, adopt it on any replica,
copy its state with `resume_session`, read its summary and replay its
streams. The ids are 128 random bits, so they cannot be guessed, but one that
leaks (a log, a proxy, a shared screen) is the session.

With authentication on (`MCP_AUTH=static` or `jwt`), every request to the MCP
endpoint carries a bearer token that FastMCP verifies (401 without one), and
everything the kit keeps for a caller is bound to the principal that created
it: the (client_id, issuer, subject) triple FastMCP and the MCP SDK use
(`fastmcp.server.sessions.current_principal`). The kit stores it as `owner`,
a short digest, in the session's record (session-era sessions at
`initialize`, handles at `create_session`); unauthenticated, nothing is stored.
The owner outlives the record when the session ends, because the state it
guards does too.

Every way in compares the caller's owner with the session's, and refuses a
stranger exactly as it refuses an id nobody minted, so an answer never tells
whether another principal's session exists: adoption and the SDK's own check
(404 "Session not found"), `resume_session` (nothing copied), the summary
resource (an empty session), stream replay (404 for the event id) and handles
(the unknown-handle error).

A request that will be refused for its token passes the kit's ASGI layers
untouched (`refused_by_auth`), so it adopts nothing and replays nothing
before the auth layer answers it.

Settings, from the environment (`settings_from_env`):
- `MCP_AUTH`: `none` (default), `static`, or `jwt`;
- `MCP_AUTH_TOKENS` (static): `name:token,name:token`; each token stands for
  the principal `name`. For local use and tests; tokens of 16 characters or more;
- `MCP_AUTH_JWKS_URL`, `MCP_AUTH_ISSUER`, `MCP_AUTH_AUDIENCE` (jwt, all
  required), `MCP_AUTH_ALGORITHM` (default RS256): tokens signed by a key the
  JWKS URL publishes, for this issuer and this audience, naming a subject;
- `MCP_AUTH_REQUIRED_SCOPES` (jwt): scopes every token must carry,
  separated by spaces or commas.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fastmcp.server.auth import AccessToken, TokenVerifier
from fastmcp.server.auth.providers.jwt import JWTVerifier, StaticTokenVerifier
from fastmcp.server.sessions import current_principal
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import principal_components
from starlette.types import Scope

from session_store import OWNER

MODES = ("none", "static", "jwt")
MIN_TOKEN_LENGTH = 16


class AuthConfigError(ValueError):
    """The auth settings cannot work; the message says which and why."""


class SubjectRequired(JWTVerifier):
    """JWTs that name their subject, and only those.

    The principal is (client_id, issuer, subject); a token without `sub` has
    no subject, so every such token one client was given would be the same
    principal, and its holders would share each other's sessions.
    """

    async def verify_token(self, token: str) -> AccessToken | None:
        verified = await super().verify_token(token)
        return verified if verified is not None and verified.subject else None


@dataclass(frozen=True, kw_only=True)
class AuthSettings:
    mode: str = "none"
    # Static: token -> the principal's name.
    tokens: Mapping[str, str] | None = field(default=None, repr=False)
    jwks_url: str = ""
    issuer: str = ""
    audience: str = ""
    algorithm: str = "RS256"
    required_scopes: tuple[str, ...] = ()


def _split(raw: str) -> list[str]:
    return [part for part in raw.replace(",", " ").split() if part]


def _static_tokens(raw: str) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for n, item in enumerate(filter(None, (part.strip() for part in raw.split(","))), start=1):
        name, sep, token = item.partition(":")
        if not sep or not name or not token:
            # Named by position: the entry itself may be a bare token, and a start-up error is logged.
            raise AuthConfigError(f"MCP_AUTH_TOKENS: entry {n} is not name:token (expected name:token[,name:token...])")
        if len(token) < MIN_TOKEN_LENGTH:
            raise AuthConfigError(f"MCP_AUTH_TOKENS: the token for {name!r} is shorter than {MIN_TOKEN_LENGTH} characters")
        if token in tokens:
            raise AuthConfigError(f"MCP_AUTH_TOKENS: {name!r} and {tokens[token]!r} share a token")
        tokens[token] = name
    return tokens


def settings_from_env(environ: Mapping[str, str] = os.environ) -> AuthSettings:
    """The MCP_AUTH* settings, as given; `make_verifier` checks that they can work."""
    mode = environ.get("MCP_AUTH", "none").strip().lower() or "none"
    if mode not in MODES:
        raise AuthConfigError(f"MCP_AUTH={mode!r}: expected one of {', '.join(MODES)}")
    settings = AuthSettings(
        mode=mode,
        tokens=_static_tokens(environ.get("MCP_AUTH_TOKENS", "")) if mode == "static" else None,
        jwks_url=environ.get("MCP_AUTH_JWKS_URL", "").strip(),
        issuer=environ.get("MCP_AUTH_ISSUER", "").strip(),
        audience=environ.get("MCP_AUTH_AUDIENCE", "").strip(),
        algorithm=environ.get("MCP_AUTH_ALGORITHM", "").strip() or "RS256",
        required_scopes=tuple(_split(environ.get("MCP_AUTH_REQUIRED_SCOPES", ""))),
    )
    return settings


def verifier_from_env(environ: Mapping[str, str] = os.environ) -> TokenVerifier | None:
    """The verifier the MCP_AUTH* settings ask for; AuthConfigError, naming the variable, if they cannot work."""
    return make_verifier(settings_from_env(environ))


def _loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def make_verifier(settings: AuthSettings) -> TokenVerifier | None:
    """The token verifier for FastMCP's `auth=`; None when authentication is off."""
    if settings.mode == "none":
        return None
    if settings.mode == "static":
        if not settings.tokens:
            raise AuthConfigError("MCP_AUTH=static needs MCP_AUTH_TOKENS=name:token[,name:token...]")
        # client_id and sub are both the name, so the principal is the name, whatever the token.
        return StaticTokenVerifier(
            tokens={token: {"client_id": name, "sub": name, "scopes": []} for token, name in settings.tokens.items()}
        )
    missing = [name for name, value in (("MCP_AUTH_JWKS_URL", settings.jwks_url), ("MCP_AUTH_ISSUER", settings.issuer),
                                        ("MCP_AUTH_AUDIENCE", settings.audience)) if not value]
    if missing:
        # Without an issuer or audience, a token any other service of the same
        # identity provider was given would open sessions here.
        raise AuthConfigError(f"MCP_AUTH=jwt needs {', '.join(missing)}")
    url = urlsplit(settings.jwks_url)
    if url.scheme != "https" and not (url.scheme == "http" and _loopback(url.hostname)):
        raise AuthConfigError(f"MCP_AUTH_JWKS_URL={settings.jwks_url!r}: https, or http on loopback only")
    if settings.algorithm.upper().startswith("HS"):
        raise AuthConfigError(f"MCP_AUTH_ALGORITHM={settings.algorithm!r}: a JWKS URL publishes public keys; "
                              "use an asymmetric algorithm (RS256, ES256, ...)")
    try:
        return SubjectRequired(
            jwks_uri=settings.jwks_url,
            issuer=settings.issuer,
            audience=settings.audience,
            algorithm=settings.algorithm,
            required_scopes=list(settings.required_scopes) or None,
        )
    except ValueError as exc:
        raise AuthConfigError(f"MCP_AUTH_ALGORITHM={settings.algorithm!r}: {exc}") from exc


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
    """Whether the auth layer will refuse this request (401): the kit's middlewares let it pass untouched."""
    # The auth layer puts a user in the scope of every request when auth is
    # on; without auth there is none, and nothing is refused for it.
    return "user" in scope and not getattr(scope["user"], "is_authenticated", False)
