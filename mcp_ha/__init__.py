"""High availability for stateful FastMCP servers: one entry point, one pattern per module.

`HighAvailability` (replica.py) is what a server uses; docs/patterns.md maps
each pattern to its module and its tests. The names below are imported when
first used, so a client (`mcp_ha.resilient_client`) or the HA check imports
none of the server side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .handles import SessionHandle
    from .replica import HighAvailability
    from .session_store import Session
    from .settings import Settings, SettingsError

_WHERE = {
    "HighAvailability": ".replica",
    "Session": ".session_store",
    "SessionHandle": ".handles",
    "Settings": ".settings",
    "SettingsError": ".settings",
}

__all__ = ["HighAvailability", "Session", "SessionHandle", "Settings", "SettingsError"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mcp_ha' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
