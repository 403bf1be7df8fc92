"""Flow control: what one request may hold in the ingress, in bytes, and how a reader that stops holds back its stages.

An output travels stage replica -> Ray's stream buffer in the ingress -> the walk's queues -> the
client. Every hop has a bound, and a full hop stops the one before it, up to the engines:

- **The walk's queues** (:class:`Buffers`). The outputs a request's walk holds for its client (the
  relay queue of each stage call that starts downstream calls, and one queue per downstream call in
  flight) share one budget, the graph's ``request_buffer_bytes``. A put waits while the budget is
  spent or the queue holds :data:`MAX_QUEUED_OUTPUTS`, except into an empty queue: an output larger
  than the whole budget still passes, alone, and no queue ever waits for bytes another queue holds,
  so the walk cannot deadlock on its own budget. A request's walk thus holds at most
  ``request_buffer_bytes`` plus one output per queue.
- **A stage call's window** (:class:`Window`). Ray Serve 2.60 gives a streaming handle call no
  backpressure: the replica runs its generator on a loop of its own and queues what it yields
  without bound (``replica.py``: ``call_user_generator``'s ``MessageQueue``), and the handle's
  streaming call never sets Ray's ``_generator_backpressure_num_objects``
  (``request_router/replica_wrapper.py``); no upstream issue found. So a stage call counts what it
  sends, the ingress counts what its walk took, and the stage waits while it is
  :data:`WINDOW_ITEMS` stream items or :data:`WINDOW_BYTES` ahead (:class:`Sent`, :class:`Taken`).
  The counts meet in the ingress replica's ``Channels`` actor (:mod:`omni_serve.graph.channel`):
  the ingress tells it what it took every half window (a message it does not wait for), so a
  stage whose caller keeps up never waits, and one whose reader stopped waits there (one call)
  until it reads again or its call is cancelled.
- **Engines.** A stage that waits stops pulling its engine's outputs. The transformers family's
  job then waits too, a few outputs ahead (``engines/transformers/worker.py``); the vLLM families cannot
  pause one request of a batch (vLLM has no such call), so their engine request runs on to its
  ``max_tokens`` while the stage holds the outputs (vLLM's output collector merges them).

Byte sizes are :func:`output_bytes`: what an output's arrays and text hold, its handoff payload's
arrays (``StageOutput.handoff_bytes``, set by the producing stage: the ingress never opens a
payload), plus :data:`OUTPUT_OVERHEAD_BYTES` for the object itself, so a flood of empty outputs
counts too.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Any, Generic, TypeVar

from omni_serve.graph.channel import ask, tell
from omni_serve.types import StageOutput

logger = logging.getLogger("ray.serve")

# Outputs one queue of a request's walk holds (and bytes: Buffers) before a put waits.
MAX_QUEUED_OUTPUTS = 16
# An output's own Python objects (the dataclass, its lists, the numpy headers), counted on top of its arrays.
OUTPUT_OVERHEAD_BYTES = 512
# What a stage call may send ahead of what its request's walk took: stream items (an output, and its
# handoff payload when it carries one, are two) and bytes. At 2 items a codec chunk, a talker runs at
# most 8 chunks ahead of the code2wav calls its request can start; 1 MiB is about 5 of the real
# code2wav's 2 s audio chunks (192 KB) or 128 of the thinker's 8 KiB rows.
WINDOW_ITEMS = 16
WINDOW_BYTES = 1 << 20


def output_bytes(output: StageOutput) -> int:
    """The bytes ``output`` holds where it waits (with its handoff payload's, which travels beside it)."""
    size = OUTPUT_OVERHEAD_BYTES + len(output.text.encode()) + 8 * len(output.token_ids) + output.handoff_bytes
    if output.audio is not None:
        size += output.audio.nbytes
    size += sum(image.nbytes for image in output.images)
    if output.prompt_text:
        size += len(output.prompt_text.encode())
    return size


# --- the walk's queues -----------------------------------------------------------------------------

T = TypeVar("T")


class Buffers:
    """One request's budget for the outputs its walk holds; :meth:`queue` makes a queue drawing on it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # bytes in all of this request's queues
        self.peak = 0  # the most they held at once (tests and the README's figures)
        self._changed = asyncio.Condition()
        self._queues: list[Buffer[Any]] = []

    def queue(self) -> Buffer[Any]:
        queue: Buffer[Any] = Buffer(self)
        self._queues.append(queue)
        return queue

    def clear(self) -> None:
        """The request ended: drop whatever its queues still hold (an audio array there pins its stream
        item in the object store, and a cancelled walk's tasks and frames may keep the queues alive until
        Python's cycle collector runs)."""
        for queue in self._queues:
            queue._items.clear()
        self._queues.clear()
        self.held = 0


class Buffer(Generic[T]):
    """A FIFO of outputs (and the walk's end and failure markers, which cost nothing and never wait) on a budget."""

    def __init__(self, buffers: Buffers):
        self._buffers = buffers
        self._items: collections.deque[tuple[T, int]] = collections.deque()

    async def put(self, item: T) -> None:
        """Add ``item``; waits while the request's budget is spent, unless this queue is empty."""
        size = output_bytes(item) if isinstance(item, StageOutput) else 0
        buffers = self._buffers
        async with buffers._changed:
            await buffers._changed.wait_for(
                lambda: (
                    not size
                    or not self._items
                    or (buffers.held + size <= buffers.limit and len(self._items) < MAX_QUEUED_OUTPUTS)
                )
            )
            self._items.append((item, size))
            buffers.held += size
            buffers.peak = max(buffers.peak, buffers.held)
            buffers._changed.notify_all()

    async def get(self) -> T:
        buffers = self._buffers
        async with buffers._changed:
            await buffers._changed.wait_for(lambda: bool(self._items))
            item, size = self._items.popleft()
            buffers.held -= size
            buffers._changed.notify_all()
        return item


# --- a stage call's window ----------------------------------------------------------------------------


@dataclasses.dataclass
class Window:
    """What a stage call's request carries so the call can wait for its caller: where the counts meet."""

    channels: Any  # a ray ActorHandle of Channels, or a Channels in this process
    key: str  # the call's engine request id (unique per call and attempt)


class Sent:
    """The stage side of a call's window: :meth:`admit` each output before yielding it."""

    def __init__(self, window: Window | None):
        self.window = window
        self.items = self.bytes = 0
        self._taken = (0, 0)  # what the caller had taken when it last said
        self._asked = False

    async def admit(self, items: int, nbytes: int) -> None:
        """Wait until the caller is less than a window behind, then count these ``items`` of ``nbytes``."""
        window = self.window
        if window is not None and not self._fits():
            self._asked = True
            least = (self.items - WINDOW_ITEMS + 1, self.bytes - WINDOW_BYTES + 1)
            try:
                taken = await ask(window.channels, "wait_taken", window.key, *least)
            except Exception:  # the channels actor is gone, and with it the caller's replica (or soon)
                logger.warning("call %s: its window's channels actor is gone; not waiting for it", window.key)
                taken = None
            if taken is None:  # the caller ended the call (it is being cancelled): stop waiting for it
                self.window = None
            else:
                self._taken = taken
        self.items += items
        self.bytes += nbytes

    def _fits(self) -> bool:
        items, nbytes = self._taken
        return self.items - items < WINDOW_ITEMS and self.bytes - nbytes < WINDOW_BYTES

    def close(self) -> None:
        """The call ended: the window's state in the channels actor goes (only if this call ever asked)."""
        if self.window is not None and self._asked:
            tell(self.window.channels, "close_window", self.window.key)
        self.window = None


class Taken:
    """The caller's side of a call's window: :meth:`took` each output once the walk is done with it."""

    def __init__(self, window: Window | None):
        self.window = window
        self.items = self.bytes = 0
        self._told = (0, 0)

    def took(self, items: int, nbytes: int) -> None:
        self.items += items
        self.bytes += nbytes
        told_items, told_bytes = self._told
        # Every half window: a stage that waits has sent a whole one, so it hears before the walk runs dry.
        if self.window is not None and (
            self.items - told_items >= WINDOW_ITEMS // 2 or self.bytes - told_bytes >= WINDOW_BYTES // 2
        ):
            tell(self.window.channels, "took", self.window.key, self.items, self.bytes)
            self._told = (self.items, self.bytes)

    def close(self) -> None:
        """The call ended here: the window's state in the channels actor goes (only if it was ever told)."""
        if self.window is not None and self._told != (0, 0):
            tell(self.window.channels, "close_window", self.window.key)
        self.window = None
