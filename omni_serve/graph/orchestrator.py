"""The DAG walk for one request: model-agnostic, routes references, never payloads.

Given the wanted modalities, only the stages that produce them (and their upstream
stages) run. Every output of a stage that carries a handoff starts one call of each
needed downstream stage with that handoff reference; downstream calls run
concurrently and their outputs are relayed in handoff order, so a talker's codec
chunks can be decoded by several code2wav replicas at once yet reach the client in
order. A stage with several ``inputs`` (fan-in) gets one call instead, started once every
upstream stage's call finished, with their final handoffs in ``inputs`` order. The final
outputs of every stage that ran and has a ``final_output`` are relayed, wanted or not (an
audio-only reply still needs the text stage's transcript, usage and finish reason); the
ingress decides what the client sees. Cancellation (client gone)
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
- Each request keeps at most ``max_fanout`` calls of one downstream stage in flight or
  holding outputs it has not relayed yet, so the calls one request queues at a stage are
  bounded (the talker's codec chunks wait for a code2wav slot here instead of piling up in
  the stage's queue), and so is what finished calls hold for a client that reads slowly.

What one request may hold in the ingress, in bytes, and how a client that stops reading
holds back every stage up to the engines: :mod:`omni_serve.graph.flow`. A streamed call's
channel is closed by the call when it ends and by the walk when the request ends (a call
cancelled before it ever ran closes nothing itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from omni_serve.exceptions import AbortedStageCall, IncompleteStageStream, StageFailed, StageTimeout
from omni_serve.graph.config import GraphConfig, StageConfig
from omni_serve.graph.flow import Buffer, Buffers
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.stage_log import StageLog
from omni_serve.graph.transport import Handoff, HandoffFeed, StageTransport
from omni_serve.types import (
    FinishReason,
    Modality,
    StageOutput,
    StageRequest,
)

logger = logging.getLogger("ray.serve")

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - Python 3.10
    from async_timeout import timeout as _timeout


@dataclass
class _Walk:
    """One request's walk: the stages it runs, its byte budget, and what must be undone when it ends."""

    request: OmniRequest
    stages: set[str]
    buffers: Buffers
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # Every streamed call's feed this walk opened. The walk closes them all when it ends: a consumer call
    # closes its own when it ends, but one cancelled before it started (the client left right after the
    # feed's first chunk) never runs that code, and its channel would keep the chunk.
    feeds: list[HandoffFeed] = field(default_factory=list)
    joins: dict[str, _Join] = field(default_factory=dict)  # fan-in stage -> the handoffs it has so far


@dataclass
class _Join:
    """A fan-in stage's handoffs of one request as its upstream stages finish (claimed: held until it starts).

    vLLM-Omni hands a stage with several ``input_sources`` every source's output; here the stage's one
    call starts once the last of them finished, with each one's final handoff in ``inputs`` order.
    """

    inputs: list[str]
    handoffs: dict[str, Handoff] = field(default_factory=dict)

    def add(self, upstream: str, handoff: Handoff) -> list[Handoff] | None:
        """Keep ``upstream``'s handoff; every input's, in order, once this was the last one."""
        self.handoffs[upstream] = handoff.claim()
        return [self.handoffs[name] for name in self.inputs] if len(self.handoffs) == len(self.inputs) else None

    def release(self) -> None:
        for handoff in self.handoffs.values():
            handoff.release()


