"""The DAG walk for one request: model-agnostic, routes references, never payloads.

Given the wanted modalities, only the stages that produce them (and their upstream
stages) run. Every output of a stage that carries a handoff starts one call of each
needed downstream stage with that handoff reference; downstream calls run
concurrently and their outputs are relayed in handoff order, so a talker's codec
chunks can be decoded by several code2wav replicas at once yet reach the client in
order. The final outputs of every stage that ran and has a ``final_output`` are relayed,
wanted or not (an audio-only reply still needs the text stage's transcript, usage and
finish reason); the ingress decides what the client sees. Cancellation (client gone)
cancels every stage call this request started.

Every stage call gets its own engine request id, minted here from the server's request
id, the stage's path in the graph and the chunk index (and a suffix for a retry): two
clients can never share one, whatever ``X-Request-ID`` they send.

Failure rules (what a client can rely on):

- A stage call that ends without its ``finished`` output is a failure, never a short
  result: a replica that dies midway cannot turn into a truncated reply sent as success.
- A stage call whose replica died before it yielded anything is retried once by the
  transport (:mod:`omni_serve.graph.transport` owns that rule); errors raised *by* the
  stage (bad input, engine errors, a lost upstream handoff, backpressure) are never retried.
- A stage call that finishes with ``finish_reason`` ABORT although nobody cancelled it
  (its engine gave up on it) is a failure too: an aborted call is never a completion.
- ``stage_timeout_s`` bounds how long one stage call may stay silent; the request's
  ``deadline`` (the ingress sets it just below Serve's ``request_timeout_s``) bounds the
  whole walk, so the client gets a 504 in the API's error shape before Serve's 408.
- Each request keeps at most ``max_fanout`` calls of one downstream stage in flight, so
  the calls one request queues at a stage are bounded (the talker's codec chunks wait
  for a code2wav slot here instead of piling up in the stage's queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from omni_serve.graph.config import GraphConfig, StageConfig
from omni_serve.graph.stage_log import StageLog
from omni_serve.graph.transport import Handoff, HandoffFeed, StageTransport
from omni_serve.types import (
    ChatMessage,
    FinishReason,
    ImageParams,
    Modality,
    SamplingParams,
    StageOutput,
    StageRequest,
    VideoParams,
)

logger = logging.getLogger("ray.serve")

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - Python 3.10
    from async_timeout import timeout as _timeout


class StageTimeout(TimeoutError):
    def __init__(self, stage: str, seconds: float, *, deadline: bool = False):
        super().__init__(
            f"the request reached its time limit while waiting for stage '{stage}'"
            if deadline
            else f"stage '{stage}' produced nothing for {seconds:.0f} s"
        )
        self.stage = stage


class StageFailed(RuntimeError):
    """A stage call failed; ``cause`` is the original error (Ray wraps engine errors)."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"stage '{stage}' failed: {type(cause).__name__}")
        self.stage = stage
        self.cause = cause


class IncompleteStageStream(RuntimeError):
    """The stage's stream ended before its ``finished`` output (e.g. its replica went away)."""


class AbortedStageCall(RuntimeError):
    """The stage's engine finished the call with ABORT although nobody cancelled it."""


@dataclass
class OmniRequest:
    """What the ingress hands the orchestrator: one client request, already validated."""

    request_id: str  # minted by the server; stage call ids derive from it
    modalities: set[Modality]
    sampling: dict[str, SamplingParams]  # resolved per stage
    messages: list[ChatMessage] | None = None
    voice: str | None = None  # already validated against the graph's voices
    image: ImageParams | None = None
    video: VideoParams | None = None
    reply: str | None = None  # text-to-speech: the entry stage speaks this instead of generating
    client_request_id: str | None = None  # the client's X-Request-ID: a label for logs, never a key
    deadline: float | None = None  # time.monotonic() by which the whole walk must be done
    return_prompt_text: bool = False
    # Every stage call's start and every output of every stage, recorded as they pass (vLLM-Omni's
    # return_stage_metrics); None records nothing.
    stage_log: StageLog | None = None


@dataclass
class _Walk:
    request: OmniRequest
    stages: set[str]
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


_END = object()

# Outputs one queue of a request's walk holds before its writer waits (the merge queue, and one per
# downstream call): with max_fanout calls per downstream stage, a request buffers at most
# (2 + max_fanout) x this many outputs in the ingress however slowly its client reads.
MAX_BUFFERED_OUTPUTS = 16


@dataclass
class _Failure:
    error: BaseException


