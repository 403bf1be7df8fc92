"""What a session may spend per second of wall time: events, bytes and audio seconds, each a token bucket.

A bucket fills at ``rate`` per second up to ``capacity`` (the burst); spending more than it holds is
refused and spends nothing, so a client that sends too fast loses only what was over. The clock is
injected: a test drives it by hand, so what the bucket allows does not depend on how fast a machine
runs the test.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._at = clock()

    def take(self, amount: float) -> bool:
        """Spend ``amount`` if the bucket holds it now (True); else spend nothing (False)."""
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        if amount > self._level:
            return False
        self._level -= amount
        return True
