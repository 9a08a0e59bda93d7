"""The gateway service: the OpenAI-compatible HTTP API, tokenization and chat template, streaming to clients.

Owns nothing about placement or generation; it submits to the scheduler and relays `stream.<request_id>` events.
"""
