"""The prefill service (`python -m services.prefill`): `service` serves tasks, `fetch` loads prefixes from the
cache-store layer by layer, `measure` keeps the figures heartbeats carry."""
