"""Step pacing: a minimum time per engine step (engine arg ``min_step_s``).

On a CPU test machine every stage shares the same cores, so stage timings interfere in ways they
would not on hardware where each stage owns an accelerator. A stage with ``min_step_s`` set takes
at least that long per engine step (a decoding step; one decode for a stage without steps): it
*waits* out the rest of the step, holding no core, so a benchmark can model a stage whose step
time is set by its own device, and tests can keep requests in flight for certain. An abort ends
the wait at once. 0 (every shipped graph) turns it off.

The pacer runs on the thread that runs the engine's steps (it blocks that thread, never the
event loop), and is made per request: per-request state stays out of the engine.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pydantic import Field


def min_step_field() -> Any:
    """The ``min_step_s`` field of an engine family's ``EngineArgs``."""
    return Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="Minimum seconds per engine step (decoding step; code2wav: per chunk), waited without using a "
        "core and cut short by an abort: models a stage that owns its accelerator (benchmarks) or holds requests "
        "in flight (tests). 0 = off, as in every shipped graph.",
    )


class StepPacer:
    """Call :meth:`step_done` at the end of each engine step of one request."""

    def __init__(self, min_step_s: float, cancelled: threading.Event):
        self.min_step_s = min_step_s
        self.cancelled = cancelled
        self._step_started = time.monotonic()

    def step_done(self) -> None:
        """Wait until ``min_step_s`` has passed since the step began (at once when aborted); start the next."""
        if self.min_step_s:
            left = self.min_step_s - (time.monotonic() - self._step_started)
            if left > 0:
                self.cancelled.wait(left)
        self._step_started = time.monotonic()

    def restart(self) -> None:
        """The next step starts now (after a wait for its input that is no part of any step)."""
        self._step_started = time.monotonic()
