"""`POST /v1/audio/transcriptions`: the form fields, the thinker's turn that asks for a transcript, and the reply.

A transcription is a text-only graph request (the thinker alone: no talker, no code2wav) whose one
user turn is the audio, through the same media path as a chat request's ``input_audio``, and an
instruction to transcribe it. The realtime session's ``input_audio_transcription`` builds the same
turn (:func:`transcription_messages`).

Formats: ``json`` (``{"text", "usage"}``), ``text`` (the bare transcript), ``verbose_json`` (one segment
spanning the audio: the thinker gives no timestamps); ``srt`` / ``vtt`` need timestamps and are
refused. ``stream=true`` sends OpenAI's SSE events ``transcript.text.delta`` and ``transcript.text.done``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from omni_serve import types
from omni_serve.api.openai.chat import sse
from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.messages import _Strict
from omni_serve.types import ChatMessage, StageOutput, Usage

TranscriptionFormat = Literal["json", "text", "verbose_json"]


# What the thinker's ASR instruction takes (this route's form and realtime's input_audio_transcription).
Language = Annotated[str, Field(pattern=r"^[a-zA-Z]{2,3}(-[a-zA-Z]{2})?$", description="ISO-639-1, e.g. 'en'.")]
Prompt = Annotated[str, Field(max_length=4096, description="Text the speech continues or its vocabulary.")]


class TranscriptionRequest(_Strict):
    """The form's fields but ``file``."""

    model: str | None = None
    language: Language | None = None
    prompt: Prompt | None = None
    response_format: TranscriptionFormat = Field("json", description="srt and vtt are refused (no timestamps).")
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    stream: bool = False


def transcription_messages(audio: types.MediaPart, language: str | None, prompt: str | None) -> list[ChatMessage]:
    """The thinker's turn that asks for the transcript of ``audio`` (Qwen3-Omni's ASR prompt)."""
    instruction = "Transcribe the audio into text."
    if language:
        instruction += f" The speech is in the language with code '{language}'."
    if prompt:
        instruction += f" It follows this context: {prompt}"
    return [ChatMessage(role="user", content=[audio, types.TextPart(text=instruction)])]


def usage_json(usage: Usage) -> dict[str, Any]:
    """OpenAI's token usage of a transcription."""
    return {
        "type": "tokens",
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class TranscriptionReply:
    """One transcription's reply: JSON, the bare text, or SSE events."""

    response_format: TranscriptionFormat
    stream_events: bool  # stream=true: SSE; else text/plain pieces of the transcript (response_format=text)
    text_stage: str | None
    language: str | None = None
    duration_s: float | None = None

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.stream_events else "text/plain; charset=utf-8"

    def decides_status(self, output: StageOutput) -> bool:
        return True

    def _usage(self, output: StageOutput, usage: Usage) -> Usage:
        return output.usage if output.stage == self.text_stage and output.usage else usage

    async def json(self, outputs: AsyncIterator[StageOutput]) -> dict[str, Any]:
        text, usage = [], Usage()
        async for output in outputs:
            text.append(output.text)
            usage = self._usage(output, usage)
        transcript = "".join(text)
        if self.response_format != "verbose_json":
            return {"text": transcript, "usage": usage_json(usage)}
        duration = self.duration_s or 0.0
        return {
            "task": "transcribe",
            "language": self.language or "unknown",
            "duration": duration,
            "text": transcript,
            "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": transcript, "tokens": []}],
            "usage": {"type": "duration", "seconds": round(duration)},
        }

    async def stream(self, outputs: AsyncIterator[StageOutput]) -> AsyncIterator[str]:
        text, usage = [], Usage()
        async for output in outputs:
            usage = self._usage(output, usage)
            if not output.text:
                continue
            text.append(output.text)
            yield sse({"type": "transcript.text.delta", "delta": output.text}) if self.stream_events else output.text
        if self.stream_events:
            yield sse({"type": "transcript.text.done", "text": "".join(text), "usage": usage_json(usage)})

    def in_band_error(self, error: APIError) -> str | None:
        return sse(error.body()) if self.stream_events else None
