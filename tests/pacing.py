"""Measuring an engine's CPU use and checking that its steps were paced."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil


@contextmanager
def measured(processes: list[psutil.Process]) -> Iterator[Usage]:
    """Wall time and the CPU time ``processes`` used during the block."""
    usage = Usage()
    wall, cpu = time.monotonic(), _cpu(processes)
    yield usage
    usage.wall, usage.cpu = time.monotonic() - wall, _cpu(processes) - cpu


def assert_paced(usage: Usage, steps: int, min_step_s: float, cpu_share: float = 0.35) -> None:
    """At least ``steps`` paced steps, and the engine mostly waited: CPU below ``cpu_share`` of one core."""
    print(f"\n{steps} steps x {min_step_s} s: wall {usage.wall:.3f} s, engine CPU {usage.cpu:.3f} s")
    assert usage.wall >= steps * min_step_s, f"{steps} steps of {min_step_s} s took only {usage.wall:.3f} s"
    assert usage.cpu < cpu_share * usage.wall, f"{usage.cpu:.2f} CPU s in {usage.wall:.2f} s: the wait spun"


@dataclass
class Usage:
    wall: float = 0.0  # seconds
    cpu: float = 0.0  # CPU seconds of the watched processes (all their threads), user + system


def _cpu(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)
