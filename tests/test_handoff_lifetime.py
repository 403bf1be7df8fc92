"""How long a handoff lives, with plain Serve deployments (no engines, no omni_serve graph).

A producer streams handoffs, a relay (the orchestrator's role) passes each reference to a
consumer call, the consumer resolves it a little later, as a queued stage call does.

- The way omni_serve used to do it (``ray.put`` in the producer, the reference nested in the
  streamed output) loses objects under concurrency in Ray 2.60: ray-project/ray#58080. The first
  test documents that Ray behaviour; when it fails, the Ray in use no longer frees them early.
- The handoff protocol of :mod:`omni_serve.graph.transport` (the payload is its own stream item, owned by
  the relay) delivers every payload under the same load, frees them all afterwards, and the relay
  never deserializes one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from omni_serve.graph.transport import RemoteStages, receive, stream_items
from omni_serve.payload import HandoffPayload, payload_loads
from omni_serve.types import SamplingParams, StageOutput, StageRequest
from tests.object_store import new_object_bytes, objects_of_at_least, wait_at_most

HTTP_PORT = int(os.environ.get("OMNI_SERVE_TEST_PORT", "18765"))
CALLS = 32  # concurrent producer calls per round
HANDOFFS = 8  # handoffs per call
PAYLOAD_BYTES = 256 * 1024  # above Ray's 100 KiB inline limit: the payloads live in the object store
ROUNDS = 3
FREED_WITHIN_S = 10


def _value(call: int, index: int) -> int:
    return (call * HANDOFFS + index) % 251


def _build_app() -> Any:
    from ray import serve

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.05})
    class Producer:
        async def generate(self, request: StageRequest) -> Any:
            import ray

            call, nested_put = request.chunk_index, request.return_prompt_text  # this test's two knobs
            for i in range(HANDOFFS):
                payload = HandoffPayload("test.filler", {"x": np.full(PAYLOAD_BYTES, _value(call, i), np.uint8)})
                output = StageOutput(stage="producer", handoff=payload, finished=i == HANDOFFS - 1)
                if nested_put:  # omni_serve before: put here, the reference nested in the streamed output
                    output.handoff = ray.put(payload)
                    yield output
                else:
                    for item in stream_items(output, wanted=True):
                        yield item

    @serve.deployment(max_ongoing_requests=CALLS * HANDOFFS, ray_actor_options={"num_cpus": 0.05})
    class Consumer:
        async def generate(self, request: StageRequest) -> Any:
            """A stage call: waits (as a queued call waits for its engine), then takes its input."""
            await asyncio.sleep(0.05)
            if request.return_prompt_text:  # the nested reference, resolved as omni_serve used to
                payload = await request.handoff
            else:
                payload = (await receive(request)).handoff
            yield StageOutput(stage="consumer", text=str(int(payload.tensors["x"][0])), finished=True)

    @serve.deployment(max_ongoing_requests=CALLS, ray_actor_options={"num_cpus": 0.05})
    class Relay:
        def __init__(self, producer: Any, consumer: Any):
            self.transport = RemoteStages({"producer": producer, "consumer": consumer})
            self.producer = producer.options(stream=True, _by_reference=True)
            self.consumer = consumer.options(stream=True)

        async def run(self, call: int, nested_put: bool) -> list[int | str]:
            """What each consumer resolved: the payload's value, or the name of the error it got."""
            request = StageRequest("r", SamplingParams(), chunk_index=call, return_prompt_text=nested_put)
            if nested_put:
                consumers = [
                    self._value(self.consumer.generate.remote(dataclasses.replace(request, handoff=output.handoff)))
                    async for output in self.producer.generate.remote(request)
                ]
            else:  # omni_serve's transport: each consumer call claims its handoff when it starts
                consumers = [
                    self._value(self.transport.call("consumer", request, output.handoff))
                    async for output in self.transport.call("producer", request)
                ]
            return list(await asyncio.gather(*consumers))

        @staticmethod
        async def _value(outputs: Any) -> int | str:
            from ray.exceptions import RayTaskError

            try:
                async for output in outputs:
                    return int(output.text)
            except RayTaskError as err:
                return type(err.cause).__name__
            return "no output"

        def payload_loads(self) -> dict[str, int]:
            return payload_loads()

    return Relay.bind(Producer.bind(), Consumer.bind())


@pytest.fixture(scope="module")
def relay(ray_cluster: str) -> Iterator[Any]:
    from ray import serve

    # Serve may not run yet: start it on the test port, never on the default one.
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    handle = serve.run(_build_app(), name="handoff_lifetime", route_prefix=None)
    yield handle
    serve.delete("handoff_lifetime")


