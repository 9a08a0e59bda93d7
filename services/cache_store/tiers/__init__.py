"""The cache-store's tiers: `dram`, `ssd` and its `blockfile` format, `tiers` joining them with `policy`, and the
committed `block` type. The service (handlers, events, heartbeats) is `services.cache_store.service`; its client,
which prefill uses, is `shared.wire.cache_client`.
"""
