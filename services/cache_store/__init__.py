"""The cache-store service (`python -m services.cache_store`): `service` answers puts, gets and probes of one
shard; `tiers` keeps its blocks in DRAM and on SSD."""
