"""High availability for stateful FastMCP servers: one entry point, one pattern per module.

`HighAvailability` (replica.py) is what a server uses; docs/patterns.md maps
each pattern to its module and its tests. What a server imports is here, in
`__all__`: the one public surface (docs/patterns.md, "What a server imports").
A client imports `mcp_ha.resilient_client`, and the HA check `mcp_ha.ops.check`.
The names below are imported when first used, so a client or the HA check
imports none of the server side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .handles import SessionHandle, session_era_id
    from .replica import HighAvailability
    from .session_store import (
        STORE_UNAVAILABLE,
        LimitExceeded,
        Session,
        SessionStore,
        StoreFull,
        StoreUnavailable,
        Transaction,
        is_session_id,
    )
    from .settings import Settings, SettingsError

_WHERE = {
    "HighAvailability": ".replica",
    "Settings": ".settings",
    "SettingsError": ".settings",
    "Session": ".session_store",
    "Transaction": ".session_store",
    "SessionStore": ".session_store",
    "StoreUnavailable": ".session_store",
    "StoreFull": ".session_store",
    "LimitExceeded": ".session_store",
    "STORE_UNAVAILABLE": ".session_store",
    "is_session_id": ".session_store",
    "SessionHandle": ".handles",
    "session_era_id": ".handles",
}

__all__ = [
    "STORE_UNAVAILABLE",
    "HighAvailability",
    "LimitExceeded",
    "Session",
    "SessionHandle",
    "SessionStore",
    "Settings",
    "SettingsError",
    "StoreFull",
    "StoreUnavailable",
    "Transaction",
    "is_session_id",
    "session_era_id",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mcp_ha' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
