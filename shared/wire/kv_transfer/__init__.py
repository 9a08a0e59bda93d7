"""A prompt's KV from prefill to decode: `prompt` cuts it into chunks of whole blocks and reassembles it, `chunks`
verifies and holds each stream's chunks, `receiver` holds a decode instance's incoming streams under a deadline and a
budget."""
