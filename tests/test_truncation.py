"""A stage that stops at its ``max_tokens`` is never reported as a complete reply, on any route (in process:
the real Orchestrator and replies over fake stages, no Ray).

The talker's outputs never reach a reply (it hands codec chunks to code2wav), so its finish reaches the
replies through the request's stage log, where the orchestrator records every stage's outputs. Chat:
``finish_reason: "length"``; realtime: ``response.done`` ``incomplete`` (``max_output_tokens``); speech:
no whole file (an error before the status line, else the body cut short); transcriptions (the thinker
alone): ``finish_reason`` in every format, the ``text`` format's in a header. The same against the
deployed tiny graph: tests/test_truncation_live.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omni_serve.api.openai.chat import ChatReply
from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.speech import SpeechReply
from omni_serve.api.openai.transcriptions import FINISH_REASON_HEADER, TranscriptionReply
from omni_serve.api.realtime.session import Session
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.stage_log import StageLog
from omni_serve.types import FinishReason, Modality, StageOutput
from tests.test_orchestrator import GRAPH, FakeStages, request
from tests.test_realtime_session import graph, recorder, settle


def run_graph(length: str | None, *modalities: Modality) -> tuple[StageLog, AsyncIterator[StageOutput]]:
    """The orchestrator's outputs for one request, the stage ``length`` (if any) stopping at its max_tokens."""
    omni = request(*modalities)
    omni.stage_log = log = StageLog(GRAPH)
    return log, Orchestrator(GRAPH, FakeStages(chunks=3, length=length)).run(omni)


def chat_reply(log: StageLog) -> ChatReply:
    return ChatReply("r1", "fake", {Modality.TEXT, Modality.AUDIO}, "wav", "thinker", stage_log=log)


@pytest.mark.parametrize("length, finish", [(None, "stop"), ("talker", "length"), ("thinker", "length")])
def test_chat_says_length_when_any_stage_stopped_at_its_max_tokens(length: str | None, finish: str) -> None:
    async def whole() -> dict[str, Any]:
        log, outputs = run_graph(length, Modality.TEXT, Modality.AUDIO)
        return await chat_reply(log).json(outputs)

    async def streamed() -> list[dict[str, Any]]:
        log, outputs = run_graph(length, Modality.TEXT, Modality.AUDIO)
        events = [e async for e in chat_reply(log).stream(outputs)]
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]

    body = asyncio.run(whole())
    assert body["choices"][0]["finish_reason"] == finish
    assert body["choices"][0]["message"]["audio"]["data"]  # the audio there is, still sent
    finishes = [c["choices"][0]["finish_reason"] for c in asyncio.run(streamed()) if c["choices"][0]["finish_reason"]]
    assert finishes == [finish]


def test_speech_cut_short_is_never_a_whole_file() -> None:
    async def body(length: str | None) -> tuple[list[bytes], BaseException | None]:
        log, outputs = run_graph(length, Modality.AUDIO)
        reply, pieces = SpeechReply("wav", log), []
        try:
            async for piece in reply.stream(outputs):
                pieces.append(piece)
        except APIError as err:
            return pieces, err
        return pieces, None

    whole, error = asyncio.run(body(None))
    assert error is None and whole[0][:4] == b"RIFF"
    cut, error = asyncio.run(body("talker"))
    assert isinstance(error, APIError) and error.code == "output_truncated" and "talker" in error.message
    # Every chunk of audio made it out, but not the encoder's end: the serving template cuts the body there.
    assert cut == whole[: len(cut)] and len(cut) < len(whole)


def test_speech_known_cut_before_the_status_line_is_an_error_status() -> None:
    log = StageLog(GRAPH)
    log.saw("talker", StageOutput("talker", finished=True, finish_reason=FinishReason.LENGTH))
    with pytest.raises(APIError) as info:
        SpeechReply("mp3", log).headers([])
    assert info.value.status == 500 and info.value.code == "output_truncated"


def thinker_outputs(reason: FinishReason) -> list[StageOutput]:
    last = StageOutput("thinker", text="world", finished=True, finish_reason=reason)
    return [StageOutput("thinker", text="hello "), last]


async def items(outputs: list[StageOutput]) -> AsyncIterator[StageOutput]:
    for output in outputs:
        yield output


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.LENGTH])
def test_transcriptions_say_how_the_transcript_ended_in_every_format(reason: FinishReason) -> None:
    outputs = thinker_outputs(reason)
    for fmt in ("json", "verbose_json"):
        body = asyncio.run(TranscriptionReply(fmt, False, "thinker").json(items(outputs)))  # type: ignore[arg-type]
        assert body["text"] == "hello world" and body["finish_reason"] == reason.value
    text = TranscriptionReply("text", False, "thinker")
    # The bare text: its status line (and header) waits for the transcript's end.
    assert [text.decides_status(o) for o in outputs] == [False, True]
    assert text.headers(outputs) == {FINISH_REASON_HEADER: reason.value}

    async def sse() -> list[dict[str, Any]]:
        reply = TranscriptionReply("json", True, "thinker")
        return [json.loads(e.removeprefix("data: ")) async for e in reply.stream(items(outputs))]

    done = asyncio.run(sse())[-1]
    assert done["type"] == "transcript.text.done" and done["finish_reason"] == reason.value


@pytest.mark.parametrize("length, status", [(None, "completed"), ("talker", "incomplete"), ("thinker", "incomplete")])
def test_a_realtime_response_cut_short_is_incomplete(length: str | None, status: str) -> None:
    """``outputs`` plays the orchestrator over fake stages, recording into the response's stage log."""

    async def outputs(omni: Any, route: str) -> AsyncIterator[StageOutput]:
        async for output in Orchestrator(GRAPH, FakeStages(chunks=2, length=length)).run(omni):
            yield output

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(outputs, speaks=True, sampling=lambda body: request().sampling), send)
        await session.handle(json.dumps({"type": "response.create", "response": {"output_modalities": ["audio"]}}))
        await settle(session)
        return events

    (done,) = [e["response"] for e in asyncio.run(run()) if e["type"] == "response.done"]
    assert done["status"] == status
    if status == "incomplete":
        assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
