"""Pattern: sessions that belong to someone; the token verifier.

Without authentication, a session id (or a sessionless handle) is a bearer
capability: whoever holds it can use the session, adopt it on any replica,
copy its state with `resume_session`, read its summary and replay its
streams. The ids are 128 random bits, so they cannot be guessed, but one that
leaks (a log, a proxy, a shared screen) is the session.

With authentication on (`MCP_AUTH=static` or `jwt`), every request to the MCP
endpoint carries a bearer token that FastMCP verifies (401 without one), and
everything the layer keeps for a caller is bound to the principal that created
it (`principals.py`). This module builds the verifier from the settings, and
is imported only when authentication is on. docs/security.md tells the rest.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from fastmcp.server.auth import AccessToken, TokenVerifier
from fastmcp.server.auth.providers.jwt import JWTVerifier, StaticTokenVerifier

from .settings import Settings, SettingsError


class SubjectRequired(JWTVerifier):
    """JWTs that name their subject, and only those.

    The principal is (client_id, issuer, subject); a token without `sub` has
    no subject, so every such token one client was given would be the same
    principal, and its holders would share each other's sessions.
    """

    async def verify_token(self, token: str) -> AccessToken | None:
        verified = await super().verify_token(token)
        return verified if verified is not None and verified.subject else None


def _loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def make_verifier(settings: Settings) -> TokenVerifier | None:
    """The token verifier for FastMCP's `auth=`; None when authentication is off."""
    if settings.auth == "none":
        return None
    if settings.auth == "static":
        if not settings.auth_tokens:
            raise SettingsError("MCP_AUTH=static needs MCP_AUTH_TOKENS=name:token[,name:token...]")
        # client_id and sub are both the name, so the principal is the name, whatever the token.
        return StaticTokenVerifier(
            tokens={
                token: {"client_id": name, "sub": name, "scopes": []} for token, name in settings.auth_tokens.items()
            }
        )
    missing = [
        name
        for name, value in (
            ("MCP_AUTH_JWKS_URL", settings.auth_jwks_url),
            ("MCP_AUTH_ISSUER", settings.auth_issuer),
            ("MCP_AUTH_AUDIENCE", settings.auth_audience),
        )
        if not value
    ]
    if missing:
        # Without an issuer or audience, a token any other service of the same
        # identity provider was given would open sessions here.
        raise SettingsError(f"MCP_AUTH=jwt needs {', '.join(missing)}")
    url = urlsplit(settings.auth_jwks_url)
    if url.scheme != "https" and not (url.scheme == "http" and _loopback(url.hostname)):
        raise SettingsError(f"MCP_AUTH_JWKS_URL={settings.auth_jwks_url!r}: https, or http on loopback only")
    if settings.auth_algorithm.upper().startswith("HS"):
        raise SettingsError(
            f"MCP_AUTH_ALGORITHM={settings.auth_algorithm!r}: a JWKS URL publishes public keys; "
            "use an asymmetric algorithm (RS256, ES256, ...)"
        )
    try:
        return SubjectRequired(
            jwks_uri=settings.auth_jwks_url,
            issuer=settings.auth_issuer,
            audience=settings.auth_audience,
            algorithm=settings.auth_algorithm,
            required_scopes=list(settings.auth_required_scopes) or None,
        )
    except ValueError as exc:
        raise SettingsError(f"MCP_AUTH_ALGORITHM={settings.auth_algorithm!r}: {exc}") from exc
