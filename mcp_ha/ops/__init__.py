"""The ops wing: what an operator runs, apart from what a server imports.

- `stack.py`: the local stack (redis, replicas, haproxy as processes), `mcp-ha stack`;
- `check/`: the HA check of any server built on the layer, `mcp-ha check`;
- `deploy_files.py`: the compose files and Kubernetes manifests, `mcp-ha deploy`;
- `cli.py`: the `mcp-ha` command over them.

Nothing in the layer imports this wing (tests/mcp_ha/ops/test_wing.py holds it), and its dependencies
(click, rich, cryptography) are the `ops` extra: `pip install 'mcp-ha-kit[ops]'`.
"""

from __future__ import annotations

import sys

# What the wing needs beyond the layer's dependencies: pyproject.toml's `ops` extra.
OPS_EXTRA = ("click", "rich", "cryptography")


def main() -> None:
    """The `mcp-ha` command; without the ops extra, a line that names it instead of a traceback."""
    try:
        from .cli import main as cli
    except ModuleNotFoundError as exc:
        if exc.name not in OPS_EXTRA:
            raise
        sys.exit(f"mcp-ha needs the kit's ops extra ({exc.name} is missing): pip install 'mcp-ha-kit[ops]'")
    cli()
