"""engine.scheduling."""