def run_round(relay: Any, nested_put: bool) -> list[list[int | str]]:
    return [r.result() for r in [relay.run.remote(call, nested_put) for call in range(CALLS)]]


def test_handoffs_owned_by_the_caller_reach_every_consumer_and_are_freed(relay: Any, ray_cluster: str) -> None:
    known = objects_of_at_least(ray_cluster, PAYLOAD_BYTES)  # not handoffs: they existed before
    for _ in range(ROUNDS):
        results = run_round(relay, nested_put=False)
        assert results == [[_value(c, i) for i in range(HANDOFFS)] for c in range(CALLS)]
    held, waited = wait_at_most(lambda: new_object_bytes(ray_cluster, PAYLOAD_BYTES, known), 0, FREED_WITHIN_S)
    assert held == 0, f"{held} B of handoffs still referenced {waited:.0f} s later"
    assert relay.payload_loads.remote().result() == {}  # the relay routed references only


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="ray-project/ray#58080: Ray frees a put() reference nested in a streamed item before the consumer "
    "resolves it (fix proposed in ray-project/ray#58082). An XPASS fails this test: Ray no longer loses them, "
    "so drop the marker and reconsider the handoff protocol's workaround (omni_serve.graph.transport).",
)
def test_ray_frees_a_put_reference_nested_in_a_streamed_item_too_early(relay: Any) -> None:
    """Asserts what Ray should do (every consumer resolves its nested reference); fails while #58080 is there.

    Only the bug's own symptoms count as its reproduction: a lost reference must fail with one of
    Ray's reference-lifetime errors; any other error fails the test outright (not an xfail).
    """
    lifetime_errors = {"ReferenceCountingAssertionError", "ObjectLostError", "ObjectFreedError", "OwnerDiedError"}
    for _ in range(ROUNDS):
        results = run_round(relay, nested_put=True)
        lost = {r for call in results for r in call if isinstance(r, str)}
        wrong = [r for c, call in enumerate(results) for i, r in enumerate(call) if r not in (_value(c, i), *lost)]
        if wrong or not lost <= lifetime_errors or len(results) != CALLS:
            pytest.fail(f"not ray-project/ray#58080's symptoms: {sorted(lost - lifetime_errors)}, values {wrong[:5]}")
        assert results == [[_value(c, i) for i in range(HANDOFFS)] for c in range(CALLS)], (
            f"nested references lost ({sorted(lost)}): ray-project/ray#58080"
        )


def _fails(_: int) -> None:
    raise ValueError("the producer's object is an error")


@pytest.mark.parametrize("failure", ["an-object-that-is-an-error", "not-a-payload", "the-channel-closed"])
def test_a_failed_chunk_read_keeps_no_chunk_reference_in_its_traceback(ray_cluster: str, failure: str) -> None:
    """A streamed call's read that fails keeps no chunk's reference in the failure's frames.

    Whoever keeps the failure keeps those frames (the talker queues it for its decoding thread, in a
    cycle with its reader), and a reference there holds the chunk in the object store until Python's
    next full collection: CI's hostile-chat test saw a talker hold one after its client left. Fails
    with the references the frames held (a chunk's in the reader's, the consumer's and the resolver's).
    """
    import traceback

    import ray

    from omni_serve.graph.channel import ChannelReader, Channels

    payload = ray.put(HandoffPayload("test.filler", {"x": np.zeros(4096, np.uint8)}))
    first, then = {
        "an-object-that-is-an-error": (ray.remote(_fails).remote(0), None),
        "not-a-payload": (ray.put(np.zeros(4096, np.uint8)), None),
        "the-channel-closed": (payload, "close"),
    }[failure]

    async def read() -> BaseException:
        channels = Channels()
        await channels.write("k", [first], first=True)
        request = StageRequest(request_id="k", sampling=SamplingParams(), handoff=ChannelReader(channels, "k"))
        chunks = (await receive(request)).handoff
        assert chunks is not None and not isinstance(chunks, HandoffPayload)
        try:
            async for _ in chunks:
                assert then == "close"
                channels.close("k")  # the consumer's next take fails
        except Exception as err:
            return err
        raise AssertionError("the read did not fail")

    err = asyncio.run(read())

    def refers(value: Any) -> bool:
        return isinstance(value, ray.ObjectRef) or (isinstance(value, list) and any(map(refers, value)))

    held = [
        f"{frame.f_code.co_name}: {name}"
        for frame, _ in traceback.walk_tb(err.__traceback__)
        if "/omni_serve/" in frame.f_code.co_filename  # this test's own frame holds them, of course
        for name, value in frame.f_locals.items()
        if refers(value)
    ]
    assert held == [], held
