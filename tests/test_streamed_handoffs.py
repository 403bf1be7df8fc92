"""Streamed handoffs (a stage's ``stream_input``): the thinker hands the talker its rows as it decodes.

Engine level (no Ray): streamed and whole handoffs give the same codec tokens and bit-identical audio
for a seed, however the chunks are timed; a talker ahead of its thinker waits (it never pads); a
thinker that fails mid-reply fails the talker's call. Orchestrator level (in-process fake stages):
the channel's rules. Graph level (Ray, HTTP): the same audio through the served graph both ways,
every chunk freed, a client that leaves cancels all three stages.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from omni_serve.api.failure_status import from_failure
from omni_serve.engines import transformers as te
from omni_serve.engines.base import StageEngine
from omni_serve.exceptions import ChunksLost, EngineError, ProducerFailed, StageFailed
from omni_serve.graph.channel import MAX_BUFFERED_CHUNKS, ChannelReader, Channels
from omni_serve.graph.config import GraphConfig, GraphConfigError, load_graph
from omni_serve.graph.flow import MAX_QUEUED_OUTPUTS
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.transport import StageTransport
from omni_serve.models import qwen3_omni as q
from omni_serve.payload import HandoffPayload
from omni_serve.types import ChatMessage, FinishReason, Modality, SamplingParams, StageOutput, StageRequest
from tests.channels import channel_actors
from tests.conftest import graph_variant, wait_until

HELLO = [ChatMessage(role="user", content="Hello there, how are you?")]
TALK = {"temperature": 0.9, "top_k": 50, "seed": 11}


# ---- engine level -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> dict[str, StageEngine]:
    made = {
        "thinker": te.create("thinker", {"model_stage": "thinker"}),
        "talker": te.create(
            "talker", {"model_stage": "talker", "codec_first_chunk_frames": 4, "codec_chunk_frames": 5}
        ),
        "code2wav": te.create("code2wav", {"model_stage": "code2wav"}),
    }

    async def start() -> None:
        for engine in made.values():
            await engine.start()

    asyncio.run(start())
    return made


def thinker_outputs(engines: dict[str, StageEngine], streamed: bool, tokens: int) -> list[StageOutput]:
    request = StageRequest(
        "t",
        SamplingParams(temperature=0.7, seed=3, max_tokens=tokens, ignore_eos=True),
        messages=HELLO,
        stream_handoff=streamed,
    )

    async def go() -> list[StageOutput]:
        return [o async for o in engines["thinker"].generate(request, None)]

    return asyncio.run(go())


async def paced(chunks: list[HandoffPayload], delay_s: float, fail_after: int | None = None) -> AsyncIterator[Any]:
    for i, chunk in enumerate(chunks):
        if i == fail_after:
            raise ProducerFailed("stage thinker failed: RuntimeError")
        await asyncio.sleep(delay_s)
        yield chunk


def speak(engines: dict[str, StageEngine], handoff: Any, max_frames: int = 40) -> tuple[np.ndarray, np.ndarray, Any]:
    """The talker's codec codes [16, frames], code2wav's audio of them, and the talker's finish reason."""

    async def go() -> tuple[list[HandoffPayload], Any]:
        request = StageRequest("k", SamplingParams(**TALK, max_tokens=max_frames))
        whole = handoff if isinstance(handoff, HandoffPayload) else None
        if whole is None:  # a stream of chunks, as the stage hands it to the engine
            request.handoff_stream = handoff
        outs = [o async for o in engines["talker"].generate(request, whole)]
        chunks = [o.handoff for o in outs if o.handoff is not None]
        audio = []
        for i, chunk in enumerate(chunks):
            decode = StageRequest(f"c{i}", SamplingParams(temperature=0))
            audio += [o.audio async for o in engines["code2wav"].generate(decode, chunk)]
        return chunks, (np.concatenate(audio), outs[-1].finish_reason)

    chunks, (audio, reason) = asyncio.run(go())
    return np.concatenate([c.tensors["codes"][:, c.meta["left_context"] :] for c in chunks], axis=1), audio, reason


