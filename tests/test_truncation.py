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

import numpy as np
import pytest

from omni_serve.api.openai.chat import FINISH_REASON_HEADER, ChatReply
from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.speech import SpeechReply
from omni_serve.api.openai.transcriptions import TranscriptionReply
from omni_serve.api.realtime.session import Session
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.stage_log import StageLog
from omni_serve.types import FinishReason, Modality, StageOutput
from tests.fake_stages import GRAPH, FakeStages, request
from tests.realtime_session import graph as graph
from tests.realtime_session import recorder as recorder
from tests.realtime_session import settle


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


@pytest.mark.parametrize("length, finish", [(None, "stop"), ("talker", "length")])
def test_speech_says_how_it_ended_in_its_header_decided_at_the_talkers_end(length: str | None, finish: str) -> None:
    """The serving template's order: the status line waits for the output that decides it, then the headers."""

    async def reply() -> tuple[list[StageOutput], dict[str, str], list[bytes]]:
        log, outputs = run_graph(length, Modality.AUDIO)
        speech, head = SpeechReply("wav", log), []
        async for output in outputs:
            head.append(output)
            if speech.decides_status(output):
                assert log.done("talker"), "the status was decided before the talker's end"
                break
        headers = speech.headers(head)

        async def rest() -> AsyncIterator[StageOutput]:
            for output in head:
                yield output
            async for output in outputs:
                yield output

        return head, headers, [piece async for piece in speech.stream(rest())]

    head, headers, body = asyncio.run(reply())
    assert headers == {FINISH_REASON_HEADER: finish}
    assert body[0][:4] == b"RIFF" and len(body) > 1  # the whole file, its audio and the encoder's end


def test_speech_cut_after_its_status_line_is_never_a_whole_file() -> None:
    """A stage that stops at its max_tokens after the header said "stop" (the audio stage's own) fails the
    reply: no encoder end, and the template cuts the body short (SpeechReply.in_band_error is None)."""
    log = StageLog(GRAPH)
    speech = SpeechReply("wav", log)
    assert speech.headers([]) == {FINISH_REASON_HEADER: "stop"}
    audio = StageOutput("code2wav", audio=np.zeros(480, np.float32), sample_rate=24000, finished=True)

    async def outputs() -> AsyncIterator[StageOutput]:
        yield audio
        log.saw("code2wav", StageOutput("code2wav", finished=True, finish_reason=FinishReason.LENGTH))

    async def body() -> tuple[list[bytes], APIError | None]:
        pieces: list[bytes] = []
        try:
            async for piece in speech.stream(outputs()):
                pieces.append(piece)
        except APIError as err:
            return pieces, err
        return pieces, None

    pieces, error = asyncio.run(body())
    assert error is not None and error.code == "output_truncated" and speech.in_band_error(error) is None
    assert len(pieces) == 1  # the header and the audio; not the end


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
