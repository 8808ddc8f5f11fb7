"""hierarchy.l2: the L2 (host) tier's lifecycle, for every user of it.

Our hierarchy (hierarchy.py) and the vLLM connector (integrations/vllm/l2/host_tier.py)
both keep L2 slots in a `PoolLedger` of `SlotState`s (ledger.py) and book their storage
tickets in `SlotTickets` (slot_tickets.py: given up, landed, quarantined until Settled);
the connector indexes its slots by page hash (host_index.py), our hierarchy in its tree.
The rest is our hierarchy's: loads (loads.py), writes and stores (writes.py), their
jobs (jobs.py), routing (finished_tickets.py), L1 <-> L2 copies (transfer.py).
"""
