"""KV events: what each instance's tiers hold, on vLLM's wire format, for KV-aware routers.

wire.py the format (vLLM's `KVEventBatch`, media per tier); publisher.py the engine's
stream; replay.py the replay socket (vLLM's protocol); subscriber.py a router's side;
privacy.py what a page may show; access.py who may read; mirror.py the L3/L4 pages an
engine learns from its cache service.
"""
