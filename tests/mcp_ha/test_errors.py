"""errors.py: the answers every other module gives, so it imports none of them."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mcp_ha import errors

pytestmark = pytest.mark.quick


def test_errors_imports_nothing_of_the_kit_but_the_store_contract() -> None:
    tree = ast.parse(Path(errors.__file__).read_text())
    kit = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0}
    assert kit == {"session_store"}, kit


def test_a_refusal_is_a_json_rpc_error_with_its_status_and_retry_after() -> None:
    response = errors.refusal(429, "slow down", id=7, retry_after=3)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert json.loads(response.body) == {"jsonrpc": "2.0", "id": 7, "error": {"code": -32600, "message": "slow down"}}
    assert "retry-after" not in errors.refusal(400, "bad").headers
