"""omni_serve.graph.cycles: a cancelled call's reference cycles are collected soon, once a burst."""

from __future__ import annotations

import asyncio
import gc
import weakref

from omni_serve.graph import cycles


class _Held:
    """Stands for what a cycle keeps alive (a stream's ObjectRefs); weakly referenceable."""


def _cycle() -> weakref.ref[_Held]:
    held = _Held()
    node: dict[str, object] = {"held": held}
    node["self"] = node  # the frame <-> exception cycle, in its simplest form
    return weakref.ref(held)


def test_a_cycle_left_by_a_cancelled_call_is_collected_soon_and_a_burst_shares_one_collection(monkeypatch) -> None:
    collections: list[int] = []
    collect = gc.collect
    monkeypatch.setattr(cycles.gc, "collect", lambda: collections.append(1) or collect())
    monkeypatch.setattr(cycles, "DELAY_S", 0.05)
    gc.disable()  # only collect_soon may free the cycle
    try:

        async def scenario() -> tuple[bool, bool]:
            left = _cycle()
            for _ in range(5):  # a burst of cancellations
                cycles.collect_soon()
            alive_at_once = left() is not None
            await asyncio.sleep(0.3)
            return alive_at_once, left() is None

        alive_at_once, freed = asyncio.run(scenario())
    finally:
        gc.enable()
    assert alive_at_once  # the cycle outlives its call until the collection
    assert freed
    assert collections == [1]
