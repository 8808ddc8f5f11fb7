"""bench.processes."""
