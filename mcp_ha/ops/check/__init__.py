"""The HA check: a deployment of any server built on mcp_ha, under faults, held to the layer's promises.

    mcp-ha check URL --shape ha_shape.py [--faults local|compose|kubectl|'kill=...,pause=...']
                     [--suite lb|resilience|all] [--clients plain,sessionless,...] [--junit FILE]

    from mcp_ha.ops.check import Call, Shape, run_check, faults
    report = await run_check(url, shape, faults=faults.local())

Modules: shape (what the user writes), faults (their commands), clients and node (the kinds of client
driven), load (load and what each session saw), checks (the lb and resilience suites), report (summary,
JUnit XML), runner (run_check), cli (the command), wire (the raw MCP client).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import faults
    from .checks import CheckSetupError
    from .faults import FaultError, Faults, parse_faults
    from .report import CheckResult, Report
    from .runner import run_check
    from .shape import Call, Shape, ShapeError, load_shape

# Imported when first used: a shape file (`from mcp_ha.ops.check import Call, Shape`) and `mcp-ha check --help`
# load none of what drives the clients.
_WHERE = {
    "Call": ".shape",
    "Shape": ".shape",
    "ShapeError": ".shape",
    "load_shape": ".shape",
    "FaultError": ".faults",
    "Faults": ".faults",
    "parse_faults": ".faults",
    "CheckResult": ".report",
    "Report": ".report",
    "CheckSetupError": ".checks",
    "run_check": ".runner",
}

__all__ = [
    "Call",
    "CheckResult",
    "CheckSetupError",
    "FaultError",
    "Faults",
    "Report",
    "Shape",
    "ShapeError",
    "faults",
    "load_shape",
    "parse_faults",
    "run_check",
]


def __getattr__(name: str) -> Any:
    if name == "faults":
        return importlib.import_module(".faults", __name__)
    if name not in _WHERE:
        raise AttributeError(f"module 'mcp_ha.ops.check' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
