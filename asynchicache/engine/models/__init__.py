"""engine/models layer."""
