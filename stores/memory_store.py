"""`from stores.memory_store import InMemorySessionStore`, from the checkout: mcp_ha/stores/memory_store.py."""

from mcp_ha.stores.memory_store import InMemorySessionStore

__all__ = ["InMemorySessionStore"]
