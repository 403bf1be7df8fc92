"""What Ray's object stores hold, read as ``ray memory`` reads it (tests and benchmarks).

Handoffs live in the object store; these readings are how their lifetime is checked: the peak
while requests run, and that none is left afterwards.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any


def object_store_bytes(gcs_address: str) -> int:
    """Bytes in the object stores of all nodes (``ray memory --stats-only``)."""
    from ray._private.internal_api import get_memory_info_reply

    return int(get_memory_info_reply(_cluster_state(gcs_address)).store_stats.object_store_bytes_used)


def objects_of_at_least(gcs_address: str, min_bytes: int) -> dict[str, int]:
    """Object id -> size of every object of ``min_bytes`` or more that a process of the cluster refers
    to (the table ``ray memory`` prints: owners, borrowers, pinned copies)."""
    from ray._private.internal_api import node_stats

    found: dict[str, int] = {}
    for node in _cluster_state(gcs_address).node_table():
        if node["Alive"]:
            stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"])
            for worker in stats.core_workers_stats:
                for ref in worker.object_refs:
                    if ref.object_size >= min_bytes:
                        found[ref.object_id.hex()] = int(ref.object_size)
    return found


def new_object_bytes(gcs_address: str, min_bytes: int, known: dict[str, int]) -> int:
    """Total size of the objects of ``min_bytes`` or more that are not in ``known`` (an earlier census)."""
    return sum(size for oid, size in objects_of_at_least(gcs_address, min_bytes).items() if oid not in known)


@functools.lru_cache(maxsize=4)
def _cluster_state(gcs_address: str) -> Any:
    from ray._private.internal_api import get_state_from_address

    return get_state_from_address(gcs_address)  # a GCS connection: a reading costs ~3 ms instead of ~8


def settled(read: Callable[[], int], quiet_s: float = 1.0, timeout_s: float = 30) -> int:
    """``read()`` once it returned the same twice ``quiet_s`` apart (the last reading after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        if (now := read()) == last:
            return now
        last = now
    return last


def wait_at_most(read: Callable[[], int], limit: int, timeout_s: float) -> tuple[int, float]:
    """Wait until ``read()`` is at most ``limit``, at most ``timeout_s``; return (last reading, seconds waited)."""
    started = time.monotonic()
    while (value := read()) > limit and time.monotonic() - started < timeout_s:
        time.sleep(0.05)
    return value, time.monotonic() - started


class StoreWatch:
    """Samples the object stores' bytes on a thread while the ``with`` block runs; keeps the peak."""

    def __init__(self, gcs_address: str, period_s: float = 0.05):
        self.gcs_address = gcs_address
        self.period_s = period_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, object_store_bytes(self.gcs_address))
            self.samples += 1
            self._stop.wait(self.period_s)

    def __enter__(self) -> StoreWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
