"""The kit's own tools: benchmarks, the walkthrough, a raw MCP client. They run from the checkout."""

from pathlib import Path

# The checkout: where the demo server, haproxy/ and the reference kit's venv are found.
ROOT = Path(__file__).resolve().parent.parent
