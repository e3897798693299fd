"""The local stack, from the checkout: `python stack.py up -d` (the same as `mcp-ha stack up -d`).

Everything lives in mcp_ha/ops/stack.py, which an installed kit runs as `mcp-ha stack`.
"""

from mcp_ha.ops.stack import main

if __name__ == "__main__":
    main()
