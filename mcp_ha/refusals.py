"""Pattern: a bound's refusal is counted and logged, never silent.

Every bound the kit enforces (a MAX_* setting, FAIR_SHARE_CALLS, or one of the store's quotas) answers the
client with a clear refusal; `refused(bound)` is told of each, with the setting's name. An operator then
sees them two ways: `mcp_refusals_total{bound}` at /metrics (metrics.py reads `totals()`), and a WARNING
log line per bound at most every LOG_EVERY_SECONDS, with the count since the last one, so a client that
hammers a bound cannot flood the log. The bound's name comes from the code, never from a request: the
series are as many as the bounds.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger(__name__)

LOG_EVERY_SECONDS = 10.0
# What a store's LimitExceeded is counted under: its own message says which quota (state, list, client).
STORE_QUOTA = "store quota"

_totals: Counter[str] = Counter()
_unlogged: Counter[str] = Counter()
_logged_at: dict[str, float] = {}
_now = time.monotonic


def refused(bound: str, detail: str = "") -> None:
    """A request was refused past `bound` (the setting's name); `detail`, logged, says more."""
    _totals[bound] += 1
    _unlogged[bound] += 1
    now = _now()
    if now - _logged_at.get(bound, -LOG_EVERY_SECONDS) >= LOG_EVERY_SECONDS:
        count = _unlogged.pop(bound)
        since = "" if bound not in _logged_at else f" in the last {now - _logged_at[bound]:.0f} s"
        _logged_at[bound] = now
        log.warning(
            "refused %d request%s past %s%s%s", count, "" if count == 1 else "s", bound, since, detail and f": {detail}"
        )


def totals() -> dict[str, int]:
    """Refusals so far, by bound."""
    return dict(_totals)
