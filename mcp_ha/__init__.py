"""High availability for stateful FastMCP servers: one entry point, one pattern per module.

`HighAvailability` (replica.py) is what a server uses; docs/patterns.md maps
each pattern to its module and its tests.
"""

from session_store import Session

from .handles import SessionHandle
from .replica import HighAvailability
from .settings import Settings, SettingsError

__all__ = ["HighAvailability", "Session", "SessionHandle", "Settings", "SettingsError"]
