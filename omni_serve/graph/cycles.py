"""A cancelled call's reference cycles, collected a moment after it instead of at Python's next full collection.

A call cancelled while Serve routes it is left in a reference cycle: Serve 2.60's
``ActorReplicaResult.get_rejection_response`` catches the ``CancelledError`` as ``e`` and re-raises it from
inside the ``except`` block (``raise e from None``), so the exception's traceback holds the frame that holds
the exception. That frame also holds the call's ``ObjectRefGenerator``, whose reported items and peeked next
item are object-store objects (a thinker's first chunk, a talker's codes): they stay in the store until the
cycle collector frees them. Found by the hostile-chat test in CI: a client that leaves before the first byte
left a stage's stream item behind (7 of 160 such leaves, with two busy loops beside the graph; the holders
seen with ``gc.DEBUG_SAVEALL`` in the ingress; after this module, none of 90). A stage collects after a
cancelled call too, as a precaution (0.2 ms): the talker-held chunk CI also saw was no cycle but an unclosed
chunk reader, which ``Stage.generate`` now closes. And after a failed call: a failure an engine keeps (the
talker queues its input feed's for its decoding thread) is in a cycle with the frames it passed through.
Those frames once held the chunk being read (CI, 2026-11-28: a talker held one after its client left);
now they hold no reference (``omni_serve.graph.transport._chunks``), only copies that wait for a collection.

Python runs a full collection only once the long-lived objects grew by a quarter, which an idle replica
can take minutes or hours to reach. So after a cancelled call this process collects once, soon
(:data:`DELAY_S`: the cancellation has reached Serve's router loop by then), and a burst of cancellations
shares that one collection. It is cheap because Serve 2.60 freezes a replica's start-up heap
(``RAY_SERVE_FREEZE_GC_ON_STARTUP``): ``gc.collect()`` timed in the tiny graph's replicas took 1-3 ms in the
ingress and 0.2 ms in each stage (2026-11-27), at most once a :data:`DELAY_S`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

logger = logging.getLogger(__name__)

DELAY_S = 1.0  # after the first cancellation of a burst; the rest of the burst waits for the same collection

_lock = threading.Lock()  # Serve's router runs its own loop thread: calls may come from two loops
_pending = False


def collect_soon() -> None:
    """Collect this process's reference cycles :data:`DELAY_S` from now, unless a collection is already due."""
    global _pending
    with _lock:
        if _pending:
            return
        _pending = True
    try:
        asyncio.get_running_loop().call_later(DELAY_S, _collect)
    except RuntimeError:  # no loop (a generator finalized outside one): collect now
        _collect()


def _collect() -> None:
    global _pending
    with _lock:
        _pending = False
    started = time.perf_counter()
    found = gc.collect()
    logger.debug("collected %d objects in cycles in %.1f ms", found, 1000 * (time.perf_counter() - started))
