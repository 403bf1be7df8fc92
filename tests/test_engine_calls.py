"""The abort registry (omni_serve.engines.calls): what abort finds, what it counts, what it forgets."""

from __future__ import annotations

import pytest

from omni_serve.engines.calls import LiveCalls


def test_minted_ids_are_unique_per_call_even_for_one_request_id() -> None:
    calls: LiveCalls[str] = LiveCalls()
    assert len({calls.mint("r") for _ in range(100)}) == 100
    assert calls.mint("abc").startswith("abc-")


def test_take_returns_the_live_handles_of_that_request_once() -> None:
    calls: LiveCalls[str] = LiveCalls()
    with calls.track("a", "a-0"), calls.track("a", "a-1"), calls.track("b", "b-0") as other:
        assert calls.stats() == {"stream_calls": 3, "aborted": 0}
        assert sorted(calls.take("a")) == ["a-0", "a-1"]
        assert calls.take("a") == []  # counted once: a second abort of the same call sends nothing
        assert calls.take("nobody") == []
        assert calls.stats() == {"stream_calls": 3, "aborted": 2}  # aborted calls still stream until they end
        other.finish()
    assert calls.stats() == {"stream_calls": 0, "aborted": 2} and calls.requests() == 0


def test_finished_calls_are_forgotten_and_never_aborted() -> None:
    calls: LiveCalls[str] = LiveCalls()
    with calls.track("r", "r-0") as call:
        call.finish()
        assert calls.take("r") == []  # the engine is done with it: nothing to abort
    assert calls.requests() == 0 and calls.stats()["aborted"] == 0


def test_a_call_left_unfinished_stays_until_aborted() -> None:
    """A cancellation unwinds the family's stream before the ladder aborts: the handle must survive that."""
    calls: LiveCalls[str] = LiveCalls()
    with pytest.raises(KeyboardInterrupt), calls.track("r", "r-0"):
        raise KeyboardInterrupt  # any exit without finish()
    assert calls.stats() == {"stream_calls": 0, "aborted": 0} and calls.requests() == 1
    assert calls.take("r") == ["r-0"]
    assert calls.requests() == 0 and calls.stats()["aborted"] == 1  # forgotten once handed out
