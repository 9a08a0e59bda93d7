"""The wire: what crosses between processes and how. Messages and subjects (`protocol`), the NATS bus and its
credentials, payload codecs and checksums (`payload`), checksummed parts (`parts`), heartbeats, logging, a request's
hand-off prefill -> decode (`handoff`), the cache-store's client and its block tags, the secrets and API key files.
No torch outside `handoff`.
"""
