"""What the services share (no service imports another): one lifecycle (`lifecycle`), owned background tasks
(`tasks`), and for prefill and decode the engine's thread and step loop (`engine_host`) and the steps an instance times
before it serves (`warmup`)."""
