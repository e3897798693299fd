"""The HA check: a deployment of any server built on mcp_ha, under faults, held to the layer's promises.

    mcp-ha check URL --shape ha_shape.py [--faults local|compose|kubectl|'kill=...,pause=...']
                     [--suite lb|resilience|all] [--clients plain,sessionless,...] [--junit FILE]

    from mcp_ha.check import Call, Shape, run_check, faults
    report = await run_check(url, shape, faults=faults.local())

Modules: shape (what the user writes), faults (their commands), clients and node (the kinds of client
driven), load (load and what each session saw), checks (the lb and resilience suites), report (summary,
JUnit XML), runner (run_check), cli (the command), wire (the raw MCP client).
"""

from . import faults
from .checks import CheckSetupError
from .faults import FaultError, Faults, parse_faults
from .report import CheckResult, Report
from .runner import run_check
from .shape import Call, Shape, ShapeError, load_shape

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
