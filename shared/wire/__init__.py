"""The wire: what crosses between processes and how. Messages and subjects (`protocol`), the NATS bus and its
credentials, payload codecs and checksums, heartbeats, logging, a prompt's KV hand-off (`kv_transfer`), the
cache-store's client and its block tags, the secrets and API key files. No torch outside `kv_transfer`.
"""
