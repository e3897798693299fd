"""What `mcp-ha check` offers, by name: its suites, its kinds of client, its defaults.

Light on purpose: the command declares its options from these before it imports anything that drives a
client (FastMCP's, the SDK's), so `mcp-ha check --help` answers at once; the modules that implement
them import their names from here.
"""

from __future__ import annotations

# The suites: load balancing, and resilience under faults (checks.SUITES holds their checks).
LB = "lb"
RESILIENCE = "resilience"
SUITE_NAMES = (LB, RESILIENCE)
# The kinds of client driven (clients.py makes each).
KINDS = ("plain", "resilient", "sessionless", "ts_sdk", "python_sdk", "fastmcp_legacy", "fastmcp_tasks")
DEFAULT_SESSIONS = 2
DEFAULT_DURATION = 6.0
