"""vLLM's scheduler stats (running / waiting requests), read once for every vLLM-based family.

The EngineCore sends ``SchedulerStats`` with its outputs, and only while it steps: an idle engine's
latest numbers may be a step old. The families therefore take ``in_flight`` from vLLM's output
processor (it drops a request the moment it finishes or is aborted) and only the running/waiting
*split* from here. The ``vllm`` family receives the stats through a stat logger of
``AsyncLLM``; ``vllm_omni`` pumps the EngineCore outputs itself and calls :meth:`record`.
Nothing here holds an engine: the stat logger captures only the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SchedulerSnapshot:
    """The EngineCore's latest scheduler stats."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0

    def record(self, scheduler_stats: Any) -> None:
        """Take the numbers of a ``vllm.v1.metrics.stats.SchedulerStats`` (None: nothing new)."""
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage

    def queue(self, in_flight: int) -> dict[str, int]:
        """``running`` + ``waiting`` = ``in_flight``, split as the latest stats say (capped: they may lag)."""
        running = min(self.running, in_flight)
        return {"running": running, "waiting": in_flight - running, "in_flight": in_flight}

    def stat_logger(self) -> type:
        """A ``StatLoggerBase`` class for ``AsyncLLM(stat_loggers=[...])`` that records into this snapshot."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        snapshot = self

        class SchedulerStatsRecorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
            ) -> None:
                snapshot.record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

        return SchedulerStatsRecorder
