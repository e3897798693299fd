"""`from session_store import Session, SessionStore`, as in the reference kit's layout, from the checkout.

The store contract is mcp_ha/session_store.py; installed, import it from `mcp_ha` (its public names, in
`mcp_ha.__all__`). The backends are in stores/ beside this file, as the design card lays them out.
"""

from mcp_ha.session_store import (
    STORE_UNAVAILABLE,
    LimitExceeded,
    Session,
    SessionStore,
    StoreFull,
    StoreUnavailable,
    Transaction,
    is_session_id,
)

__all__ = [
    "STORE_UNAVAILABLE",
    "LimitExceeded",
    "Session",
    "SessionStore",
    "StoreFull",
    "StoreUnavailable",
    "Transaction",
    "is_session_id",
]
