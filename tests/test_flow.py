"""Flow control (omni_serve.graph.flow) without Ray: the walk's byte budget, a stage call's window, and an
engine held back with its stage.

The window is tested on a real stage (the tiny transformers thinker in a :class:`Stage`) called through
the transport as the ingress calls a stage deployment, with its counts meeting in an in-process
``Channels``: a caller that stops taking outputs stops the stage, and the stage's engine, a window
ahead; a caller that takes them again gets the whole reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import pytest

from omni_serve.graph.channel import Channels
from omni_serve.graph.flow import (
    MAX_QUEUED_OUTPUTS,
    OUTPUT_OVERHEAD_BYTES,
    WINDOW_ITEMS,
    Buffers,
    Window,
    output_bytes,
)
from omni_serve.graph.stage import Stage
from omni_serve.graph.transport import LocalStage
from omni_serve.types import ChatMessage, SamplingParams, StageOutput, StageRequest


def audio(nbytes: int) -> StageOutput:
    return StageOutput(stage="code2wav", audio=np.zeros(nbytes // 4, np.float32), sample_rate=24000)


def test_an_output_weighs_its_arrays_text_and_handoff_plus_its_own_objects() -> None:
    output = StageOutput(stage="s", text="héllo", token_ids=[1, 2], audio=np.zeros(10, np.float32), handoff_bytes=100)
    assert output_bytes(output) == OUTPUT_OVERHEAD_BYTES + len("héllo".encode()) + 16 + 40 + 100


def test_the_walks_queues_share_one_byte_budget_and_an_empty_queue_always_takes_one_output() -> None:
    async def go() -> None:
        buffers = Buffers(1000 + 2 * OUTPUT_OVERHEAD_BYTES)
        first, second = buffers.queue(), buffers.queue()
        await first.put(audio(400))
        await first.put(audio(400))  # the budget has room for both
        late = asyncio.create_task(first.put(audio(400)))
        await asyncio.sleep(0.01)
        assert not late.done(), "a put past the budget went through into a queue that holds outputs"
        big = audio(10_000)
        await asyncio.wait_for(second.put(big), 1)  # an empty queue takes one output, whatever its size
        await asyncio.wait_for(second.put(object()), 1)  # the walk's markers cost nothing and never wait
        assert buffers.held == 3 * OUTPUT_OVERHEAD_BYTES + 10_800 and buffers.peak == buffers.held
        await first.get()
        await second.get()  # the big output leaves: room again
        await asyncio.wait_for(late, 1)
        assert buffers.held == 2 * OUTPUT_OVERHEAD_BYTES + 800

    asyncio.run(go())


def test_a_queue_holds_at_most_max_queued_outputs_however_small() -> None:
    async def go() -> None:
        queue = Buffers(1 << 30).queue()
        for _ in range(MAX_QUEUED_OUTPUTS):
            await queue.put(StageOutput(stage="thinker", text="a"))
        late = asyncio.create_task(queue.put(StageOutput(stage="thinker", text="a")))
        await asyncio.sleep(0.01)
        assert not late.done()
        await queue.get()
        await asyncio.wait_for(late, 1)

    asyncio.run(go())


def test_a_window_is_forgotten_whichever_end_closes_it_and_a_waiting_stage_is_let_go() -> None:
    async def go() -> None:
        channels = Channels()
        waiting = asyncio.create_task(channels.wait_taken("k", 3, 100))
        await asyncio.sleep(0.01)
        channels.took("k", 2, 500)
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 2 items taken: the stage asked for 3
        channels.took("k", 3, 600)
        assert await asyncio.wait_for(waiting, 1) == (3, 600)
        waiting = asyncio.create_task(channels.wait_taken("k", 10, 0))
        await asyncio.sleep(0.01)
        channels.close_window("k")  # the caller's call ended: the stage stops waiting
        assert await asyncio.wait_for(waiting, 1) is None
        assert channels.open_windows() == 0
        channels.took("k2", 8, 0)
        channels.close_window("k2")
        assert channels.open_windows() == 0

    asyncio.run(go())


def test_a_closed_window_stays_closed_to_the_calls_that_arrive_after_its_close() -> None:
    """Ray runs an async actor's calls in no guaranteed order: a caller's last report, or a stage's wait,
    may run after the close it was sent before. Neither may make the window again (nobody would close it)."""

    async def go() -> None:
        channels = Channels()
        channels.close_window("k")  # the stage's call ended (it had waited)...
        channels.took("k", 8, 4096)  # ...and the caller's last report runs after it
        assert channels.open_windows() == 0
        # A stage's wait that runs after its caller closed: it is let go at once, and leaves nothing.
        assert await asyncio.wait_for(channels.wait_taken("k", 16, 0), 1) is None
        assert channels.open_windows() == 0

    asyncio.run(go())


def test_closed_keys_are_forgotten_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the channels actor remembers of closed calls is bounded by the calls closed in CLOSED_KEYS_S."""
    from omni_serve.graph import channel

    now = [1000.0]
    monkeypatch.setattr(channel.time, "monotonic", lambda: now[0])
    channels = Channels()
    for i in range(1000):
        channels.close_window(f"old{i}")
        channels.close(f"old{i}")
    assert len(channels._closed_windows) == len(channels._closed_channels) == 1000
    now[0] += channel.CLOSED_KEYS_S + 1
    channels.close_window("new")
    channels.close("new")
    assert len(channels._closed_windows) == len(channels._closed_channels) == 1
    channels.took("old1", 8, 0)  # forgotten: a report this late makes a window again
    assert channels.open_windows() == 1


