"""What Ray's object stores hold, read as ``ray memory --stats-only`` reads it (tests, benchmarks, operators).

Handoffs live in the object store; these readings are how their lifetime is checked: the peak
while requests run, and the return to the idle baseline afterwards.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any


def object_store_bytes(gcs_address: str) -> int:
    """Bytes in the object stores of all nodes of the cluster at ``gcs_address``."""
    from ray._private.internal_api import get_memory_info_reply

    return int(get_memory_info_reply(_cluster_state(gcs_address)).store_stats.object_store_bytes_used)


@functools.lru_cache(maxsize=4)
def _cluster_state(gcs_address: str) -> Any:
    from ray._private.internal_api import get_state_from_address

    return get_state_from_address(gcs_address)  # a GCS connection: a reading costs ~3 ms instead of ~8


def settled_bytes(gcs_address: str, quiet_s: float = 1.0, timeout_s: float = 30) -> int:
    """The store's bytes once they stayed the same for ``quiet_s`` (the last reading after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    last = object_store_bytes(gcs_address)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = object_store_bytes(gcs_address)
        if now == last:
            return now
        last = now
    return last


def wait_at_most(gcs_address: str, limit: int, timeout_s: float) -> tuple[int, float]:
    """Wait until the store holds at most ``limit`` bytes; return (bytes, seconds waited), or the last
    reading when ``timeout_s`` passed first."""
    started = time.monotonic()
    while (held := object_store_bytes(gcs_address)) > limit and time.monotonic() - started < timeout_s:
        time.sleep(0.05)
    return held, time.monotonic() - started


class StoreWatch:
    """Samples the store's bytes on a thread while the ``with`` block runs; keeps the peak."""

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
