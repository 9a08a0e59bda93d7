"""A request's hand-off from prefill to decode, as one ordered stream per request (`HandoffStart`, KV chunks, FastGen
profile parts, `HandoffEnd`): `prompt` cuts the prompt's KV into chunks of whole blocks and reassembles it, `profile`
does the same for FastGen's profile, `stream` holds one request's stream, `receiver` a decode instance's streams under
a deadline and a budget. Every chunk and part is a checksummed part (`shared.wire.parts`)."""
