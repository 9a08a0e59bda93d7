"""What is not the serving library: the `tsukimi` CLI (`cli`), the engine benchmark's baselines (`bench`), the
deployment topology, the process supervisor, and the embedded nats-server that `tsukimi up` and the tests run."""
