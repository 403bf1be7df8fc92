"""Streamed handoffs: the channel that feeds one downstream stage call its upstream's handoff chunks.

A stage whose config says ``stream_input`` is called once per request, as soon as its upstream
yields the first handoff chunk; the rest of the chunks reach that running call through a channel
(:mod:`omni_serve.graph.transport` opens it, the orchestrator writes it, the stage reads it):

- **Keyed by the consumer call** (its engine request id, unique per call), so no two calls, and no
  two clients, ever share one.
- **By reference.** The chunks are the producer's stream items, owned by the ingress like every
  handoff; the channel holds their ``ObjectRef`` nested in a list (never resolved) until the
  consumer takes them, then drops them: a chunk lives until its consumer copied it (and produced
  its first output, see below), or until the consumer call ended (:meth:`Channels.close`).
- **Retried like any call.** Until the consumer's first output the channel keeps what it took, so
  a consumer whose replica died before producing anything is retried on another replica reading
  every chunk again (:meth:`Channels.rewind`); its first output frees them (:meth:`Channels.ack`).
  The retry reads as a new reader: a take the dead replica had sent still runs here (Ray does not
  cancel an actor call whose caller died), and it must not take the retry's chunks (it did once: the
  retried talker found its stream ended and empty, and answered 400), so an earlier reader's take fails.
- **Ordered and bounded.** The orchestrator writes one request's chunks in order and waits for
  each write; a write returns only while fewer than :data:`MAX_BUFFERED_CHUNKS` chunks and
  :data:`MAX_BUFFERED_CHUNK_BYTES` wait unread, so a consumer that falls behind holds its
  producer's chunks back in the producing request's walk instead of letting them pile up here.
- **Waits, never guesses.** :meth:`Channels.take` returns every chunk written since the last
  take, waiting for at least one when there is none; the end of the stream and a producer that
  failed are told apart, so a consumer never mistakes a failed producer for a finished one.

Why an actor: a running Serve call cannot be sent more input through its handle, and a handle
call cannot be routed to the replica that runs a given call. The ingress replica starts one
``Channels`` actor (no CPU, pinned to its own node) and passes its handle, with the key, in the
consumer's request; the consumer pulls from it. The actor dies with the ingress replica that owns
it, and with it every channel of that replica's requests, whose calls fail then anyway.

The same actor is where a stage call's flow-control window meets its caller's (:mod:`omni_serve.graph.flow`):
the ingress says what its walk took (:meth:`Channels.took`), a stage call that is a window ahead waits
for it (:meth:`Channels.wait_taken`), and either end forgets it when its side of the call ends.

**A closed key stays closed.** Most calls here are told, not asked (:func:`tell`: a close, a window's
report), and Ray runs an async actor's calls in no guaranteed order, even one caller's ("Actor Task
Execution Order" in Ray's docs: only a synchronous, single-threaded actor keeps a submitter's order).
A report that overtook nothing could still run after its call's close and make the window again, or a
channel's first write after its close (a client that left while the first chunk was written) open a
channel nobody would close: a leak of the key and, for a channel, of its chunk. So each close is
remembered for :data:`CLOSED_KEYS_S`, and a late write, report or wait on a remembered key finds it
closed. The memory is bounded by the calls that close in that time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from omni_serve.exceptions import ChunksLost, ProducerFailed

# Chunks one channel holds unread before a write waits for the consumer (thinker -> talker: one
# chunk per thinker stream item, a token's rows for the first 8, then 50 ms of them, 100, 200 and at
# most 400 ms (omni_serve.graph.coalesce), about 27 tokens at 15 ms a token; the real model's rows are
# 2 x 2048 bf16 values, 8 KiB a token, so a chunk holds at most about 216 KiB and 64 of them about
# 14 MiB a request, more than any whole reply of the 100-300 tokens Qwen3-Omni speaks: a slow consumer
# holds at most its request's reply here).
MAX_BUFFERED_CHUNKS = 64
# And bytes (the chunks' payloads, which the object store holds for the ingress): about 1000 of those rows.
MAX_BUFFERED_CHUNK_BYTES = 8 << 20
# How long a closed channel's or window's key stays closed to late calls (the module docstring). Late means
# behind in one actor's queue, milliseconds; a minute of closes is about 100 bytes a call.
CLOSED_KEYS_S = 60.0


class _Channel:
    def __init__(self) -> None:
        self.items: list[Any] = []
        self.unread_bytes = 0  # the payload bytes of ``items``
        self.taken: list[Any] = []  # taken before the consumer's first output: kept for a retry
        self.taken_bytes = 0
        self.acked = False
        self.reader = 0  # who may take: the latest attempt of the consumer call (Channels.rewind)
        self.ended = False
        self.failed: str | None = None
        self.closed = False
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()


class _Window:
    """What the caller of one stage call has taken so far (stream items, bytes); :mod:`omni_serve.graph.flow`."""

    def __init__(self) -> None:
        self.items = 0
        self.bytes = 0
        self.closed = False
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class _ClosedKeys:
    """Keys closed in the last :data:`CLOSED_KEYS_S` (oldest first, forgotten as they age)."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def add(self, key: str) -> None:
        now = time.monotonic()
        self._at.pop(key, None)
        self._at[key] = now  # the newest, last: the scan below stops at it at the latest
        expired = [old for old, _ in itertools.takewhile(lambda kv: kv[1] < now - CLOSED_KEYS_S, self._at.items())]
        for old in expired:
            del self._at[old]

    def __contains__(self, key: str) -> bool:
        return key in self._at

    def __len__(self) -> int:
        return len(self._at)


