"""The per-second budgets of a realtime session (events, bytes, audio seconds): a token bucket on an injected
clock, so what it allows is checked exactly, however fast the machine runs the test."""

from __future__ import annotations

from omni_serve.api.realtime.budget import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_capacity_then_the_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=100, capacity=200, clock=clock)
    taken = [bucket.take(1) for _ in range(260)]  # 260 events at one instant
    assert taken == [True] * 200 + [False] * 60
    clock.now += 0.5  # half a second refills 50
    assert [bucket.take(1) for _ in range(60)] == [True] * 50 + [False] * 10
    clock.now += 60  # never more than the capacity
    assert [bucket.take(1) for _ in range(260)] == [True] * 200 + [False] * 60


def test_a_refused_take_spends_nothing() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=4, capacity=30, clock=clock)  # audio: 4 s per second, bursts of 30 s
    assert bucket.take(20)
    assert not bucket.take(20)  # 10 left: refused whole
    assert bucket.take(10)
    assert not bucket.take(0.001)
    clock.now += 2.5
    assert bucket.take(10) and not bucket.take(0.001)


def test_more_than_the_capacity_never_fits() -> None:
    bucket = TokenBucket(rate=4, capacity=30, clock=Clock())
    assert not bucket.take(31)
    assert bucket.take(30)
