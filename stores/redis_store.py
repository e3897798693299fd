"""`from stores.redis_store import RedisSessionStore`, from the checkout: mcp_ha/stores/redis_store.py."""

from mcp_ha.stores.redis_store import RedisSessionStore

__all__ = ["RedisSessionStore"]