class Channels:
    """The channels of one ingress replica's streamed calls (a Ray actor: see the module docstring).

    All methods run on one event loop (an async actor, or the caller's loop in process): no locks.
    """

    def __init__(self) -> None:
        self._channels: dict[str, _Channel] = {}
        self._windows: dict[str, _Window] = {}
        self._closed_channels = _ClosedKeys()  # a late call on one finds it closed (the module docstring)
        self._closed_windows = _ClosedKeys()

    async def write(
        self,
        key: str,
        items: list[Any],
        *,
        nbytes: int = 0,
        first: bool = False,
        end: bool = False,
        failed: str | None = None,
    ) -> bool:
        """Add ``items`` (refs, nested so they stay unresolved, of ``nbytes`` payload bytes); ``end``/``failed``
        end the stream.

        ``first`` opens the channel (the call's first chunk). Returns False when the consumer is gone
        (its call ended and closed the channel: the writer stops); waits while the channel is full.
        """
        if first and key not in self._closed_channels:
            self._channels[key] = _Channel()
        channel = self._channels.get(key)
        if channel is None or channel.closed:
            return False
        channel.items.extend(items)
        channel.unread_bytes += nbytes
        channel.ended |= end or failed is not None
        channel.failed = channel.failed or failed
        channel.notify()
        await channel.wait_for(
            lambda: (
                channel.closed
                or (len(channel.items) < MAX_BUFFERED_CHUNKS and channel.unread_bytes < MAX_BUFFERED_CHUNK_BYTES)
            )
        )
        return not channel.closed

    async def take(self, key: str, reader: int = 0) -> tuple[list[Any], bool]:
        """Every chunk written since the last take (at least one unless the stream ended), and whether it ended.

        ``reader`` is the consumer attempt's number (0, then what :meth:`rewind` returned): an earlier one's take fails.
        """
        channel = self._channels.get(key)
        if channel is None:
            raise ProducerFailed("the channel is closed")
        await channel.wait_for(
            lambda: bool(channel.items) or channel.ended or channel.closed or channel.reader != reader
        )
        if channel.reader != reader:
            raise ChunksLost(f"reader {reader} of the channel was replaced by a retry (reader {channel.reader})")
        if channel.failed is not None or channel.closed:
            raise ProducerFailed(channel.failed or "the channel is closed")
        items, channel.items = channel.items, []
        if not channel.acked:
            channel.taken.extend(items)
            channel.taken_bytes += channel.unread_bytes
        channel.unread_bytes = 0
        channel.notify()
        return items, channel.ended

    def ack(self, key: str) -> None:
        """The consumer produced its first output: what it took is freed, and it will not be retried."""
        channel = self._channels.get(key)
        if channel is not None:
            channel.acked, channel.taken, channel.taken_bytes = True, [], 0

    def rewind(self, key: str) -> int | None:
        """The consumer's replica died before its first output: its retry reads every chunk again, as a new reader.

        Returns the retry's reader number (for its takes); None when a retry is no longer possible (the
        consumer had produced output, or its channel is gone).
        """
        channel = self._channels.get(key)
        if channel is None or channel.acked:
            return None
        channel.items, channel.taken = channel.taken + channel.items, []
        channel.unread_bytes, channel.taken_bytes = channel.unread_bytes + channel.taken_bytes, 0
        channel.reader += 1  # a take the dead attempt still has on its way here fails, and wakes now
        channel.notify()
        return channel.reader

    def close(self, key: str) -> None:
        """The consumer call ended: drop what it did not take, and tell a waiting writer to stop."""
        self._closed_channels.add(key)
        channel = self._channels.pop(key, None)
        if channel is not None:
            channel.closed = True
            channel.items, channel.unread_bytes = [], 0
            channel.notify()

    def open_channels(self) -> int:
        """Channels not closed yet (tests: every call's channel is closed when the call ends)."""
        return len(self._channels)

    # ---- flow-control windows (omni_serve.graph.flow) ------------------------------------------------

    def took(self, key: str, items: int, nbytes: int) -> None:
        """The caller's walk has taken ``items`` stream items and ``nbytes`` of the call ``key`` so far."""
        if key in self._closed_windows:
            return
        window = self._windows.setdefault(key, _Window())
        window.items, window.bytes = max(window.items, items), max(window.bytes, nbytes)
        window.notify()

    async def wait_taken(self, key: str, items: int, nbytes: int) -> tuple[int, int] | None:
        """Once the caller has taken at least ``items`` and ``nbytes``: what it has taken; None if the window closed."""
        if key in self._closed_windows:
            return None
        window = self._windows.setdefault(key, _Window())
        while not window.closed and (window.items < items or window.bytes < nbytes):
            await window._changed.wait()
        return None if window.closed else (window.items, window.bytes)

    def close_window(self, key: str) -> None:
        """One end of the call is done with the window: drop it, and let a stage waiting on it go.

        Each end closes once its side of the call ended, and only if it ever used the window; the other
        end's later reports and waits find it closed (a stage stops waiting: its caller is gone or done).
        """
        self._closed_windows.add(key)
        window = self._windows.pop(key, None)
        if window is not None:
            window.closed = True
            window.notify()

    def open_windows(self) -> int:
        """Windows not closed yet (tests: none is left when a request's calls have ended)."""
        return len(self._windows)


