"""server/guards/admission.py's rules, without a server: counts, turns and fair share, with the
invariants checked after every step (issue 39, finding 7)."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynchicache.server.guards.admission import Admission, Refused


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_turns_go_to_the_client_running_fewest() -> None:
    async def main() -> list[bytes]:
        adm = Admission(max_running=1, max_waiting=8)
        order: list[bytes] = []

        async def one(client: bytes) -> None:
            await adm.enter(client)
            order.append(client)

        await adm.enter(b"a")  # a runs
        tasks = [asyncio.create_task(one(c)) for c in (b"a", b"a", b"a", b"b")]
        await _settle()
        adm.check()
        adm.leave(b"a")
        for _ in tasks:
            await _settle()
            adm.check()
            adm.leave(order[-1])
        await asyncio.gather(*tasks)
        adm.check()
        return order

    # b's one request goes ahead of a's burst, though it came last (FIFO: a a a b).
    assert asyncio.run(main()) == [b"b", b"a", b"a", b"a"]


def test_a_full_queue_refuses_the_client_holding_it() -> None:
    async def main() -> None:
        adm = Admission(max_running=1, max_waiting=2)
        await adm.enter(b"a")
        waiting = [asyncio.create_task(adm.enter(b"a")) for _ in range(2)]
        await _settle()
        with pytest.raises(Refused, match="--max-waiting-requests"):
            await adm.enter(b"a")  # a holds the whole queue: a's newcomer is refused
        newcomer = asyncio.create_task(adm.enter(b"b"))  # b takes a's newest place
        await _settle()
        with pytest.raises(Refused, match="share"):
            await waiting[1]
        adm.check()
        adm.leave(b"a")
        await _settle()
        assert newcomer.done() and not waiting[0].done()  # a was served last: b's turn
        adm.check()
        adm.leave(b"b")
        await _settle()
        assert waiting[0].done()
        adm.leave(b"a")
        adm.check()
        assert adm.running == adm.waiting == 0

    asyncio.run(main())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), running=st.integers(1, 4), queue=st.integers(0, 6))
def test_random_traffic_keeps_the_invariants(seed: int, running: int, queue: int) -> None:
    """Arrivals, ends and client departures (cancellations) at random."""
    rng = random.Random(seed)

    async def main() -> None:
        adm = Admission(max_running=running, max_waiting=queue)
        inside: list[bytes] = []
        tasks: list[asyncio.Task[None]] = []

        async def arrive(client: bytes) -> None:
            try:
                await adm.enter(client)
            except Refused:
                return
            inside.append(client)

        for _ in range(80):
            roll = rng.random()
            if roll < 0.5:
                tasks.append(asyncio.create_task(arrive(rng.choice([b"a", b"b", b"c"]))))
            elif roll < 0.8 and inside:
                adm.leave(inside.pop(rng.randrange(len(inside))))
            elif tasks:
                tasks[rng.randrange(len(tasks))].cancel()
            await _settle()
            adm.check()
            assert adm.running == len(inside)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while inside:
            adm.leave(inside.pop())
        adm.check()
        assert adm.waiting == 0

    asyncio.run(main())
