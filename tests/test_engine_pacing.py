"""Step pacing (omni_serve.engines.pacing): a minimum time per step, waited without a core, cut short by abort."""

from __future__ import annotations

import threading
import time

from omni_serve.engines.pacing import StepPacer


def test_a_fast_step_is_stretched_to_the_minimum_without_using_a_core() -> None:
    pacer = StepPacer(0.3, threading.Event())
    wall, cpu = time.monotonic(), time.process_time()
    pacer.step_done()
    assert 0.29 <= time.monotonic() - wall < 1.0
    assert time.process_time() - cpu < 0.05  # waited, not spun


def test_only_the_rest_of_the_minimum_is_waited() -> None:
    pacer = StepPacer(0.5, threading.Event())
    time.sleep(0.6)  # a step whose own work took longer than the minimum
    started = time.monotonic()
    pacer.step_done()
    assert time.monotonic() - started < 0.1
    time.sleep(0.3)  # the next step counts from the end of the last one: 0.2 s are left of it
    started = time.monotonic()
    pacer.step_done()
    assert 0.15 <= time.monotonic() - started < 0.45


def test_an_abort_ends_the_wait_at_once() -> None:
    cancelled = threading.Event()
    pacer = StepPacer(10.0, cancelled)
    threading.Timer(0.1, cancelled.set).start()
    started = time.monotonic()
    pacer.step_done()
    assert time.monotonic() - started < 1.0


def test_zero_is_off() -> None:
    pacer = StepPacer(0.0, threading.Event())
    started = time.monotonic()
    for _ in range(1000):
        pacer.step_done()
    assert time.monotonic() - started < 0.1
