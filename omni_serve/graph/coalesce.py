"""Coalescing a stage call's text deltas into fewer stream items, more of them merged as load rises.

Every item a stage yields costs a Ray object, an RPC to the ingress, a wake-up of the ingress,
an SSE event and a message to Serve's proxy (README, "Where the time goes"). A fast text stage
yields one delta per token, so under load the serving path, not the engine, sets the pace.
:func:`coalesced` merges consecutive text deltas of one call while its previous item is younger
than ``interval()``: the stage passes ``min(per-call interval x calls in flight, cap)``, so one
call on a slow model sends every delta as it comes, and a busy replica sends each call's text in
a few larger pieces. The stream's content is unchanged: the merged item's text, token ids, logprobs
and tool-call pieces are the deltas' concatenation, in order.

Never merged, never held: the first output (time to first token), the final output (it flushes
what is held), and any output with audio, images or a handoff (audio chunks are self-contained
files, and a handoff must stay one item), except the chunks of a streamed handoff when the engine
says how to join two (``StageEngine.merge_handoffs``: the thinker's rows), so a fast thinker sends
its rows, like its text, in fewer and larger items under load. Nothing waits on a timer: held text goes out with the
next engine output after the interval, so text is never later than one engine step past it.

A streamed handoff's chunks are merged whatever the load once its first :data:`EAGER_HANDOFF_OUTPUTS`
outputs are out: the first chunk after those at least the stage's cap (``handoff_interval``) after the
one before, and each later one twice as long as the last, up to :data:`HANDOFF_STRETCH` times the cap.
Each chunk costs a stream item for its payload, a channel write in the ingress and a fetch by the
consumer, on top of the text item; and only the first ones are latency-critical: a talker's first
codec chunk needs the reply's first few rows (its initial chunk frames + 1: 2 in ``tiny_omni.yaml``, 5
in the vLLM-Omni graphs). Later rows can wait longer the more were sent: each row is one codec frame,
80 ms of audio, so a talker fed 8 rows and then 50, 100 and 200 ms of them (some 30 rows at 15 ms a
token) holds over 2 s of audio when the wait reaches 400 ms. A 256-token reply then travels in about
35 chunks instead of about 200. On the 2-core machine, 8 concurrent 256-token replies (unpaced, one
replica a stage, rounds interleaved): streamed / whole throughput 0.89-0.91 x with every chunk 50 ms
apart, 1.00 x with 200 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from omni_serve.models.tool_calls import merge_deltas
from omni_serve.types import StageOutput

# Joins two consecutive handoff chunks of one streamed handoff into one (the engine family's
# ``merge_handoffs``); None: the family's handoffs are never merged.
MergeHandoffs = Callable[[Any, Any], Any] | None

# The outputs of a streamed handoff sent as the load allows before handoff_interval applies (module doc).
EAGER_HANDOFF_OUTPUTS = 8
# After those, the interval between a streamed handoff's chunks doubles per chunk, up to this many times
# handoff_interval (module doc): 50 ms -> 400 ms at the default max_coalesce_ms.
HANDOFF_STRETCH = 8


def mergeable(output: StageOutput, merge_handoffs: MergeHandoffs = None) -> bool:
    """Plain text progress: no audio, images, video, progress report, final status or prompt report, and no
    handoff unless the engine can merge its handoff chunks (a streamed handoff's rows)."""
    return (
        not output.finished
        and output.audio is None
        and not output.images
        and output.video is None
        and output.progress is None
        and (output.handoff is None or merge_handoffs is not None)
        and output.prompt_text is None
    )


def merged(held: StageOutput, later: StageOutput, merge_handoffs: MergeHandoffs = None) -> StageOutput:
    """``held`` followed by ``later`` as one output (``later`` carries any final status, audio or handoff,
    and the usage so far, which counts ``held``'s tokens too)."""
    later.text = held.text + later.text
    later.token_ids = held.token_ids + later.token_ids
    if held.logprobs is not None:
        later.logprobs = held.logprobs + (later.logprobs or [])
    if held.tool_calls:
        later.tool_calls = merge_deltas(held.tool_calls, later.tool_calls)
    if held.handoff is not None:  # held only when the engine merges its chunks (mergeable)
        if later.handoff is None:
            later.handoff = held.handoff
        elif merge_handoffs is not None:
            later.handoff = merge_handoffs(held.handoff, later.handoff)
    return later


async def coalesced(
    outputs: AsyncIterator[StageOutput],
    interval: Callable[[], float],
    clock: Callable[[], float] = time.monotonic,
    merge_handoffs: MergeHandoffs = None,
    handoff_interval: float = 0.0,
) -> AsyncGenerator[StageOutput, None]:
    """``outputs`` with consecutive text deltas (and handoff chunks the engine can merge) merged while the
    previous item is younger than ``interval()`` s; for a streamed handoff (``merge_handoffs``), once its
    first :data:`EAGER_HANDOFF_OUTPUTS` are sent, at least ``handoff_interval`` s, doubling per item sent
    up to :data:`HANDOFF_STRETCH` times that."""
    held: StageOutput | None = None
    sent_at: float | None = None  # None: nothing sent yet, the first output goes at once
    sent = 0
    async for output in outputs:
        if held is not None:
            output = merged(held, output, merge_handoffs)
            held = None
        now = clock()
        if sent_at is not None and mergeable(output, merge_handoffs):
            wait = interval()
            if merge_handoffs is not None and sent >= EAGER_HANDOFF_OUTPUTS:
                stretch = min(2 ** (sent - EAGER_HANDOFF_OUTPUTS), HANDOFF_STRETCH)
                wait = max(wait, handoff_interval * stretch)
            if now - sent_at < wait:
                held = output
                continue
        sent_at = now
        sent += 1
        yield output
    if held is not None:  # the engine ended without a final output: the caller treats that as a failure
        yield held