@pytest.mark.parametrize("tokens", [6, 40])
def test_streamed_and_whole_handoffs_give_the_same_codes_and_bit_identical_audio(engines, tokens: int) -> None:
    whole = thinker_outputs(engines, streamed=False, tokens=tokens)
    streamed = thinker_outputs(engines, streamed=True, tokens=tokens)
    assert [o.token_ids for o in whole if o.token_ids] != []
    assert sum((o.token_ids for o in streamed), []) == sum((o.token_ids for o in whole), [])
    assert "".join(o.text for o in streamed) == "".join(o.text for o in whole)
    chunks = [o.handoff for o in streamed if o.handoff is not None]
    assert chunks[0].kind == q.THINKER2TALKER and chunks[0].meta["streamed"]
    assert len(chunks) > 1 and {c.kind for c in chunks[1:]} == {q.THINKER2TALKER_ROWS}
    rows = sum(c.tensors["embeds"].shape[0] for c in chunks)
    assert rows == whole[-1].handoff.tensors["embeds"].shape[0]  # every row, once

    codes, audio, reason = speak(engines, whole[-1].handoff)
    assert codes.shape[1] > 8 and reason in (FinishReason.STOP, FinishReason.LENGTH)
    # As fast as they come, and slower than the talker steps (it waits for each row).
    for delay in (0.0, 0.02):
        s_codes, s_audio, s_reason = speak(engines, paced(chunks, delay))
        assert np.array_equal(s_codes, codes), f"delay {delay}: other codec tokens"
        assert s_audio.tobytes() == audio.tobytes(), f"delay {delay}: the audio differs"
        assert s_reason == reason


def test_a_talker_ahead_of_its_thinker_waits_for_the_next_row(engines) -> None:
    chunks = [o.handoff for o in thinker_outputs(engines, streamed=True, tokens=20) if o.handoff is not None]
    release = asyncio.Event()

    async def stalled() -> AsyncIterator[HandoffPayload]:
        for i, chunk in enumerate(chunks):
            if i == 3:  # the prompt and two reply rows, then the thinker "stalls"
                await release.wait()
            yield chunk

    async def go() -> tuple[int, list[StageOutput]]:
        request = StageRequest("w", SamplingParams(**TALK, max_tokens=30), handoff_stream=stalled())
        outs: list[StageOutput] = []

        async def collect() -> None:
            async for o in engines["talker"].generate(request, None):
                outs.append(o)

        task = asyncio.create_task(collect())
        await asyncio.sleep(1.5)
        before = len(outs)  # a first chunk (4 frames) would need 3 rows the thinker has not made yet
        assert engines["talker"].stats()["running"] == 1
        release.set()
        await task
        return before, outs

    before, outs = asyncio.run(go())
    assert before == 0, "the talker ran steps past the rows it had"
    assert outs[-1].finished and outs[-1].finish_reason is not FinishReason.ABORT


def test_a_thinker_that_fails_mid_reply_fails_the_talker_call(engines) -> None:
    chunks = [o.handoff for o in thinker_outputs(engines, streamed=True, tokens=30) if o.handoff is not None]

    async def go() -> list[StageOutput]:
        chunks_then_failure = paced(chunks, 0.01, fail_after=12)
        request = StageRequest("f", SamplingParams(**TALK, max_tokens=40), handoff_stream=chunks_then_failure)
        return [o async for o in engines["talker"].generate(request, None)]

    with pytest.raises(EngineError):
        asyncio.run(go())
    wait_until(lambda: engines["talker"].stats()["running"] == 0, 10, "the talker's job to end")