class Orchestrator:
    def __init__(
        self,
        graph: GraphConfig,
        transport: StageTransport,
        stage_timeout_s: float | None = None,
        *,
        max_fanout: int = 4,
    ):
        self.graph = graph
        self.transport = transport
        self.stage_timeout_s = stage_timeout_s or graph.stage_timeout_s
        self.max_fanout = max_fanout

    def plan(self, modalities: set[Modality]) -> set[str]:
        return self.graph.stages_for(modalities)

    async def run(self, request: OmniRequest) -> AsyncIterator[StageOutput]:
        """Yield the final outputs the request asked for, in order per modality."""
        walk = _Walk(request, self.plan(request.modalities))
        entry = self.graph.entry
        first = StageRequest(
            request_id=f"{request.request_id}/{entry.name}",
            sampling=request.sampling[entry.name],
            wants_handoff=self._feeds_downstream(entry, walk),
            stream_handoff=self._streams_downstream(entry, walk),
            messages=request.messages,
            voice=request.voice,
            image=request.image,
            video=request.video,
            reply=request.reply,
            client_request_id=request.client_request_id,
            return_prompt_text=request.return_prompt_text,
        )
        try:
            async for output in self._walk(entry, first.request_id, self._stage_stream(entry, first, None, walk), walk):
                yield output
        finally:
            for task in walk.tasks:
                task.cancel()
            if walk.tasks:
                await asyncio.gather(*walk.tasks, return_exceptions=True)

    def _feeds_downstream(self, stage: StageConfig, walk: _Walk) -> bool:
        return any(c.name in walk.stages for c in self.graph.children(stage.name))

    def _streams_downstream(self, stage: StageConfig, walk: _Walk) -> bool:
        """Whether ``stage`` should yield its handoff in chunks: every downstream stage it runs reads a stream."""
        children = [c for c in self.graph.children(stage.name) if c.name in walk.stages]
        return bool(children) and all(c.stream_input for c in children)

    def _time_limit(self, deadline: float | None) -> tuple[float, bool]:
        """Seconds the next wait may take, and whether the request's deadline (not the stage's) sets it."""
        if deadline is None:
            return self.stage_timeout_s, False
        left = max(0.0, deadline - time.monotonic())
        return (left, True) if left < self.stage_timeout_s else (self.stage_timeout_s, False)

    def _stage_stream(
        self, stage: StageConfig, request: StageRequest, handoff: Handoff | HandoffFeed | None, walk: _Walk
    ) -> AsyncIterator[StageOutput]:
        """One stage call, started now (so it claims ``handoff`` before the producer moves on)."""
        log = walk.request.stage_log
        if log is not None:
            log.started(stage.name)
        return self._checked(stage, self.transport.call(stage.name, request, handoff), walk.request.deadline, log)

    async def _checked(
        self,
        stage: StageConfig,
        stream: AsyncGenerator[StageOutput, None],
        deadline: float | None,
        log: StageLog | None,
    ) -> AsyncIterator[StageOutput]:
        """The call's outputs under its time limits; every way it can fail becomes one StageFailed/StageTimeout.

        Every output of every stage call passes here (intermediate stages' too): ``log`` records it on arrival.
        """
        try:
            while True:
                limit, by_deadline = self._time_limit(deadline)
                try:
                    async with _timeout(limit):
                        output = await anext(stream)
                except StopAsyncIteration:
                    raise StageFailed(stage.name, IncompleteStageStream("ended before its final output")) from None
                except asyncio.TimeoutError:  # not the builtin before Python 3.11
                    raise StageTimeout(stage.name, limit, deadline=by_deadline) from None
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # Ray wraps the stage's exception; keep it as the cause
                    raise StageFailed(stage.name, err) from err
                if output.finished and output.finish_reason is FinishReason.ABORT:
                    raise StageFailed(stage.name, AbortedStageCall(f"stage {stage.name} aborted the call"))
                if log is not None:
                    log.saw(stage.name, output)
                yield output
                if output.finished:
                    return
        finally:
            await stream.aclose()  # a no-op once it finished; cancels the call while it runs

    async def _walk(
        self, stage: StageConfig, request_id: str, stream: AsyncIterator[StageOutput], walk: _Walk
    ) -> AsyncIterator[StageOutput]:
        """The final outputs of ``stream`` (a call of ``stage`` with engine id ``request_id``) and of its subtree."""
        emit = stage.final_output is not None
        children = [c for c in self.graph.children(stage.name) if c.name in walk.stages]
        if not children:
            async for output in stream:
                if emit:
                    yield dataclasses.replace(output, handoff=None)
            return

        # Bounded: a client that reads slowly holds this request's stage outputs back here (the
        # producers wait) instead of letting them pile up (MAX_BUFFERED_OUTPUTS, module docstring).
        merged: asyncio.Queue[Any] = asyncio.Queue(MAX_BUFFERED_OUTPUTS)
        # One queue per downstream call, in handoff order; None closes the sequence.
        downstream: asyncio.Queue[asyncio.Queue[Any] | None] = asyncio.Queue()

        async def pump(source: AsyncIterator[StageOutput], sink: asyncio.Queue[Any]) -> None:
            try:
                async for item in source:
                    await sink.put(item)
                await sink.put(_END)
            except asyncio.CancelledError:
                raise
            except BaseException as err:
                await sink.put(_Failure(err))

        # At most max_fanout calls of each child stage in flight for this request.
        slots = {child.name: asyncio.Semaphore(self.max_fanout) for child in children}

        async def child_walk(child: StageConfig, child_id: str, calls: AsyncIterator[StageOutput], sink: Any) -> None:
            try:
                await pump(self._walk(child, child_id, calls, walk), sink)
            finally:
                slots[child.name].release()

        # Streamed edges (stream_input): one call per request, fed every handoff through its feed.
        feeds: dict[str, HandoffFeed] = {}

        def start(child: StageConfig, index: int, handoff: Handoff | HandoffFeed) -> asyncio.Queue[Any]:
            child_request = StageRequest(
                request_id=f"{request_id}/{child.name}.{index}",
                sampling=walk.request.sampling[child.name],
                chunk_index=index,
                wants_handoff=self._feeds_downstream(child, walk),
                stream_handoff=self._streams_downstream(child, walk),
                voice=walk.request.voice,
                image=walk.request.image,
                video=walk.request.video,
                client_request_id=walk.request.client_request_id,
            )
            # Started here, before the next output: the call claims this output's handoff now.
            child_stream = self._stage_stream(child, child_request, handoff, walk)
            sink: asyncio.Queue[Any] = asyncio.Queue(MAX_BUFFERED_OUTPUTS)
            walk.tasks.append(asyncio.create_task(child_walk(child, child_request.request_id, child_stream, sink)))
            return sink

        async def fed(child: StageConfig, feed: HandoffFeed, handoff: Handoff) -> bool:
            try:
                return await feed.put(handoff)
            except Exception as err:  # the channel is gone (its actor died): the streamed call fails
                raise StageFailed(child.name, err) from err

        async def produce() -> None:
            index = 0
            try:
                async for output in stream:
                    if emit:
                        await merged.put(dataclasses.replace(output, handoff=None))
                    if output.handoff is None:
                        continue
                    for child in children:
                        if child.stream_input and child.name in feeds:
                            await fed(child, feeds[child.name], output.handoff)  # False: call ended, chunk dropped
                            continue
                        await slots[child.name].acquire()
                        if child.stream_input:
                            feed = feeds[child.name] = self.transport.feed(f"{request_id}/{child.name}.{index}")
                            await fed(child, feed, output.handoff)  # the first chunk is there before the call starts
                            await downstream.put(start(child, index, feed))
                        else:
                            await downstream.put(start(child, index, output.handoff))
                    index += 1
            except Exception as err:
                for feed in feeds.values():  # a consumer must never take a failed producer's end for its finish
                    with contextlib.suppress(Exception):  # the producer's error is the one to report
                        await feed.fail(f"stage {stage.name} failed: {type(err).__name__}")
                raise
            for feed in feeds.values():
                await feed.end()
            await downstream.put(None)

        async def sequence() -> None:
            while (sink := await downstream.get()) is not None:
                while (item := await sink.get()) is not _END:
                    if isinstance(item, _Failure):
                        raise item.error
                    await merged.put(item)

        async def guarded(work: Any) -> None:
            try:
                await work
                await merged.put(_END)
            except asyncio.CancelledError:
                raise
            except BaseException as err:
                await merged.put(_Failure(err))

        workers = [asyncio.create_task(guarded(produce())), asyncio.create_task(guarded(sequence()))]
        walk.tasks.extend(workers)
        finished = 0
        while finished < len(workers):
            item = await merged.get()
            if item is _END:
                finished += 1
            elif isinstance(item, _Failure):
                raise item.error
            else:
                yield item
