"""The store backends, as in the reference kit's layout, from the checkout: `stores.redis_store` and
`stores.memory_store`. They are mcp_ha/stores/; installed, import them from there."""
