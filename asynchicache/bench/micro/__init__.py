"""bench.micro."""
