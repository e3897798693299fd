"""What a server imports, as mypy --strict sees it (`make lint`): every name of `mcp_ha.__all__`, used as a
server uses it. Checked, never run; tests/mcp_ha/test_public_api.py holds `__all__` to this file."""

from __future__ import annotations

from typing import Any, assert_type

from fastmcp import Context, FastMCP

from mcp_ha import (
    STORE_UNAVAILABLE,
    HighAvailability,
    LimitExceeded,
    Session,
    SessionHandle,
    SessionStore,
    Settings,
    SettingsError,
    StoreFull,
    StoreUnavailable,
    Transaction,
    is_session_id,
    session_era_id,
)


def wire(store: SessionStore | None = None) -> tuple[HighAvailability, FastMCP]:
    try:
        settings = Settings.from_env({"LOG_FORMAT": "text"})
    except SettingsError as exc:
        raise SystemExit(str(exc)) from None
    ha = HighAvailability(settings, store=store)
    return ha, ha.server("typed")


async def tool(ha: HighAvailability, ctx: Context, session_id: SessionHandle = None) -> dict[str, Any]:
    try:
        session = await ha.session(ctx, session_id)
    except StoreUnavailable:
        return {"error": STORE_UNAVAILABLE}
    assert_type(session, Session)
    assert_type(await session.incr("counter"), int)

    async def move(tx: Transaction) -> None:
        await tx.get("cart", [])

    await session.apply_once(move)
    return {"era": session_era_id(ctx)}


def checks(value: object, exc: Exception) -> bool:
    if is_session_id(value):
        assert_type(value, str)
    return isinstance(exc, StoreFull | LimitExceeded)