def test_stream_input_is_refused_where_the_engine_reads_whole_handoffs() -> None:
    graph = {
        "served_model_name": "m",
        "stages": [
            {"name": "thinker", "engine": "transformers", "engine_args": {"model_stage": "thinker"}},
            {
                "name": "talker",
                "engine": "transformers",
                "inputs": ["thinker"],
                "engine_args": {"model_stage": "talker"},
            },
            {
                "name": "code2wav",
                "engine": "transformers",
                "inputs": ["talker"],
                "stream_input": True,
                "engine_args": {"model_stage": "code2wav"},
                "final_output": "audio",
            },
        ],
    }
    with pytest.raises(GraphConfigError, match=r"stages\[2\]\.stream_input"):
        load_graph(graph)
    graph["stages"][2]["stream_input"] = False
    graph["stages"][0]["stream_input"] = True
    with pytest.raises(GraphConfigError, match=r"stages\[0\]\.stream_input"):
        load_graph(graph)


# ---- the channel and the walk (in process) -----------------------------------------------------


def test_a_channel_bounds_what_waits_unread_and_drops_it_when_its_consumer_ends() -> None:
    async def go() -> None:
        channels = Channels()
        assert await channels.write("k", [0], first=True)
        writes = [asyncio.create_task(channels.write("k", [i])) for i in range(1, MAX_BUFFERED_CHUNKS + 3)]
        await asyncio.sleep(0.05)
        # Every write put its item, but the writer waits while MAX_BUFFERED_CHUNKS or more wait unread.
        assert all(w.done() for w in writes[: MAX_BUFFERED_CHUNKS - 2])
        assert not any(w.done() for w in writes[MAX_BUFFERED_CHUNKS - 2 :])
        items, ended = await channels.take("k")
        assert items == list(range(MAX_BUFFERED_CHUNKS + 3)) and not ended
        assert all(await asyncio.gather(*writes))
        await channels.write("k", [], end=True)
        assert await channels.take("k") == ([], True)
        # The consumer ends: the channel is gone, a late write is refused, nothing is kept.
        assert await channels.write("k2", [1], first=True)
        channels.close("k2")
        assert not await channels.write("k2", [2]) and channels.open_channels() == 1
        channels.close("k")
        assert channels.open_channels() == 0

    asyncio.run(go())


def test_a_close_that_runs_before_the_first_write_keeps_the_channel_closed() -> None:
    """The walk tells the close without waiting; Ray may run it before a first write still on its way (a
    client that left while the first chunk was written). That write must not open a channel nobody closes."""

    async def go() -> None:
        channels = Channels()
        channels.close("k")
        assert not await channels.write("k", ["chunk"], first=True, nbytes=5)
        assert channels.open_channels() == 0
        with pytest.raises(ProducerFailed, match="closed"):
            await channels.take("k")

    asyncio.run(go())


def test_a_consumer_retried_before_its_first_output_reads_every_chunk_again() -> None:
    async def go() -> None:
        channels = Channels()
        await channels.write("k", [0, 1], first=True)
        assert await channels.take("k") == ([0, 1], False)
        await channels.write("k", [2])
        retry = channels.rewind("k")  # the replica died before any output: the retry starts over
        assert retry == 1
        assert await channels.take("k", retry) == ([0, 1, 2], False)
        channels.ack("k")  # its first output: what it took is freed, no retry from here
        assert channels.rewind("k") is None
        await channels.write("k", [3], end=True)
        assert await channels.take("k", retry) == ([3], True)
        assert channels.rewind("k") is None

    asyncio.run(go())


def test_a_take_the_lost_attempt_left_on_its_way_never_takes_the_retrys_chunks() -> None:
    """Ray still runs a take whose caller died with its node. It must fail once the call is retried, and
    the retry read every chunk: CI once saw the dead talker's take steal them, and the retried talker,
    finding its stream ended and empty, answered 400 (tests/test_autoscaling_cluster.py)."""

    async def go() -> None:
        channels = Channels()
        await channels.write("k", [0], first=True)
        assert await channels.take("k") == ([0], False)
        waiting = asyncio.ensure_future(channels.take("k"))  # the dead attempt's next take, waiting here
        await asyncio.sleep(0)
        retry = channels.rewind("k")
        await channels.write("k", [1], end=True)
        with pytest.raises(ChunksLost, match="replaced by a retry"):
            await waiting
        with pytest.raises(ChunksLost):  # one that reaches the actor only now
            await channels.take("k", 0)
        assert await channels.take("k", retry) == ([0, 1], True)

    asyncio.run(go())


