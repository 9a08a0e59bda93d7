"""The decode service (`python -m services.decode`): `service` takes prompts' KV from prefill and decodes them."""
