"""Fleet tools: `asynchicache fleet credits` (credits.py) prices a cached token per tier
for KV-aware routers, from measurement on this model and host."""