def test_a_stream_that_ends_before_its_first_chunk_is_a_loss_a_503_not_bad_input() -> None:
    async def go() -> None:
        channels = Channels()
        await channels.write("k", [], first=True, end=True)
        with pytest.raises(ChunksLost) as lost:
            async for _ in ChannelReader(channels, "k").chunks():
                pass
        error = from_failure(StageFailed("talker", lost.value), "r", log=False)
        assert (error.status, error.code) == (503, "stage_unavailable")

    asyncio.run(go())


def test_a_failed_producer_is_never_a_finished_stream() -> None:
    async def go() -> None:
        channels = Channels()
        await channels.write("k", [1], first=True)
        await channels.write("k", [], failed="stage thinker failed: RuntimeError")
        with pytest.raises(ProducerFailed, match="thinker failed"):
            await channels.take("k")

    asyncio.run(go())


GRAPH = GraphConfig.model_validate(
    {
        "served_model_name": "fake",
        "stages": [
            {"name": "thinker", "engine": "transformers", "final_output": "text"},
            {"name": "talker", "engine": "transformers", "inputs": ["thinker"], "stream_input": True},
            {"name": "code2wav", "engine": "transformers", "inputs": ["talker"], "final_output": "audio"},
        ],
    }
)


class StreamingFakes(StageTransport):
    """A thinker that yields a chunk per word; a talker that yields one codec chunk per row chunk it read."""

    def __init__(
        self,
        words: int = 6,
        thinker_fails_after: int | None = None,
        talker_stops_after: int | None = None,
        talker_fails: bool = False,
    ):
        self.words, self.fails_after, self.stops_after = words, thinker_fails_after, talker_stops_after
        self.talker_fails = talker_fails
        self.calls: dict[str, list[StageRequest]] = defaultdict(list)
        self.talker_read: list[Any] = []
        self.talker_error: BaseException | None = None
        self.talker_finished = False
        self.thinker_outputs = 0

    async def voices(self, stage: str) -> list[str]:
        return []

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
        self.calls[stage].append(request)
        if stage == "thinker":
            assert request.stream_handoff
            for i in range(self.words):
                if i == self.fails_after:
                    raise RuntimeError("engine exploded")
                await asyncio.sleep(0.01)
                self.thinker_outputs += 1
                yield StageOutput(stage=stage, text=f"w{i} ", handoff=HandoffPayload("rows", {"i": np.array([i])}))
            yield StageOutput(stage=stage, finished=True, finish_reason=FinishReason.STOP)
        elif stage == "talker":
            if self.talker_fails:
                raise RuntimeError("talker exploded")
            try:
                async for chunk in request.handoff.chunks():
                    self.talker_read.append(int(chunk.tensors["i"][0]))
                    if len(self.talker_read) == self.stops_after:
                        break
                    yield StageOutput(stage=stage, handoff=HandoffPayload("codes", {"i": chunk.tensors["i"]}))
            except Exception as err:
                self.talker_error = err
                raise
            self.talker_finished = True
            yield StageOutput(stage=stage, finished=True, finish_reason=FinishReason.STOP)
        else:
            i = int(request.handoff.tensors["i"][0])
            yield StageOutput(stage=stage, audio=np.full(4, i, np.float32), sample_rate=24000, finished=True)


def walk(stages: StreamingFakes) -> list[StageOutput]:
    request = OmniRequest(
        request_id="req",
        modalities={Modality.TEXT, Modality.AUDIO},
        sampling={s.name: SamplingParams() for s in GRAPH.stages},
        messages=HELLO,
    )

    async def go() -> list[StageOutput]:
        return [o async for o in Orchestrator(GRAPH, stages).run(request)]

    return asyncio.run(go())