async def ask(channels: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``method`` of ``channels`` (the actor, or a :class:`Channels` in this process) and wait for its answer."""
    if isinstance(channels, Channels):
        result = getattr(channels, method)(*args, **kwargs)
        return await result if asyncio.iscoroutine(result) else result
    return await getattr(channels, method).remote(*args, **kwargs)


def tell(channels: Any, method: str, *args: Any) -> None:
    """Call ``method`` of ``channels`` without waiting (in no guaranteed order with this caller's other calls:
    a closed key stays closed, the module docstring)."""
    if isinstance(channels, Channels):
        getattr(channels, method)(*args)
    else:
        getattr(channels, method).remote(*args)


@dataclasses.dataclass
class ChannelReader:
    """What a streamed call's request carries instead of a handoff: where to pull its chunks from."""

    channels: Any  # a ray ActorHandle of Channels, or a Channels in this process
    key: str
    reader: int = 0  # which attempt of the consumer call reads (Channels.rewind)

    async def chunks(self) -> AsyncGenerator[Any, None]:
        """The chunks in order (``ObjectRef`` for a remote channel), until the producer's end.

        Each leaves this frame as it is yielded: the consumer's copy is its only holder (a failed take's
        traceback keeps this frame, and must keep no chunk). A stream that ends before its first chunk
        raises :class:`ChunksLost`.
        """
        first = True
        while True:
            items, ended = await ask(self.channels, "take", self.key, self.reader)
            if first and not items:
                raise ChunksLost("the stream ended before its first chunk reached this call")
            first = False
            while items:
                yield items.pop(0)
            if ended:
                return
