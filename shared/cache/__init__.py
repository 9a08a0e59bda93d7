"""The KV block cache pool: the cache-store's tiers (DRAM now; SSD later) and the client every service uses.

The service itself (handlers, events, heartbeats) is `services.cache_store`.
"""
