"""tsukimi: what every service imports (config, protocol, blocks, model, engine)."""
