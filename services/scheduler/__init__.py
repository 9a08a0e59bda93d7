"""The scheduler (the Conductor): placement, admission and the global view of instances and caches."""
