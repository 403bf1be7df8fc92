"""`POST /v1/audio/transcriptions`: the form fields, the thinker's turn that asks for a transcript, and the reply.

A transcription is a text-only graph request (the thinker alone: no talker, no code2wav) whose one
user turn is the audio, through the same media path as a chat request's ``input_audio``, and an
instruction to transcribe it. The realtime session's ``input_audio_transcription`` builds the same
turn (:func:`transcription_messages`).

Formats: ``json`` (``{"text", "usage"}``), ``text`` (the bare transcript), ``verbose_json`` (one segment
spanning the audio: the thinker gives no timestamps); ``srt`` / ``vtt`` need timestamps and are
refused. ``stream=true`` sends OpenAI's SSE events ``transcript.text.delta`` and ``transcript.text.done``.

A transcript the thinker cut at its ``max_tokens`` says so in every format, as chat completions does:
``finish_reason`` (``"stop"`` or ``"length"``) in the ``json`` and ``verbose_json`` bodies and on
``transcript.text.done``; the ``text`` format, a bare transcript, in the ``X-Finish-Reason`` header
(its status line waits for the transcript's end for that).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field

from omni_serve import types
from omni_serve.api.openai.chat import FINISH_REASON_HEADER, sse
from omni_serve.api.openai.errors import APIError, bad_request
from omni_serve.api.openai.messages import FORM, _Strict
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.media.inputs import audio_seconds
from omni_serve.types import ChatMessage, FinishReason, StageOutput, Usage

if TYPE_CHECKING:
    from starlette.requests import Request

    from omni_serve.api.openai.route import RouteContext
    from omni_serve.graph.request import OmniRequest

TranscriptionFormat = Literal["json", "text", "verbose_json"]


# ISO 639-1's two-letter language codes (what OpenAI's and vLLM's transcription `language` takes).
ISO_639_1 = frozenset(
    """aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co cr cs cu cv cy da de dv dz ee
    el en eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia id ie ig ii ik io is it iu
    ja jv ka kg ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu lv mg mh mi mk ml mn mr ms mt my na nb
    nd ne ng nl nn no nr nv ny oc oj om or os pa pi pl ps pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr
    ss st su sv sw ta te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu""".split()
)


def _iso_639_1(code: str) -> str:
    if code.lower() not in ISO_639_1:
        raise ValueError(f"{code[:16]!r} is not an ISO-639-1 language code (two letters, e.g. 'en')")
    return code.lower()


# What the thinker's ASR instruction takes (this route's form and realtime's input_audio_transcription).
Language = Annotated[str, AfterValidator(_iso_639_1), Field(description="ISO-639-1, e.g. 'en'.")]
Prompt = Annotated[str, Field(max_length=4096, description="Text the speech continues or its vocabulary.")]


class TranscriptionRequest(_Strict):
    """The form's fields but ``file``."""

    model_config = FORM

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
        # SSE: the first output. The bare text: its end, so that its header can say how it ended.
        return self.stream_events or (output.finished and output.stage == self.text_stage)

    def headers(self, head: list[StageOutput]) -> dict[str, str]:
        if self.stream_events:
            return {}
        return {FINISH_REASON_HEADER: Transcript(self.text_stage).read(head).finish_reason.value}

    async def json(self, outputs: AsyncIterator[StageOutput]) -> dict[str, Any]:
        transcript = Transcript(self.text_stage)
        async for output in outputs:
            transcript.add(output)
        text, finish = "".join(transcript.text), transcript.finish_reason.value
        if self.response_format != "verbose_json":
            return {"text": text, "usage": usage_json(transcript.usage), "finish_reason": finish}
        duration = self.duration_s or 0.0
        return {
            "task": "transcribe",
            "language": self.language or "unknown",
            "duration": duration,
            "text": text,
            "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "tokens": []}],
            "usage": {"type": "duration", "seconds": round(duration)},
            "finish_reason": finish,
        }

    async def stream(self, outputs: AsyncIterator[StageOutput]) -> AsyncIterator[str]:
        transcript = Transcript(self.text_stage)
        async for output in outputs:
            transcript.add(output)
            if not output.text:
                continue
            yield sse({"type": "transcript.text.delta", "delta": output.text}) if self.stream_events else output.text
        if self.stream_events:
            yield sse(
                {
                    "type": "transcript.text.done",
                    "text": "".join(transcript.text),
                    "usage": usage_json(transcript.usage),
                    "finish_reason": transcript.finish_reason.value,
                }
            )

    def in_band_error(self, error: APIError) -> str | None:
        return sse(error.body()) if self.stream_events else None


@dataclass
class Transcript:
    """The text stage's outputs, merged: its text, usage so far and how it ended."""

    text_stage: str | None
    text: list[str] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    finish_reason: FinishReason = FinishReason.STOP

    def add(self, output: StageOutput) -> None:
        self.text.append(output.text)
        if output.stage != self.text_stage:
            return
        self.usage = output.usage or self.usage
        if output.finished and output.finish_reason is FinishReason.LENGTH:
            self.finish_reason = FinishReason.LENGTH

    def read(self, outputs: list[StageOutput]) -> Transcript:
        for output in outputs:
            self.add(output)
        return self


def audio_file(files: dict[str, bytes]) -> bytes | None:
    """The upload's one audio file; a file the route does not read is refused, never dropped (without ``file``,
    the 400 names that file missing)."""
    extra = sorted(set(files) - {"file"})
    if extra and "file" in files:
        raise bad_request(f"{extra[0]}: unknown file field (this route takes one audio file, 'file')", extra[0])
    return files.get("file")


def transcription_request(
    body: TranscriptionRequest, audio: types.MediaPart, fmt: str, http: Request, route: RouteContext
) -> tuple[OmniRequest, TranscriptionReply]:
    """The transcription as the graph's request (the thinker alone transcribes) and its reply; ``audio`` is the
    checked upload in format ``fmt``, whose length verbose_json reports (from its container's header)."""
    omni = route.request(
        http,
        modalities={types.Modality.TEXT},
        sampling=route.sampling(SamplingRequest(temperature=body.temperature)),
        messages=transcription_messages(audio, body.language, body.prompt),
    )
    reply = TranscriptionReply(body.response_format, body.stream, route.text_stage, body.language)
    if body.response_format == "verbose_json" and not body.stream:
        reply.duration_s = audio_seconds(audio.data, fmt, "file")
    return omni, reply
