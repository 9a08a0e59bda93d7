"""The load generator (`tsukimi-loadgen`): replays traces and synthetic arrivals against an OpenAI-compatible URL."""