def test_one_talker_call_reads_every_chunk_in_order_as_the_thinker_makes_them() -> None:
    stages = StreamingFakes(words=6)
    outputs = walk(stages)
    assert len(stages.calls["talker"]) == 1 and stages.talker_read == list(range(6))
    assert [int(o.audio[0]) for o in outputs if o.audio is not None] == list(range(6))
    assert stages._channels().open_channels() == 0  # closed when the talker's call ended


def test_a_thinker_failing_mid_reply_fails_the_request_and_never_finishes_the_talker() -> None:
    stages = StreamingFakes(words=6, thinker_fails_after=3)
    with pytest.raises(StageFailed) as failure:
        walk(stages)
    assert failure.value.stage == "thinker"
    # The talker read what came before the failure (it may be cancelled before it reads all of it) and
    # never finished: the channel told it the producer failed, or the failed walk cancelled it first.
    assert stages.talker_read == [0, 1, 2][: len(stages.talker_read)] and not stages.talker_finished
    assert stages._channels().open_channels() == 0


def test_a_talker_that_ends_early_stops_the_feed() -> None:
    stages = StreamingFakes(words=6, talker_stops_after=2)
    channels = stages._channels()
    write, refused = channels.write, []

    async def counted(key: str, items: list[Any], **kwargs: Any) -> bool:
        open_ = await write(key, items, **kwargs)
        refused.extend([key] * (not open_))
        return open_

    channels.write = counted  # type: ignore[method-assign]
    outputs = walk(stages)  # the thinker finishes; its later chunks are dropped, not queued
    assert stages.talker_read == [0, 1] and stages.thinker_outputs == 6
    assert outputs and channels.open_channels() == 0
    # Dropped in the ingress: once the talker's call ended, the feed stops asking the channel (at
    # most one write was already on its way); asking it would be a channels-actor round trip per
    # chunk for the rest of the reply (the end of the stream included).
    assert len(refused) <= 1, refused


def left_open(stages: StreamingFakes, leave: Any = None, stall_first_write: bool = False) -> int:
    """Run one request, leaving when ``leave(output)`` says so (None: read it all, or let it fail); the
    channels left open once the walk ended. ``stall_first_write``: the feed's first write never returns
    (a channels actor slow to answer), so the client leaves while it is on its way."""
    channels = stages._channels()
    if stall_first_write:
        write = channels.write

        async def stalled(key: str, items: list[Any], **kwargs: Any) -> bool:
            open_ = await write(key, items, **kwargs)
            if kwargs.get("first"):
                await asyncio.Event().wait()
            return open_

        channels.write = stalled  # type: ignore[method-assign]
    request = OmniRequest(
        request_id="leaves",
        modalities={Modality.TEXT, Modality.AUDIO},
        sampling={s.name: SamplingParams() for s in GRAPH.stages},
        messages=HELLO,
    )

    async def go() -> int:
        with contextlib.suppress(StageFailed):
            async with contextlib.aclosing(Orchestrator(GRAPH, stages).run(request)) as outputs:
                async for output in outputs:
                    if leave is not None and leave(output):
                        break
        return channels.open_channels()

    return asyncio.run(go())


@pytest.mark.parametrize(
    "leave",
    [
        lambda o: bool(o.text),  # on the first text delta: the talker's call exists only as a task not yet run
        lambda o: o.audio is not None,  # on the first audio chunk
        lambda o: o.audio is not None and int(o.audio[0]) == 3,  # mid-stream
    ],
    ids=["first-text-delta", "first-audio-chunk", "mid-stream"],
)
def test_a_client_that_leaves_at_any_point_leaves_no_channel_open(leave: Any) -> None:
    assert left_open(StreamingFakes(words=6), leave) == 0


def test_a_client_that_leaves_while_the_first_chunk_is_written_leaves_no_channel_open() -> None:
    assert left_open(StreamingFakes(words=6), lambda o: bool(o.text), stall_first_write=True) == 0


