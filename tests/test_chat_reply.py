"""The chat reply's SSE stream (omni_serve.api.openai.chat.ChatReply), built in process from stage outputs.

``stream_options`` as vLLM reads it (``should_include_usage`` in vLLM 0.30's serving code):
``include_usage`` adds a last chunk with the request's usage; ``continuous_usage_stats`` adds the
usage so far to every chunk, and only together with ``include_usage``. Each chunk is read back with
the official ``openai`` client's chunk model, as its streaming reads it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from openai.types.chat import ChatCompletionChunk
from pydantic import ValidationError

from omni_serve.api.openai.chat import ChatCompletionRequest, ChatReply, StreamOptions
from omni_serve.api.openai.errors import from_validation
from omni_serve.types import FinishReason, Modality, StageOutput, Usage

PROMPT = 11


def thinker_talker_outputs() -> list[StageOutput]:
    """A text stage's deltas (usage so far on each, the total on the finished one) with audio after the first."""

    def text(s: str, ids: list[int], so_far: int, **final: Any) -> StageOutput:
        return StageOutput("thinker", text=s, token_ids=ids, usage=Usage(PROMPT, so_far), **final)

    audio = StageOutput("code2wav", audio=np.zeros(240, dtype=np.float32), sample_rate=24000)
    return [
        text("Hel", [1], 1),
        audio,
        text("lo", [2, 3], 3),  # two tokens in one (coalesced) delta
        text("!", [4], 4, finished=True, finish_reason=FinishReason.STOP),
        StageOutput("code2wav", audio=np.zeros(240, dtype=np.float32), sample_rate=24000, finished=True),
    ]


def stream(options: dict[str, Any] | None, outputs: list[StageOutput], modalities: set[Modality]) -> list[str]:
    stream_options = StreamOptions.model_validate(options or {})
    reply = ChatReply(
        "r1",
        "tiny",
        modalities,
        "wav",
        "thinker",
        include_usage=stream_options.include_usage,
        usage_on_every_chunk=stream_options.usage_on_every_chunk,
    )

    async def items() -> AsyncIterator[StageOutput]:
        for output in outputs:
            yield output

    async def collect() -> list[str]:
        return [event async for event in reply.stream(items())]

    events = asyncio.run(collect())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    return [e.removeprefix("data: ").strip() for e in events[:-1]]


def chunks(events: list[str]) -> list[ChatCompletionChunk]:
    return [ChatCompletionChunk.model_validate(json.loads(e)) for e in events]


def test_continuous_usage_puts_the_usage_so_far_on_every_chunk() -> None:
    events = stream(
        {"include_usage": True, "continuous_usage_stats": True},
        thinker_talker_outputs(),
        {Modality.TEXT, Modality.AUDIO},
    )
    parsed = chunks(events)
    assert all(c.usage is not None for c in parsed)
    counts = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in parsed]
    kinds = [
        "usage" if not c.choices else "finish" if c.choices[0].finish_reason else json.loads(e).get("modality", "role")
        for c, e in zip(parsed, events, strict=True)
    ]
    # As vLLM: the role chunk counts the prompt and nothing generated; each chunk after it the tokens
    # generated up to and including its own delta (an audio chunk: the text stage's count so far).
    assert list(zip(kinds, counts, strict=True)) == [
        ("role", (PROMPT, 0, PROMPT)),
        ("text", (PROMPT, 1, PROMPT + 1)),
        ("audio", (PROMPT, 1, PROMPT + 1)),
        ("text", (PROMPT, 3, PROMPT + 3)),
        ("text", (PROMPT, 4, PROMPT + 4)),
        ("audio", (PROMPT, 4, PROMPT + 4)),
        ("finish", (PROMPT, 4, PROMPT + 4)),
        ("usage", (PROMPT, 4, PROMPT + 4)),  # include_usage's last chunk, choices []
    ]
    assert parsed[-1].choices == [] and parsed[-2].choices[0].finish_reason == "stop"


def test_audio_only_carries_the_transcripts_count() -> None:
    events = stream({"include_usage": True, "continuous_usage_stats": True}, thinker_talker_outputs(), {Modality.AUDIO})
    transcript = [json.loads(e) for e in events if "transcript" in e]
    assert [t["usage"]["completion_tokens"] for t in transcript] == [1, 3, 4]


@pytest.mark.parametrize(
    "options",
    [None, {}, {"continuous_usage_stats": True}, {"include_usage": False, "continuous_usage_stats": True}],
    ids=["absent", "empty", "continuous alone", "continuous without usage"],
)
def test_no_usage_anywhere_without_include_usage(options: dict[str, Any] | None) -> None:
    """vLLM's rule: continuous_usage_stats alone is accepted and changes nothing."""
    events = stream(options, thinker_talker_outputs(), {Modality.TEXT, Modality.AUDIO})
    assert not any("usage" in json.loads(e) for e in events)


def test_include_usage_alone_adds_only_the_last_chunk() -> None:
    events = stream({"include_usage": True}, thinker_talker_outputs(), {Modality.TEXT})
    with_usage = [i for i, e in enumerate(events) if "usage" in json.loads(e)]
    assert with_usage == [len(events) - 1]
    last = chunks(events)[-1]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (PROMPT, 4)


def test_a_graph_without_a_text_stage_counts_nothing() -> None:
    outputs = [StageOutput("code2wav", audio=np.zeros(240, dtype=np.float32), sample_rate=24000, finished=True)]
    events = stream({"include_usage": True, "continuous_usage_stats": True}, outputs, {Modality.AUDIO})
    assert {(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks(events)} == {(0, 0)}


def request_error(stream_options: Any) -> tuple[str | None, str]:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": stream_options}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    error = from_validation(caught.value)
    assert error.status == 400
    return error.param, error.message


def test_stream_options_accepts_vllms_fields_and_names_any_other() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = ChatCompletionRequest.model_validate({**body, "stream_options": options})
    assert request.stream_options is not None and request.stream_options.usage_on_every_chunk
    # The misspelling vLLM-Omni's benchmark source warns about: refused, by name.
    param, message = request_error({"include_usage": True, "include_continuous_usage": True})
    assert param == "stream_options.include_continuous_usage" and "unknown field" in message
    param, _ = request_error({"continuous_usage_stats": "yes please"})
    assert param == "stream_options.continuous_usage_stats"
