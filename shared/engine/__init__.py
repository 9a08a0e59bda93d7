"""The engine that prefill and decode share: paged KV pool, continuous batching, chunked prefill, sampling."""