@pytest.mark.parametrize(
    "stages",
    [lambda: StreamingFakes(words=6, thinker_fails_after=1), lambda: StreamingFakes(words=6, talker_fails=True)],
    ids=["producer-fails-after-the-first-chunk", "consumer-fails-at-once"],
)
def test_a_failed_request_leaves_no_channel_open(stages: Any) -> None:
    assert left_open(stages()) == 0


@pytest.mark.parametrize("when", ["first-chunk-written", "first-text-delta"])
def test_a_walk_cancelled_right_after_its_response_starts_leaves_no_channel_open(when: str) -> None:
    """A realtime barge-in cancels the task that reads the walk (``response.cancel`` just after
    ``response.create``). Cancelled the moment the talker's feed has its first chunk (the talker's call is
    then a task that has not run yet), or on the reply's first text delta, the walk still closes the
    channel it opened."""
    stages = StreamingFakes(words=6)
    channels = stages._channels()
    write = channels.write
    opened: list[int] = []
    reader: asyncio.Task[None] | None = None

    def barge_in() -> None:
        assert reader is not None
        opened.append(channels.open_channels())
        reader.cancel()

    async def first_written(key: str, items: list[Any], **kwargs: Any) -> bool:
        open_ = await write(key, items, **kwargs)
        if kwargs.get("first") and when == "first-chunk-written":
            barge_in()  # from the walk's producer task, as the session's task would: the reader is cancelled
        return open_

    channels.write = first_written  # type: ignore[method-assign]
    request = OmniRequest(
        request_id="barge-in",
        modalities={Modality.TEXT, Modality.AUDIO},
        sampling={s.name: SamplingParams() for s in GRAPH.stages},
        messages=HELLO,
    )

    async def go() -> int:
        nonlocal reader

        async def respond() -> None:
            async for output in Orchestrator(GRAPH, stages).run(request):
                if output.text and when == "first-text-delta" and not opened:
                    barge_in()

        reader = asyncio.create_task(respond())
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(reader, 30)
        return channels.open_channels()

    left = asyncio.run(go())
    assert opened == [1], f"cancelled with {opened} channels open: the test missed its window"
    assert left == 0


def test_a_client_that_reads_slowly_holds_its_request_back_instead_of_buffering_it() -> None:
    """What the walk buffers for one request is bounded (MAX_QUEUED_OUTPUTS per queue, channel bound)."""
    stages = StreamingFakes(words=400)
    request = OmniRequest(
        request_id="slow",
        modalities={Modality.TEXT, Modality.AUDIO},
        sampling={s.name: SamplingParams() for s in GRAPH.stages},
        messages=HELLO,
    )

    async def go() -> tuple[int, int]:
        read = 0
        async with contextlib.aclosing(Orchestrator(GRAPH, stages).run(request)) as outputs:
            async for _ in outputs:
                read += 1
                if read == 5:
                    await asyncio.sleep(1.5)  # the client stops reading; the thinker could make all 400 meanwhile
                    return read, stages.thinker_outputs
        return read, stages.thinker_outputs

    read, produced = asyncio.run(go())
    # The merge queue (16), one code2wav sink (16) and the outputs in hand: the thinker is held back
    # at a few dozen outputs past what the client read, not 400.
    assert produced <= read + 3 * MAX_QUEUED_OUTPUTS, f"{produced} thinker outputs made, {read} read"


# ---- graph level (Ray, HTTP) ---------------------------------------------------------------------

BODY = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Say something."}],
    "modalities": ["text", "audio"],
    "max_tokens": 24,
    "seed": 5,
    "stage_sampling": {"thinker": {"ignore_eos": True}, "talker": {"max_tokens": 40}},
}