_END = object()


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
        buffer_bytes: int | None = None,
    ):
        self.graph = graph
        self.transport = transport
        self.stage_timeout_s = stage_timeout_s or graph.stage_timeout_s
        self.max_fanout = max_fanout
        self.buffer_bytes = buffer_bytes or graph.request_buffer_bytes
        self._walking: set[Buffers] = set()  # the budgets of the walks running now (buffered())

    def plan(self, modalities: set[Modality]) -> set[str]:
        return self.graph.stages_for(modalities)

    def buffered(self) -> dict[str, int]:
        """What the requests walking now hold in their queues: how many, the bytes in all, the most one held."""
        return {
            "requests": len(self._walking),
            "bytes": sum(b.held for b in self._walking),
            "peak": max((b.peak for b in self._walking), default=0),
        }

    async def run(self, request: OmniRequest) -> AsyncIterator[StageOutput]:
        """Yield the final outputs the request asked for, in order per modality."""
        walk = _Walk(request, self.plan(request.modalities), Buffers(self.buffer_bytes))
        self._walking.add(walk.buffers)
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
            text_to_speak=request.text_to_speak,
            speech=request.speech,
            client_request_id=request.client_request_id,
            return_prompt_text=request.return_prompt_text,
            tools=request.tools,
        )
        call = self._stage_stream(entry, first, None, walk)
        try:
            async with contextlib.aclosing(self._subtree(entry, first.request_id, call, walk)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            for task in walk.tasks:
                task.cancel()
            if walk.tasks:
                await asyncio.gather(*walk.tasks, return_exceptions=True)
            for feed in walk.feeds:  # after the calls ended: a no-op for every consumer that closed its own
                feed.close()
            for join in walk.joins.values():  # fan-in stages that never started: their handoffs go now
                join.release()
            self._walking.discard(walk.buffers)
            # The tasks' coroutines refer to the walk (a cycle): nothing the request held may wait for the
            # cycle collector, so the walk lets go of its tasks and of what its queues still hold.
            walk.tasks.clear()
            walk.buffers.clear()

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
        self,
        stage: StageConfig,
        request: StageRequest,
        handoff: Handoff | HandoffFeed | list[Handoff] | None,
        walk: _Walk,
    ) -> AsyncGenerator[StageOutput, None]:
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
    ) -> AsyncGenerator[StageOutput, None]:
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

    def _subtree(
        self, stage: StageConfig, request_id: str, call: AsyncGenerator[StageOutput, None], walk: _Walk
    ) -> AsyncGenerator[StageOutput, None]:
        """The final outputs of ``call`` (``stage``'s, engine id ``request_id``) and of the calls it starts."""
        children = [c for c in self.graph.children(stage.name) if c.name in walk.stages]
        if not children:
            return _relayed(call, emit=stage.final_output is not None)
        return _FanOut(self, walk, stage, request_id, call, children).outputs()

    def _child_request(self, child: StageConfig, request_id: str, index: int, walk: _Walk) -> StageRequest:
        return StageRequest(
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


async def _relayed(call: AsyncGenerator[StageOutput, None], emit: bool) -> AsyncGenerator[StageOutput, None]:
    """A call of a stage with no downstream stage in the walk: its final outputs, if it has any."""
    async with contextlib.aclosing(call) as outputs:
        async for output in outputs:
            if emit:
                yield dataclasses.replace(output, handoff=None)


class _FanOut:
    """One stage call of a request, and the downstream calls its handoffs start.

    Three tasks share the work (all in the walk's task list, so leaving the walk cancels them):

    - :meth:`_produce` reads the call: relays its own final outputs, and hands each handoff on to
      every downstream stage (:meth:`_hand_on`): a new call per handoff, or for a ``stream_input``
      stage one call fed every handoff through its feed; its final handoff goes to the fan-in stages
      (:meth:`_join`), whose call starts here when this was the last of their inputs to finish;
    - one task per downstream call pumps that call's subtree into the call's own queue (:meth:`_start`);
    - :meth:`_sequence` moves those queues' outputs into the relay queue, one downstream call after
      the other, in handoff order.

    :meth:`outputs` yields what reaches the relay queue. Every queue draws on the request's byte budget
    (:class:`~omni_serve.graph.flow.Buffers`), and a downstream call holds one of its stage's
    ``max_fanout`` slots until :meth:`_sequence` has relayed its outputs: a client that stops reading
    stops the relay, then the downstream calls (no slot), then this call (a full queue).
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        walk: _Walk,
        stage: StageConfig,
        request_id: str,
        call: AsyncGenerator[StageOutput, None],
        children: list[StageConfig],
    ):
        self.orchestrator, self.walk, self.stage = orchestrator, walk, stage
        self.request_id, self.call = request_id, call
        # Fan-in stages (several inputs) start once all their inputs finished (_join); the others per handoff.
        self.children = [c for c in children if len(c.inputs) == 1]
        self.joined = [c for c in children if len(c.inputs) > 1]
        self.relay: Buffer[Any] = walk.buffers.queue()
        # The downstream calls' queues, in handoff order; None: no more. Bounded by the slots.
        self.started: asyncio.Queue[tuple[StageConfig, Buffer[Any]] | None] = asyncio.Queue()
        self.slots = {child.name: asyncio.Semaphore(orchestrator.max_fanout) for child in children}
        self.feeds: dict[str, HandoffFeed] = {}  # the streamed children's: one call each

    async def outputs(self) -> AsyncGenerator[StageOutput, None]:
        workers = [self._task(_ended_into(self.relay, work)) for work in (self._produce, self._sequence)]
        finished = 0
        while finished < len(workers):
            item = await self.relay.get()
            if item is _END:
                finished += 1
            elif isinstance(item, _Failure):
                raise item.error
            else:
                yield item

    def _task(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self.walk.tasks.append(task)
        return task

    async def _produce(self) -> None:
        index = 0
        last: StageOutput | None = None
        try:
            async with contextlib.aclosing(self.call) as outputs:
                async for last in outputs:
                    if self.stage.final_output is not None:
                        await self.relay.put(dataclasses.replace(last, handoff=None))
                    if last.handoff is not None:
                        await self._hand_on(last.handoff, index)
                        if last.finished:
                            await self._join(last.handoff)
                        index += 1
            if self.joined and (last is None or not last.finished or last.handoff is None):
                missing = IncompleteStageStream(f"no final handoff for {self.joined[0].name}")
                raise StageFailed(self.stage.name, missing)
        except Exception as err:
            for feed in self.feeds.values():  # a consumer must never take a failed producer's end for its finish
                with contextlib.suppress(Exception):  # the producer's error is the one to report
                    await feed.fail(f"stage {self.stage.name} failed: {type(err).__name__}")
            raise
        for feed in self.feeds.values():
            await feed.end()
        self.started.put_nowait(None)

    async def _hand_on(self, handoff: Handoff, index: int) -> None:
        """Pass one output's handoff to every downstream stage, before the call's next output invalidates it."""
        for child in self.children:
            feed = self.feeds.get(child.name)
            if feed is not None:  # the streamed call runs: one more chunk (dropped if that call ended)
                await self._fed(child, feed, handoff)
                continue
            await self.slots[child.name].acquire()  # given back once _sequence relayed the call's outputs
            if child.stream_input:
                key = f"{self.request_id}/{child.name}.{index}"  # the streamed call's engine request id
                feed = self.feeds[child.name] = self.orchestrator.transport.feed(key)
                self.walk.feeds.append(feed)  # before its first chunk: whatever happens next, the walk closes it
                await self._fed(child, feed, handoff)  # the first chunk is there before the call starts
                self._start(child, index, feed)
            else:
                self._start(child, index, handoff)

    async def _join(self, handoff: Handoff) -> None:
        """This call's final handoff for its fan-in stages; one whose inputs are all here starts."""
        for child in self.joined:
            join = self.walk.joins.setdefault(child.name, _Join(list(child.inputs)))
            handoffs = join.add(self.stage.name, handoff)
            if handoffs is None:
                continue
            del self.walk.joins[child.name]
            try:
                await self.slots[child.name].acquire()  # one call per request: this only keeps _sequence's rule
                self._start(child, 0, handoffs)  # the call claims them as it starts
            finally:
                join.release()

    async def _fed(self, child: StageConfig, feed: HandoffFeed, handoff: Handoff) -> bool:
        try:
            return await feed.put(handoff)
        except Exception as err:  # the channel is gone (its actor died): the streamed call fails
            raise StageFailed(child.name, err) from err

    def _start(self, child: StageConfig, index: int, handoff: Handoff | HandoffFeed | list[Handoff]) -> None:
        """Start one downstream call now (it claims ``handoff`` before the producer moves on) and pump its subtree."""
        orchestrator = self.orchestrator
        request = orchestrator._child_request(child, self.request_id, index, self.walk)
        call = orchestrator._stage_stream(child, request, handoff, self.walk)
        sink: Buffer[Any] = self.walk.buffers.queue()
        subtree = orchestrator._subtree(child, request.request_id, call, self.walk)
        self._task(_ended_into(sink, _copied, subtree, sink))
        self.started.put_nowait((child, sink))

    async def _sequence(self) -> None:
        while (started := await self.started.get()) is not None:
            child, sink = started
            while (item := await sink.get()) is not _END:
                if isinstance(item, _Failure):
                    raise item.error
                await self.relay.put(item)
            self.slots[child.name].release()


async def _copied(source: AsyncGenerator[StageOutput, None], sink: Buffer[Any]) -> None:
    async with contextlib.aclosing(source) as outputs:
        async for output in outputs:
            await sink.put(output)


async def _ended_into(queue: Buffer[Any], work: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Run ``work(*args)``; then its end, or its failure, goes into ``queue`` for whoever reads it."""
    try:
        await work(*args)
        await queue.put(_END)
    except asyncio.CancelledError:
        raise
    except BaseException as err:
        await queue.put(_Failure(err))
