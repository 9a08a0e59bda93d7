"""A prompt's KV from prefill to decode: `chunks` splits, checks and reassembles it, `packed` does the same for an
engine whose KV is compressed, `receiver` holds a decode instance's incoming streams under a deadline and a budget."""
