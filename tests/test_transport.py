"""The stage transport's ownership rules, without Ray: who holds a handoff, and until when.

The orchestrator only passes :class:`Handoff` objects on; the transport claims a reference per
consumer call when the call starts and drops every reference as soon as its holder is done, so no
frame (an exception's traceback included) keeps a payload alive after its last consumer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from omni_serve.graph.transport import Handoff, StageTransport
from omni_serve.types import SamplingParams, StageOutput, StageRequest


class Recording(StageTransport):
    """A producer stage that yields ``n`` handoffs, and consumer calls that record what they got."""

    def __init__(self, n: int = 3, die_first: bool = False):
        self.n = n
        self.die_first = die_first
        self.requests: list[StageRequest] = []

    async def voices(self, stage: str) -> list[str]:
        return []

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
        self.requests.append(request)
        if self.die_first and len(self.requests) == 1:
            raise ActorDiedError()
        if stage == "producer":
            for i in range(self.n):
                yield StageOutput(stage=stage, handoff=f"payload-{i}", finished=i == self.n - 1)
        else:
            await asyncio.sleep(0)
            yield StageOutput(stage=stage, text=str(request.handoff), finished=True)


class Tracked(Handoff):
    """A caller's handoff that remembers the claims consumer calls took of it."""

    def __init__(self, value: Any):
        super().__init__(value)
        self.claims: list[Handoff] = []

    def claim(self) -> Handoff:
        claim = super().claim()
        self.claims.append(claim)
        return claim


def request() -> StageRequest:
    return StageRequest("r", SamplingParams())


async def consume(outputs: AsyncGenerator[StageOutput, None]) -> list[StageOutput]:
    return [o async for o in outputs]


def test_the_producers_reference_is_dropped_when_the_next_output_is_asked_for() -> None:
    async def run() -> list[Any]:
        seen: list[Handoff] = []
        async for output in Recording().call("producer", request()):
            assert isinstance(output.handoff, Handoff) and output.handoff.value is not None
            seen.append(output.handoff)
        return [h.value for h in seen]

    assert asyncio.run(run()) == [None, None, None]


def test_each_consumer_claims_its_own_reference_when_started_and_drops_it_when_done() -> None:
    async def run() -> tuple[list[str], list[Handoff]]:
        transport = Recording()
        consumers, claims = [], []
        async for output in transport.call("producer", request()):
            consumers.append(transport.call("consumer", request(), output.handoff))
            claims.append(output.handoff)
        # The producer has moved past every output: each consumer still reads the payload it claimed.
        texts = [o.text for c in consumers for o in await consume(c)]
        return texts, claims

    texts, claims = asyncio.run(run())
    assert texts == ["payload-0", "payload-1", "payload-2"]
    assert all(c.value is None for c in claims)


def test_a_sent_request_keeps_no_payload_after_its_call() -> None:
    """Serve may hold the request it sent after the call ended (it did in tests/test_handoff_store.py):
    the transport empties it, so that holding it pins no payload."""
    transport = Recording()
    outputs = asyncio.run(consume(transport.call("consumer", request(), Handoff("payload"))))
    assert [o.text for o in outputs] == ["payload"]  # the call had it
    (sent,) = transport.requests
    assert sent.handoff is None and sent.messages is None


def test_a_retried_call_keeps_its_claim_until_the_retry_ended() -> None:
    transport = Recording(die_first=True)
    source = Tracked("payload-x")
    outputs = asyncio.run(consume(transport.call("consumer", request(), source)))
    assert [o.text for o in outputs] == ["payload-x"]  # the retry still had the payload
    assert [r.request_id for r in transport.requests] == ["r", "r~retry"]  # a new engine id for the retry
    assert len(source.claims) == 1 and source.claims[0].value is None  # one claim, dropped after the retry
    assert source.value == "payload-x"  # the caller's own reference is the caller's to drop


def test_a_cancelled_consumer_drops_its_claim() -> None:
    class Hanging(Recording):
        async def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
            self.requests.append(request)
            await asyncio.sleep(3600)
            yield StageOutput(stage=stage)

    source = Tracked("payload")

    async def run() -> Any:
        transport = Hanging()
        call = transport.call("consumer", request(), source)
        task = asyncio.ensure_future(anext(call))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await call.aclose()
        return transport.requests[0]

    wire = asyncio.run(run())
    assert [c.value for c in source.claims] == [None]  # the call's claim was dropped when it was cancelled
    assert wire.handoff is None  # and so was the sent request's reference (Serve may keep the request)


def test_a_released_handoff_cannot_be_passed_on() -> None:
    handoff = Handoff("payload")
    handoff.release()
    with pytest.raises(RuntimeError, match="released"):
        handoff.claim()
