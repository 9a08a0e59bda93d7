"""The tsukimi services: gateway, scheduler, prefill, decode, cache-store (each `python -m services.<name>`)."""
