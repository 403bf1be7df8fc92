"""The stage transport: how the orchestrator calls a stage, and how long what travels between stages lives.

The orchestrator owns one :class:`StageTransport` and calls ``transport.call(stage, request, handoff)``
for every stage call; it never sees a Serve handle, an ``ObjectRef`` or a payload. Everything about
moving inputs and outputs between deployments is here, on both sides of a call:

- **By reference.** :class:`RemoteStages` calls stage deployments through Serve handles with
  ``_by_reference=True``: a handoff ``ObjectRef`` passed on to the next stage is never materialized
  in the ingress. The bytes of media in a request (data URLs, ``input_audio``) go into the object
  store here once per call and travel by reference too; the entry stage fetches and decodes them.
- **A handoff's lifetime.** A stage yields a handoff as two consecutive items of its Serve stream:
  the :class:`StageOutput` with ``handoff=PAYLOAD_FOLLOWS``, then the :class:`HandoffPayload`
  itself (:func:`stream_items`). Ray makes every item of a streaming call an object *owned by the
  caller*: the ingress replica whose orchestrator runs the request. The caller side resolves the
  small output, takes the next item's ``ObjectRef`` without resolving it, and hands the orchestrator
  a :class:`Handoff` holding it. Each downstream call claims its own reference at the moment it is
  started (:meth:`StageTransport.call`), and every holder drops its reference as soon as it is done:
  the producer's when the orchestrator asks for the producer's next output, a consumer's when its
  call (and any retry of it) has ended, the stage's once it copied the payload (:func:`receive`).
  From there Ray's reference counting decides: the payload is freed when the last consumer ended,
  or when its request ended (finished, failed, cancelled, client gone). No timer. The explicit
  releases matter because frames an exception's traceback keeps alive (until Python's cycle
  collector runs, which can take minutes) must keep no payload alive.
- **The retry rule.** A call that fails *before it yielded anything* because the replica serving it
  died or became unreachable (:func:`replica_gone`) is retried once under a new id: Serve routes the
  retry to another replica, and nothing reached the client or a downstream stage yet. Errors raised
  *by* the stage are never retried.
- **The in-process stage.** A graph of one stage with ``engine_in_ingress`` runs its engine in the
  ingress replica: :class:`LocalStage` calls it directly (no handle, no object store, no handoff).

Why the payload is its own stream item, not ``ray.put`` in the stage with the reference nested in the
yielded output: Ray 2.60 frees an object that a replica put and nested in a streamed item while the
caller still holds the reference (ray-project/ray#58080; fix proposed in PR #58082): the downstream
replica then fails with ``ReferenceCountingAssertionError``. ``tests/test_handoff_lifetime.py``
reproduces it. ``ray.put(..., _owner=...)`` could have moved ownership, but Ray 2.56 removed it.
Ownership by the caller also means a stage replica that dies takes no other request's handoff with
it: the bytes sit in its node's object store, owned by the ingress.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from omni_serve.graph.channel import ChannelReader, Channels, ask, tell
from omni_serve.graph.cycles import collect_soon
from omni_serve.graph.flow import Taken, Window, output_bytes
from omni_serve.payload import HandoffPayload, detached, padded
from omni_serve.types import ChatMessage, MediaPart, StageOutput, StageRequest

if TYPE_CHECKING:
    from ray import ObjectRef, ObjectRefGenerator
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger("ray.serve")

CHANNELS_ACTOR_PREFIX = "omni_serve.channels:"


# --- the stage side: what a stage yields, and how it takes its inputs ---------------------------


class _Marker(enum.Enum):
    PAYLOAD_FOLLOWS = "the next stream item is this output's handoff payload"


PAYLOAD_FOLLOWS = _Marker.PAYLOAD_FOLLOWS  # an enum member: stays itself through pickling


def stream_items(output: StageOutput, wanted: bool, padding_bytes: int = 0) -> list[Any]:
    """What a stage yields for one engine output: the output, then its payload when one is wanted, then its
    video when it carries one.

    A payload no downstream stage will read (``wanted`` is the request's ``wants_handoff``) is
    dropped here, whatever the engine family, so it is never serialized or stored.
    ``padding_bytes`` adds a tensor no engine reads (the stage's ``handoff_padding_bytes``: tests and
    benchmarks model production-sized handoffs with the tiny model). A video (a final result too large
    for the output itself) travels the way a payload does: its own item, owned by the caller, never
    deserialized where the output is read (:func:`_next_unresolved`).
    """
    items: list[Any] = [output]
    payload = output.handoff
    if not isinstance(payload, HandoffPayload) or not wanted:
        output.handoff = None
    else:
        payload = padded(payload, padding_bytes)
        output.handoff, output.handoff_bytes = PAYLOAD_FOLLOWS, payload.nbytes
        items.append(payload)
    if output.video is not None:
        items.append(output.video)
        output.video = PAYLOAD_FOLLOWS
    return items


@dataclasses.dataclass
class Inputs:
    """A stage call's inputs, in this process: the upstream payload and the request's media items.

    ``handoff`` is one payload, or for a streamed call (``stream_input``) the upstream's chunks in
    order as they are produced (the iterator waits for the next one); ``handoffs`` a fan-in call's.
    """

    handoff: HandoffPayload | AsyncIterator[HandoffPayload] | None
    media: list[MediaPart]  # each with ``data`` as bytes (or ``url`` to fetch under the media policy)
    handoffs: list[HandoffPayload] | None = None


async def _resolved(value: Any) -> HandoffPayload:
    """One handoff in this process: a :func:`detached` copy when it comes from the object store.

    A zero-copy view would pin the stored object as long as anything in this replica (a traceback,
    an engine's batch) holds it.
    """
    import ray

    if isinstance(value, ray.ObjectRef):
        try:
            value = detached(await value)
        except BaseException:
            value = None  # a failure's traceback keeps this frame: it must not keep the reference
            raise
    if not isinstance(value, HandoffPayload):
        raise TypeError(f"expected a HandoffPayload, got {type(value).__name__}")
    return value


async def _chunks(reader: ChannelReader) -> AsyncIterator[HandoffPayload]:
    """A streamed call's chunks, each copied into this process and its reference dropped at once.

    Dropped on a failure too: whoever keeps the failure (the talker queues it for its decoding thread)
    keeps this frame in its traceback, and a reference there holds the chunk in the object store until
    Python's next full collection (the hostile-chat test saw a talker hold one after its client left).
    """
    async with contextlib.aclosing(reader.chunks()) as items:  # closing this closes the reader's takes too
        async for item in items:
            try:
                payload = await _resolved(item)
            finally:
                item = None  # the copy is all this replica keeps
            yield payload


async def receive(request: StageRequest) -> Inputs:
    """The call's inputs out of the object store into this process; ``request`` keeps no reference to them."""
    import ray

    handoff, request.handoff = request.handoff, None
    if isinstance(handoff, ChannelReader):
        handoff = _chunks(handoff)
    elif handoff is not None:
        handoff = await _resolved(handoff)
    fan_in, request.handoffs = request.handoffs, None
    handoffs = [await _resolved(value) for value in fan_in] if fan_in is not None else None
    fan_in = None
    media: list[MediaPart] = []
    for part in (p for message in request.messages or [] for p in message.media()):
        data, part.data = part.data, None
        if isinstance(data, ray.ObjectRef):
            data = await data
        media.append(part.model_copy(update={"data": data}))
    return Inputs(handoff, media, handoffs)


# --- the caller side: the orchestrator's stage client --------------------------------------------


class Handoff:
    """One reference to an upstream output's handoff, held by the process that runs the request.

    The orchestrator passes it on without looking inside; :meth:`release` drops the reference, so
    that whatever still holds this object (an exception's frames) keeps no payload alive.
    """

    __slots__ = ("nbytes", "value")

    def __init__(self, value: Any, nbytes: int = 0):
        self.value = value  # an ObjectRef (stage deployments), or whatever a test transport yields
        self.nbytes = nbytes  # the payload's bytes, as its producer said (StageOutput.handoff_bytes)

    def claim(self) -> Handoff:
        if self.value is None:
            raise RuntimeError("a handoff was passed on after it was released")
        return Handoff(self.value, self.nbytes)

    def release(self) -> None:
        self.value = None


class HandoffFeed:
    """The orchestrator's end of one streamed call's channel (:mod:`omni_serve.graph.channel`).

    :meth:`put` passes an upstream output's :class:`Handoff` on by reference (the channel borrows
    it until the consumer takes it); :meth:`end` or :meth:`fail` ends the stream. Every write waits
    for the channel: in order, and no faster than the consumer takes while its buffer is full.
    A write after the consumer's call ended returns False: its chunk is dropped here, without asking
    the channel once the feed knows (a talker stops at its frame limit while a long reply goes on: the
    rest of the reply's chunks would each cost a round trip to the channels actor for nothing).
    """

    def __init__(self, channels: Any, key: str, lost: Callable[[Any], None] | None = None):
        self.reader = ChannelReader(channels, key)
        self._first = True  # nothing written yet: the channel does not exist
        self._closed = False  # the consumer call ended (close(), or the channel said so)
        self._lost = lost  # told when the channels actor turned out dead, so later calls get a new one

    async def _write(self, items: list[Any], **kwargs: Any) -> bool:
        if self._closed:
            return False
        channels, key = self.reader.channels, self.reader.key
        first, self._first = self._first, False
        try:
            open_ = await ask(channels, "write", key, items, first=first, **kwargs)
        except Exception as err:
            from ray.exceptions import RayActorError

            if isinstance(err, RayActorError) and self._lost is not None:
                self._lost(channels)
            raise
        self._closed |= not open_
        return open_

    async def put(self, handoff: Handoff) -> bool:
        claim = handoff.claim()
        try:
            return await self._write([claim.value], nbytes=claim.nbytes)
        finally:
            claim.release()

    async def end(self) -> None:
        await self._write([], end=True)

    async def fail(self, reason: str) -> None:
        await self._write([], failed=reason)

    def ack(self) -> None:
        """The consumer produced its first output: it will not be retried (returns at once)."""
        self._tell("ack")

    async def rewind(self) -> bool:
        """Before a retry: the retry's takes (through :attr:`reader`, a new reader) return every chunk again.

        False: not possible.
        """
        reader = await ask(self.reader.channels, "rewind", self.reader.key)
        if reader is None:
            return False
        self.reader = dataclasses.replace(self.reader, reader=reader)
        return True

    def close(self) -> None:
        """The consumer call ended, or its request did: the channel drops what was not taken (returns at once).

        Called by the consumer call when it ends and by the walk when its request ends (a consumer
        call cancelled before it started closes nothing itself); only the first call tells the channel.
        """
        if not self._closed and not self._first:  # a channel exists (or its first write is on its way)
            self._tell("close")
        self._closed = True

    def _tell(self, method: str) -> None:
        # Fire and forget: a close that runs before a first write still on its way keeps the key closed to it.
        tell(self.reader.channels, method, self.reader.key)


def replica_gone(err: BaseException) -> bool:
    """True when the call failed because the replica serving it died or is unreachable.

    Ray raises these (``ActorDiedError``, ``ActorUnavailableError``) directly for the called
    actor. The same classes wrapped in a ``RayTaskError`` come from *inside* the stage (something
    it called died), so retrying elsewhere would not help.
    """
    from ray.exceptions import RayActorError, RayTaskError

    return isinstance(err, RayActorError) and not isinstance(err, RayTaskError)


class StageTransport(abc.ABC):
    """Starts stage calls for the orchestrator; owns their handoffs and the retry rule."""

    def call(
        self, stage: str, request: StageRequest, handoff: Handoff | HandoffFeed | list[Handoff] | None = None
    ) -> AsyncGenerator[StageOutput, None]:
        """One streaming call of ``stage``. ``handoff`` is claimed now, before the producer moves on (a list:
        a fan-in call's handoffs, one per upstream stage, reaching the stage as ``request.handoffs``).

        The outputs' ``handoff`` are :class:`Handoff` objects, valid until the caller asks for the
        next output or closes the stream: pass them on (:meth:`call`, :meth:`HandoffFeed.put`) before
        that. Leaving early (``aclose``) cancels the call. With a :class:`HandoffFeed` (a streamed
        call, :meth:`feed`) the call reads its chunks from the feed's channel; its retry reads them
        again from the first (the channel keeps them until the call's first output).
        """
        if isinstance(handoff, HandoffFeed):
            return self._call(stage, request, None, handoff)
        if isinstance(handoff, list):  # a fan-in call: every upstream stage's handoff, each claimed now
            return self._call(stage, request, [h.claim() for h in handoff], None)
        return self._call(stage, request, handoff.claim() if handoff is not None else None, None)

    def feed(self, request_id: str) -> HandoffFeed:
        """A channel for the streamed call ``request_id``: put its first chunk, then start the call with it."""
        return HandoffFeed(self._channels(), request_id, self._channels_lost)

    def _channels_lost(self, channels: Any) -> None:
        """``channels`` died (its node went away): the next streamed call starts a new one."""

    def _window(self, call_id: str) -> Window | None:
        """Where the call ``call_id`` waits for its caller (:mod:`omni_serve.graph.flow`); None: it need not.

        An in-process call is a generator this process pulls: it never runs ahead of its caller.
        """
        return None

    def _channels(self) -> Any:
        """Where streamed calls' channels live: here, in process (stages called in process, tests)."""
        channels = getattr(self, "_local_channels", None)
        if channels is None:
            channels = self._local_channels = Channels()
        return channels

    async def _call(
        self, stage: str, request: StageRequest, claim: Handoff | list[Handoff] | None, feed: HandoffFeed | None
    ) -> AsyncGenerator[StageOutput, None]:
        output: StageOutput | None = None
        messages: list[ChatMessage] | None = None
        try:
            messages = self._media_by_reference(request.messages)
            for attempt in (1, 2):
                call_id = request.request_id if attempt == 1 else f"{request.request_id}~retry"
                wire = dataclasses.replace(
                    request,
                    request_id=call_id,
                    handoff=feed.reader if feed is not None else claim.value if isinstance(claim, Handoff) else None,
                    handoffs=[c.value for c in claim] if isinstance(claim, list) else None,
                    messages=messages,
                    sent_at=time.time(),
                    window=self._window(call_id),
                )
                taken = Taken(wire.window)  # what the caller took: the stage waits when a window ahead
                produced = False
                try:
                    # aclosing: a caller that leaves closes this try at once, which cancels the call.
                    async with contextlib.aclosing(self._attempt(stage, wire)) as outputs:
                        async for output in outputs:
                            if feed is not None and not produced:
                                feed.ack()
                            produced = True
                            if output.handoff is not None:
                                output.handoff = Handoff(output.handoff, output.handoff_bytes)
                            yield output
                            # Asked for the next one: the caller is done with this one (and its handoff).
                            taken.took(1 + (output.handoff is not None), output_bytes(output))
                            if output.handoff is not None:
                                output.handoff.release()
                    return
                except Exception as err:
                    if attempt == 1 and not produced and replica_gone(err) and (feed is None or await feed.rewind()):
                        logger.warning(
                            "request %s: stage %s replica lost before any output (%s); retrying once",
                            request.request_id,
                            stage,
                            type(err).__name__,
                        )
                        continue
                    raise
                finally:
                    taken.close()
                    # Serve may keep the request it sent for a while after the call: it must keep no payload.
                    wire.handoff = wire.messages = wire.handoffs = None
        finally:
            if output is not None and isinstance(output.handoff, Handoff):
                output.handoff.release()
            for held in claim if isinstance(claim, list) else [claim] if claim is not None else []:
                held.release()
            if feed is not None:
                feed.close()
            messages = None  # media by reference: held for the call and its retry only

    def _media_by_reference(self, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        """The messages as they travel to the entry stage (media bytes by reference where that applies)."""
        return messages

    @abc.abstractmethod
    def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
        """One try of the call; outputs carry their handoff as the transport's raw value (e.g. an ObjectRef)."""

    @abc.abstractmethod
    async def voices(self, stage: str) -> list[str]:
        """The voices the stage's engine declares."""


class RemoteStages(StageTransport):
    """Stages that are Serve deployments of their own, called through handles by reference."""

    def __init__(self, handles: dict[str, DeploymentHandle]):
        # By reference: a handoff ObjectRef passed on to the next stage is never materialized
        # here, even if RAY_SERVE_THROUGHPUT_OPTIMIZED flips the default.
        self.handles = {name: h.options(stream=True, _by_reference=True) for name, h in handles.items()}
        self.voice_handles = {name: h.options(method_name="voices") for name, h in handles.items()}
        self._channel_actor: Any = None
        self._channel_generation = 0

    def _window(self, call_id: str) -> Window:
        """A stage deployment queues what a call yields without bound (Serve 2.60): it waits in its window."""
        return Window(self._channels(), call_id)

    def _channels_lost(self, channels: Any) -> None:
        if self._channel_actor is channels:
            logger.warning("the handoff channels actor died; streamed calls get a new one")
            self._channel_actor = None

    async def voices(self, stage: str) -> list[str]:
        return await self.voice_handles[stage].remote()

    def _channels(self) -> Any:
        """This replica's :class:`Channels` actor (streamed handoffs, calls' windows), started on the first call.

        No CPU, and on this node (hard affinity: it shares this replica's fate, never another
        node's): every chunk write is a local RPC. It is owned by this replica's process, so it dies
        with the replica, as do the requests its channels serve. Should it die alone, the calls
        using it fail and the next streamed call starts a new one (:meth:`_channels_lost`).
        """
        if self._channel_actor is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            context = ray.get_runtime_context()
            here = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False)
            self._channel_generation += 1
            self._channel_actor = (
                ray.remote(Channels)
                .options(
                    # Named after this replica's actor, so tests and operators can find it; not detached.
                    name=f"{CHANNELS_ACTOR_PREFIX}{context.get_actor_id() or context.get_worker_id()}"
                    f".{self._channel_generation}",
                    num_cpus=0,
                    scheduling_strategy=here,
                    max_concurrency=10_000,
                )
                .remote()
            )
        return self._channel_actor

    def _media_by_reference(self, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        import ray

        if not any(part.data is not None for m in messages or [] for part in m.media()):
            return messages
        by_reference = []
        for message in messages or []:
            if isinstance(message.content, list):
                parts = [
                    p.model_copy(update={"data": ray.put(p.data)}) if isinstance(p, MediaPart) and p.data else p
                    for p in message.content
                ]
                message = message.model_copy(update={"content": parts})
            by_reference.append(message)
        return by_reference

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
        from ray.exceptions import TaskCancelledError

        response: Any = self.handles[stage].generate.remote(request)  # a DeploymentResponseGenerator (stream=True)
        done = False
        try:
            items = await response._to_object_ref_gen()
            async for ref in items:
                try:
                    output = await ref
                except TaskCancelledError:  # what Serve's own iteration turns a cancelled call into
                    raise asyncio.CancelledError() from None
                if output.handoff is PAYLOAD_FOLLOWS:
                    output.handoff = await _next_unresolved(items)
                if output.video is PAYLOAD_FOLLOWS:
                    output.video = await _next_unresolved(items)
                yield output
                output = None
            done = True
        finally:
            if not done:
                # A call that never started re-raises its start error from cancel(); it was raised already.
                with contextlib.suppress(Exception):
                    response.cancel()
                collect_soon()  # Serve leaves a call cancelled while it routes it in a cycle (omni_serve.graph.cycles)
            items = response = None  # unconsumed stream items are released with the stream


async def _next_unresolved(items: ObjectRefGenerator) -> ObjectRef:
    """The stream's next ref once its object exists, never fetched or deserialized here.

    ``ObjectRefGenerator.__anext__`` would load the value when the item is not reported yet
    ("TODO: Avoid fetching the value" in Ray 2.60), i.e. load the payload in the ingress. Peeking,
    waiting with ``ObjectRef._on_ready`` and consuming is how Serve 2.60 itself waits for a stream
    item without loading it (``replica_result._consume_generator_ref_when_ready``).
    """
    (ref,) = items._get_next_ref_n(1)
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if ready.done():
            return
        if exc is None:
            ready.set_result(None)
        else:
            ready.set_exception(exc if isinstance(exc, BaseException) else RuntimeError(str(exc)))

    def on_ready(exc: BaseException | None) -> None:  # runs on a Ray thread
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, exc)

    stop_waiting = ref._on_ready(on_ready)
    try:
        await ready
    except BaseException:
        ref = None  # the exception's traceback keeps this frame: it must not keep the payload
        raise
    finally:
        stop_waiting()
    items._consume_next_ref_n(1)
    return ref


class InProcessStage(Protocol):
    """What :class:`LocalStage` calls: :class:`omni_serve.graph.stage.Stage`."""

    def generate(self, request: StageRequest) -> AsyncGenerator[Any, None]: ...

    def voices(self) -> list[str]: ...


class LocalStage(StageTransport):
    """The graph's one stage, running in this process (``engine_in_ingress``): no handle, no Ray objects."""

    def __init__(self, stage: InProcessStage):
        self.stage = stage

    async def voices(self, stage: str) -> list[str]:
        return self.stage.voices()

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
        items = self.stage.generate(request)  # one stage: it yields no handoff
        try:
            async for output in items:
                if output.video is PAYLOAD_FOLLOWS:  # in process: the video itself, not a reference
                    output.video = await anext(items)
                yield output
        finally:
            await items.aclose()
