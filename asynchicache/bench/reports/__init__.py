"""bench.reports."""
