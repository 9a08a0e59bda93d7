"""The KV block cache pool: the cache-store's tiers (`dram`, `ssd` and its `blockfile` format, `tiers` joining them
with `policy`), the committed `block` type, and the `client` every service uses. The service (handlers, events,
heartbeats) is `services.cache_store`.
"""
