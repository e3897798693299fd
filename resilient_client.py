"""`from resilient_client import ResilientClient`, as in the reference kit's layout, from the checkout.

The client is mcp_ha/resilient_client.py; installed, import it from there.
"""

from mcp_ha.resilient_client import ResilientClient, TransientFailure

__all__ = ["ResilientClient", "TransientFailure"]
