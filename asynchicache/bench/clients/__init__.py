"""bench.clients."""
