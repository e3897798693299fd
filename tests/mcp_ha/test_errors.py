"""errors.py: the answers every other module gives, so it imports none of them."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mcp_ha import errors, refusals

pytestmark = pytest.mark.quick


def kit_imports(module: object) -> set[str | None]:
    tree = ast.parse(Path(module.__file__).read_text())  # type: ignore[attr-defined]
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0}


def test_errors_imports_nothing_of_the_kit_but_the_store_contract_and_the_refusal_count() -> None:
    assert kit_imports(errors) == {"session_store", "refusals"}
    assert kit_imports(refusals) == set()


def test_a_refusal_is_a_json_rpc_error_with_its_status_and_retry_after() -> None:
    response = errors.refusal(429, "slow down", id=7, retry_after=3)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert json.loads(response.body) == {"jsonrpc": "2.0", "id": 7, "error": {"code": -32600, "message": "slow down"}}
    assert "retry-after" not in errors.refusal(400, "bad").headers