class Windowed(LocalStage):
    """A stage called in process as Serve calls a stage deployment: its generator runs in a task of its own
    that queues what it yields without bound (Serve 2.60's replica does so), and the call gets a window."""

    def _window(self, call_id: str) -> Window:
        return Window(self._channels(), call_id)

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def run() -> None:
            async for item in self.stage.generate(request):
                queue.put_nowait(item)
            queue.put_nowait(done)

        task = asyncio.create_task(run())
        try:
            while (item := await queue.get()) is not done:
                yield item
            await task
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@pytest.fixture(scope="module")
def thinker() -> Any:
    stage = Stage({"name": "thinker", "engine": "transformers", "engine_args": {"model_stage": "thinker"}})
    asyncio.run(stage.start())
    yield stage
    stage.shutdown()


def steady(read: Any, quiet_s: float = 1.0, timeout_s: float = 60) -> Any:
    """``read()`` once it gave the same value twice ``quiet_s`` apart (a hang guard, not a measurement)."""
    deadline, last = time.monotonic() + timeout_s, read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        if (now := read()) == last:
            return now
        last = now
    pytest.fail(f"still changing after {timeout_s} s: {last}")


def test_a_caller_that_stops_taking_holds_the_stage_and_its_engine_a_window_ahead(thinker: Stage) -> None:
    """The thinker is asked for 400 tokens; its caller takes one output and stops: the stage stops
    yielding a window ahead, its engine's job stops emitting (and runs on: the call is alive, not done);
    the caller takes again and gets all 400 tokens; the windows are gone afterwards."""
    transport = Windowed(thinker)
    tokens = 400
    request = StageRequest(
        "flow",
        SamplingParams(temperature=0.7, seed=3, max_tokens=tokens, ignore_eos=True),
        messages=[ChatMessage(role="user", content="Hello")],
        wants_handoff=False,
    )
    loop = asyncio.new_event_loop()
    outputs = transport.call("thinker", request)
    try:
        first = loop.run_until_complete(anext(outputs))

        def progress() -> tuple[int, int]:
            loop.run_until_complete(asyncio.sleep(0.2))  # the stage and the engine's loop side run meanwhile
            return thinker.items, thinker.engine.stats()["emitted"]

        items, emitted = steady(progress)
        assert thinker.engine.stats()["running"] == 1, "the engine's job ended: it was not held back"
        assert items <= WINDOW_ITEMS + 1, f"the stage yielded {items} items to a caller that took 1"
        assert emitted < tokens, "the engine generated the whole reply for a caller that took one output"

        async def rest() -> list[StageOutput]:
            return [output async for output in outputs]

        later = loop.run_until_complete(asyncio.wait_for(rest(), 300))
        assert later[-1].finished and len(first.token_ids) + sum(len(o.token_ids) for o in later) == tokens
        assert transport._channels().open_windows() == 0
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(outputs.aclose())
        loop.close()
