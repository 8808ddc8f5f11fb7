"""`check_integrity`: the cache's bookkeeping checked against itself, as a list of problems.

What is checked:
* the tree: links, page counts, hash chains, lock and hold counts never
  negative and never below their children's, every node in some tier, L1
  residency prefix-closed;
* the ledgers against the tree: every page a node lists is CACHED (L1) or in
  a tree state (L2), each listed once, and every CACHED page or tree-state slot
  is listed by a node; slot states agree with their node (WRITING only under a
  lock, STORING / STORE_QUARANTINED only under a host hold);
* the ledgers against the pending tickets: FILLING pages are exactly those
  reserved by loads, LOADING slots exactly those of reads in flight, WRITING
  and STORING slots exactly those of writes and stores in flight, quarantined
  slots exactly those of unsettled tickets;
* holds: each node's `host_ref` is exactly the stores (in flight or
  unsettled) at or below it; each node's `lock_ref` is at least the locks the
  cache's own jobs hold at or below it;
* each ledger's own counts and free index.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from asynchicache.common.keys import chain_hashes
from asynchicache.hierarchy.l2.jobs import LoadPhase, StoreJob, WriteJob
from asynchicache.hierarchy.l2.ledger import TREE_SLOT_STATES, PageState, SlotState
from asynchicache.hierarchy.l2.loads import PageLoads
from asynchicache.hierarchy.node import RadixNode
from asynchicache.hierarchy.parts import CacheParts
from asynchicache.storage.base import TicketKind


class IntegrityError(RuntimeError):
    """`check_integrity()` found the cache's bookkeeping inconsistent; the message says how."""


def integrity_problems(parts: CacheParts, loader: PageLoads) -> list[str]:
    problems: list[str] = []
    dev_owned: dict[int, str] = {}
    host_owned: dict[int, str] = {}
    for node in parts.tree.iter_nodes():
        problems += _node_problems(parts, node, dev_owned, host_owned)
    problems += parts.device.problems() + parts.host.problems()
    problems += _owned_problems("L1", parts.device.pages_in(PageState.CACHED), dev_owned)
    problems += _owned_problems("L2", parts.host.pages_in(*TREE_SLOT_STATES), host_owned)
    problems += _ticket_problems(parts, loader)
    problems += _hold_problems(parts, loader)
    return problems


def _node_problems(
    parts: CacheParts, node: RadixNode, dev_owned: dict[int, str], host_owned: dict[int, str]
) -> list[str]:
    tree, ps, out = parts.tree, parts.layout.page_size, []
    parent = node.parent
    where = f"node pages {node.start_page}..{node.end_page}"
    if parent is None or parent.children.get(tuple(node.tokens[:ps])) is not node:
        return [f"{where}: not linked from its parent under its first page"]
    if node.num_pages == 0 or len(node.tokens) != node.num_pages * ps:
        out.append(f"{where}: {len(node.tokens)} tokens for {node.num_pages} pages")
    if node.start_page != parent.end_page:
        out.append(f"{where}: starts at {node.start_page}, parent ends at {parent.end_page}")
    if chain_hashes(tree.last_hash(parent), node.tokens, ps) != node.hashes:
        out.append(f"{where}: page hashes are not the chain of its tokens")
    for name in ("lock_ref", "host_ref"):
        mine = getattr(node, name)
        below = sum(getattr(c, name) for c in node.children.values())
        if mine < 0:
            out.append(f"{where}: negative {name} {mine}")
        if mine < below:
            out.append(f"{where}: {name} {mine} below its children's {below}")
    if node.device is None and node.host is None:
        out.append(f"{where}: lives in no tier")
    if node.device is not None and not parent.is_root and parent.device is None:
        out.append(f"{where}: on L1 but its parent is not")
    for tier, owned in ((node.device, dev_owned), (node.host, host_owned)):
        if tier is None:
            continue
        if len(tier) != node.num_pages:
            out.append(f"{where}: {len(tier)} pages listed for {node.num_pages}")
        for p in tier:
            if p in owned:
                out.append(f"page/slot {p} owned by {where} and by {owned[p]}")
            owned[p] = where
    for p in node.device or ():
        if not 0 <= p < parts.device.size or parts.device.state(p) != PageState.CACHED:
            out.append(f"{where}: L1 page {p} is not CACHED in the ledger")
    for s in node.host or ():
        out += _slot_problems(parts, node, s, where)
    return out


