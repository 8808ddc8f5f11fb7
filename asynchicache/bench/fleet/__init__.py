"""bench.fleet."""
