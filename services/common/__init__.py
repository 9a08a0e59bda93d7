"""What the prefill and decode services share (no service imports another): the engine's thread and step loop
(`engine_host`) and the steps an instance times before it serves (`warmup`)."""
