"""bench.workloads."""