def _slot_problems(parts: CacheParts, node: RadixNode, s: int, where: str) -> list[str]:
    if not 0 <= s < parts.host.size:
        return [f"{where}: slot {s} outside the pool"]
    state = parts.host.state(s)
    out = []
    if state not in TREE_SLOT_STATES:
        out.append(f"{where}: slot {s} in state {state.name}")
    if state == SlotState.WRITING and node.lock_ref == 0:
        out.append(f"{where}: slot {s} WRITING but the node is unlocked")
    if state in (SlotState.STORING, SlotState.STORE_QUARANTINED) and node.host_ref == 0:
        out.append(f"{where}: slot {s} {state.name} but its L2 copy is not held")
    if node.device is None and state == SlotState.WRITING:
        out.append(f"{where}: only copy in slot {s} is still being written")
    return out


def _owned_problems(pool: str, in_tree_states: list[int], owned: dict[int, str]) -> list[str]:
    ledger, tree = set(in_tree_states), set(owned)
    out = []
    if ledger - tree:
        out.append(f"{pool}: pages {sorted(ledger - tree)[:8]} in a tree state but in no node")
    if tree - ledger:
        out.append(f"{pool}: pages {sorted(tree - ledger)[:8]} in a node but not in a tree state")
    return out


def _ticket_problems(parts: CacheParts, loader: PageLoads) -> list[str]:
    jobs = list(loader.jobs.values())
    writes = [j for j in parts.transfers.values() if isinstance(j, WriteJob)]
    stores = [j for j in parts.storage_ops.values() if isinstance(j, StoreJob)]
    unsettled = list(parts.unsettled.values())
    expect = {
        ("L1", PageState.FILLING): _all(j.reserved for j in jobs),
        ("L2", SlotState.LOADING): _all(j.slots for j in jobs if j.phase is LoadPhase.READING),
        ("L2", SlotState.WRITING): _all(j.slots for j in writes),
        ("L2", SlotState.STORING): _all(j.slots for j in stores),
        ("L2", SlotState.LOAD_QUARANTINED): _all(
            u.slots for u in unsettled if u.kind == TicketKind.LOAD
        ),
        ("L2", SlotState.STORE_QUARANTINED): _all(
            u.slots for u in unsettled if u.kind == TicketKind.STORE
        ),
    }
    out = []
    for (pool, state), want in expect.items():
        ledger = parts.device if pool == "L1" else parts.host
        have = Tally(ledger.pages_in(state))
        if have != want:
            out.append(
                f"{pool} {state.name}: ledger has {sorted(have)[:8]}, "
                f"pending work holds {sorted(want)[:8]}"
            )
    for job in jobs:
        ops = parts.storage_ops if job.phase is LoadPhase.READING else parts.transfers
        if job.phase is not LoadPhase.DONE and ops.get(job.op) is not job:  # type: ignore[arg-type]
            out.append(f"load {job.ticket.id} in phase {job.phase.name} has no ticket in flight")
    return out


def _hold_problems(parts: CacheParts, loader: PageLoads) -> list[str]:
    holds: Tally[int] = Tally()
    for node in (
        [j.deepest for j in parts.storage_ops.values() if isinstance(j, StoreJob)]
        + [u.hold for u in parts.unsettled.values() if u.hold is not None]
        + parts.store_queue.holds()
    ):
        for n in parts.tree.path(node):
            holds[id(n)] += 1
    locks: Tally[int] = Tally()
    for node in _job_locks(parts, loader):
        for n in parts.tree.path(node):
            locks[id(n)] += 1
    out = []
    for node in parts.tree.iter_nodes():
        where = f"node pages {node.start_page}..{node.end_page}"
        if node.host_ref != holds[id(node)]:
            out.append(f"{where}: host_ref {node.host_ref}, stores hold {holds[id(node)]}")
        if node.lock_ref < locks[id(node)]:
            out.append(f"{where}: lock_ref {node.lock_ref} below the cache's own {locks[id(node)]}")
    return out


def _job_locks(parts: CacheParts, loader: PageLoads) -> list[RadixNode]:
    """Nodes locked by the cache's own work: writes, loads, fallbacks, uncollected results."""
    nodes = [j.deepest for j in parts.transfers.values() if isinstance(j, WriteJob)]
    for job in loader.jobs.values():
        nodes += job.locked
        if not job.abandoned:
            nodes.append(job.fallback)
        if job.phase is LoadPhase.DONE and job.ticket.handle is not None:
            nodes.append(job.ticket.handle.node)
    return [n for n in nodes if not n.is_root]


def _all(groups: Iterable[list[int]]) -> Tally[int]:
    out: Tally[int] = Tally()
    for g in groups:
        out.update(g)
    return out
