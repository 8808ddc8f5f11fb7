"""asynchicache: a hierarchical, asynchronous prompt KV cache for LLM serving."""

__version__ = "0.1.0"
