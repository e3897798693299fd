"""mcp_ha/__init__.py: the public surface. What a server imports is `mcp_ha.__all__`, each name typed as
tests/typing/public_api.py uses it (mypy --strict in `make lint`); the checkout keeps the design card's
layout (session_store.py, stores/, resilient_client.py) as entry points onto the same objects."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import mcp_ha

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves_and_is_typed_as_a_server_uses_it() -> None:
    for name in mcp_ha.__all__:
        assert getattr(mcp_ha, name) is not None, name
    tree = ast.parse((ROOT / "tests" / "typing" / "public_api.py").read_text())
    typed = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "mcp_ha"
        for alias in node.names
    }
    assert typed == set(mcp_ha.__all__)


def test_a_name_outside_the_surface_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'RedisSessionStore'"):
        _ = mcp_ha.RedisSessionStore  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("checkout", "layer", "names"),
    [
        ("session_store", "mcp_ha.session_store", ["Session", "SessionStore", "Transaction", "StoreUnavailable"]),
        ("stores.redis_store", "mcp_ha.stores.redis_store", ["RedisSessionStore"]),
        ("stores.memory_store", "mcp_ha.stores.memory_store", ["InMemorySessionStore"]),
        ("resilient_client", "mcp_ha.resilient_client", ["ResilientClient"]),
    ],
)
def test_the_design_cards_layout_names_the_layers_own_objects(checkout: str, layer: str, names: list[str]) -> None:
    """A reader of the card (or a server written against its names) finds each file where the card puts it,
    at the checkout's top level; none of them is in the wheel (tests/test_package.py: one top-level name)."""
    top, real = importlib.import_module(checkout), importlib.import_module(layer)
    assert Path(top.__file__ or "").resolve().is_relative_to(ROOT)
    for name in names:
        assert getattr(top, name) is getattr(real, name), name
