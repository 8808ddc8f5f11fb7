"""engine.sampling."""