def reply(base_url: str) -> tuple[str, bytes]:
    r = httpx.post(f"{base_url}/v1/chat/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    data, rate = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])), dtype="float32")
    return message["content"], data.tobytes()


# The thinker paced (50 ms a token: timing only, the same values; its run-time setting) so a reply is still
# being written while the talker speaks it. STREAMED is the graph's own stream_input: deployed over the tiny graph
# in place; WHOLE changes the args (a restart), so it comes last, in this module and in the run (tiny_variant 1).
PACED = {"thinker": {"user_config": {"min_step_s": 0.05}}}
STREAMED = graph_variant(fixed_replicas=1, stages={"talker": {"stream_input": True}}, deployments=PACED)
WHOLE = graph_variant(fixed_replicas=1, stages={"talker": {"stream_input": False}}, deployments=PACED)
ON_THE_GRAPH = pytest.mark.tiny_variant(1)


@pytest.fixture(scope="module")
def streamed(graphs: Any) -> tuple[str, bytes]:
    """The seeded request's reply through the tiny graph with streamed handoffs."""
    graphs.deploy("tiny_omni.yaml", STREAMED)
    graphs.wait_healthy()
    return reply(graphs.base_url)


def open_channels(actor: Any) -> int:
    import ray

    return ray.get(actor.open_channels.remote())


@pytest.mark.integration
@ON_THE_GRAPH
def test_every_channel_is_closed_after_its_request(streamed) -> None:
    (actor,) = channel_actors()  # the one ingress replica's
    wait_until(lambda: open_channels(actor) == 0, 10, "every channel closed")


@pytest.mark.integration
@ON_THE_GRAPH
def test_a_client_that_leaves_mid_reply_cancels_all_three_stages(streamed, graphs: Any) -> None:
    from tests.in_flight import open_request

    stages = ("thinker", "talker", "code2wav")

    def stats() -> dict[str, dict[str, Any]]:
        return {s: graphs.handle(s).stats.remote().result() for s in stages}

    def idle() -> bool:
        return all(s["running"] == 0 and s["waiting"] == 0 for s in stats().values())

    wait_until(idle, 60, "idle stages")
    before = stats()
    # A long thinker reply streaming into a talker that never stops (greedy: no codec EOS).
    body = {
        **BODY,
        "max_tokens": 4000,
        "stage_sampling": {"thinker": {"ignore_eos": True}, "talker": {"temperature": 0.0, "max_tokens": 4000}},
    }
    sock = open_request(graphs.base_url, True, body)
    try:

        def all_three_running() -> bool:
            now = stats()
            return (
                now["thinker"]["running"] == 1
                and now["talker"]["running"] == 1
                and now["code2wav"]["requests_total"] > before["code2wav"]["requests_total"]
            )

        wait_until(all_three_running, 90, "thinker and talker running together, code2wav called")
    finally:
        sock.close()
    wait_until(idle, 60, "every stage to drop the request after the disconnect")
    (actor,) = channel_actors()
    wait_until(lambda: open_channels(actor) == 0, 10, "the talker's channel to be closed")


@pytest.mark.integration
@ON_THE_GRAPH
def test_a_lost_channels_actor_fails_only_the_requests_using_it_and_is_replaced(streamed, graphs: Any) -> None:
    import ray

    (actor,) = channel_actors()
    ray.kill(actor, no_restart=True)
    first = httpx.post(f"{graphs.base_url}/v1/chat/completions", json=BODY, timeout=120)
    if first.status_code != 200:  # the request that found the actor dead: a clean 503 naming the streamed stage
        error = first.json()["error"]
        assert first.status_code == 503 and error["code"] == "stage_unavailable", first.text
        assert "'talker'" in error["message"], first.text
    # The next streamed call starts a new channels actor: the graph serves again.
    assert reply(graphs.base_url) == streamed
    (replacement,) = channel_actors()
    assert replacement._actor_id != actor._actor_id


@pytest.mark.integration
@ON_THE_GRAPH
def test_the_served_graph_gives_the_same_reply_with_streamed_handoffs(streamed, graphs: Any) -> None:
    """Last: the graph with whole handoffs (other args) replaces the streamed one."""
    text, audio = streamed
    assert len(text) > 0 and len(audio) > 0
    graphs.deploy("tiny_omni.yaml", WHOLE)
    graphs.wait_healthy()
    assert reply(graphs.base_url) == (text, audio), "streamed handoffs changed the reply"
