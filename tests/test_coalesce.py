"""Coalescing a stage call's text deltas (omni_serve.graph.coalesce): same content, fewer items as the interval grows.

A fake clock stands in for time: each engine output arrives one "millisecond" after the last.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from omni_serve.graph.coalesce import EAGER_HANDOFF_OUTPUTS, HANDOFF_STRETCH, coalesced
from omni_serve.types import FinishReason, StageOutput, Usage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def engine(clock: Clock, outputs: list[StageOutput]) -> AsyncIterator[StageOutput]:
    for output in outputs:
        clock.now += 0.001  # one engine step
        yield output


def deltas(n: int) -> list[StageOutput]:
    """A text stage's outputs: one token each, each with the usage so far (the final's is the total)."""
    outputs = [
        StageOutput("llm", text=chr(65 + i), token_ids=[65 + i], usage=Usage(prompt_tokens=3, completion_tokens=i + 1))
        for i in range(n - 1)
    ]
    final = StageOutput("llm", text="!", token_ids=[33], finished=True, finish_reason=FinishReason.LENGTH)
    final.usage = Usage(prompt_tokens=3, completion_tokens=n)
    return [*outputs, final]


def run(outputs: list[StageOutput], interval_s: float) -> list[StageOutput]:
    clock = Clock()

    async def collect() -> list[StageOutput]:
        return [o async for o in coalesced(engine(clock, outputs), lambda: interval_s, clock)]

    return asyncio.run(collect())


def test_zero_interval_sends_every_delta() -> None:
    items = run(deltas(8), 0.0)
    assert [o.text for o in items] == ["A", "B", "C", "D", "E", "F", "G", "!"]


def test_items_fall_as_the_interval_grows_and_the_content_stays() -> None:
    counts = []
    for interval_s in (0.0, 0.0025, 0.005, 0.02, 1.0):
        items = run(deltas(32), interval_s)
        assert "".join(o.text for o in items) == "".join(o.text for o in deltas(32))
        assert [t for o in items for t in o.token_ids] == [t for o in deltas(32) for t in o.token_ids]
        assert items[-1].finished and items[-1].finish_reason is FinishReason.LENGTH
        assert items[-1].usage == Usage(prompt_tokens=3, completion_tokens=32)
        # A merged item's usage so far counts every token it carries and every one before it.
        sent = [len([t for o in items[: i + 1] for t in o.token_ids]) for i in range(len(items))]
        assert [o.usage.completion_tokens for o in items] == sent
        assert [o.finished for o in items].count(True) == 1
        assert items[0].text == "A"  # the first output is never held: time to first token
        counts.append(len(items))
    assert counts == sorted(counts, reverse=True) and counts[0] == 32 and counts[-1] == 2, counts


def test_a_held_delta_waits_at_most_until_the_next_output_after_the_interval() -> None:
    # 3 ms interval, outputs every 1 ms: A at once, then B+C+D together (D arrives 3 ms after A), ...
    assert [o.text for o in run(deltas(8), 0.003)] == ["A", "BCD", "EFG", "!"]


def test_audio_images_handoffs_and_prompt_reports_are_never_merged_into_each_other() -> None:
    audio = StageOutput("code2wav", audio=np.zeros(4, np.float32), sample_rate=24000)
    outputs = [
        StageOutput("thinker", text="a", prompt_text="<prompt>"),
        StageOutput("thinker", text="b"),
        StageOutput("thinker", text="c", handoff=object()),
        StageOutput("thinker", text="d"),
        audio,
        StageOutput("thinker", text="e"),
        StageOutput("thinker", images=[np.zeros((2, 2, 3), np.uint8)]),
        StageOutput("thinker", text="f", finished=True, finish_reason=FinishReason.STOP),
    ]
    items = run(outputs, 1.0)
    # Text held before a special output travels with it, in order; special outputs stay one item each.
    assert [o.text for o in items] == ["a", "bc", "d", "e", "f"]
    assert items[0].prompt_text == "<prompt>" and items[1].handoff is not None
    assert items[2].audio is not None and items[3].images and items[4].finished


def test_text_held_when_the_engine_stops_without_a_final_output_is_still_sent() -> None:
    outputs = [StageOutput("llm", text="x"), StageOutput("llm", text="y"), StageOutput("llm", text="z")]
    assert [o.text for o in run(outputs, 1.0)] == ["x", "yz"]


def test_a_streamed_handoffs_chunks_merge_when_the_engine_says_how() -> None:
    outputs = [
        StageOutput("thinker", text="a", handoff=[0]),
        StageOutput("thinker", text="b", handoff=[1]),
        StageOutput("thinker", text="c", handoff=[2]),
        StageOutput("thinker", text="d"),
        StageOutput("thinker", text="e", handoff=[3], finished=True, finish_reason=FinishReason.STOP),
    ]
    clock = Clock()

    async def collect() -> list[StageOutput]:
        joined = coalesced(engine(clock, outputs), lambda: 1.0, clock, merge_handoffs=lambda a, b: a + b)
        return [o async for o in joined]

    items = asyncio.run(collect())
    # The first goes at once; the rest are held and joined in order, text and chunks alike.
    assert [(o.text, o.handoff) for o in items] == [("a", [0]), ("bcde", [1, 2, 3])]


def test_a_streamed_handoff_is_merged_ever_longer_after_its_first_outputs_whatever_the_load() -> None:
    def sizes(merge: Any) -> list[int]:
        outputs = [StageOutput("thinker", text=f"{i} ", handoff=[i]) for i in range(140)]
        final = StageOutput("thinker", text="!", handoff=[140], finished=True, finish_reason=FinishReason.STOP)
        outputs.append(final)
        clock = Clock()

        async def collect() -> list[StageOutput]:
            # No load (interval 0), a 5 ms cap, an output every 1 ms.
            return [
                o async for o in coalesced(engine(clock, outputs), lambda: 0.0, clock, merge, handoff_interval=0.005)
            ]

        items = asyncio.run(collect())
        assert "".join(o.text for o in items) == " ".join(map(str, range(140))) + " !"  # nothing lost or reordered
        if merge:
            assert [i for o in items for i in o.handoff] == list(range(141))
        return [len(o.text.split()) for o in items]

    # The first EAGER_HANDOFF_OUTPUTS go one by one (a talker's first codec chunk waits on them), then
    # the chunks travel 5, 10, 20 ms apart, doubling up to HANDOFF_STRETCH x 5 ms = 40 ms; the final
    # output flushes what is held.
    assert HANDOFF_STRETCH == 8
    assert sizes(lambda a, b: a + b) == [1] * EAGER_HANDOFF_OUTPUTS + [5, 10, 20, 40, 40, 18]
    # Text without a streamed handoff (nothing to merge handoffs with) keeps the load's interval: every delta.
    assert sizes(None) == [1] * 141
