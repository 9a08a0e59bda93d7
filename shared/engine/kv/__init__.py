"""Where a running request's KV lives: the store interface (`store`), its kinds (`paged`, `codec`, `sized`,
`fastgen`), the factory that builds one from an `EngineConfig`, and prefix loads into any of them."""
