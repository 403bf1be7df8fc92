"""`POST /v1/audio/speech`: the request model and the audio reply.

With an omni model, speech is the assistant turn spoken: the thinker teacher-forces
``input`` as its reply (no sampling), the talker and code2wav turn it into audio. The
body streams as code2wav decodes: ``mp3`` (the default, as OpenAI's), ``opus`` (Ogg),
``aac`` (ADTS), ``wav`` (open-ended sizes) and raw 16-bit ``pcm`` are one continuous
file written as chunks arrive; ``flac`` needs the total length in its header and comes
whole at the end (:mod:`omni_serve.media.encode`).

How the speech ended is the ``X-Finish-Reason`` header (``stop``, or ``length`` when a stage
stopped at its ``max_tokens``: the talker's codec frames ran out before the text was spoken, and
the file holds what it spoke). A header goes out with the status line, so the status waits until
every stage before the audio one is done (the talker's end), not only for the first audio chunk:
the audio decoded meanwhile follows at once, the rest as code2wav decodes it. With ``stream: true``
the status goes out with the first audio instead (where the talker hands code2wav its codes in
chunks, before the talker's end), without the header unless the end is known by then. A cut found
after the status line fails the reply as any failure after it does: the body is cut short before
the file's end, never a whole file.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from omni_serve.api.openai.chat import FINISH_REASON_HEADER
from omni_serve.api.openai.errors import APIError, bad_request
from omni_serve.api.openai.messages import not_blank
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.media.encode import (
    AUDIO_MEDIA_TYPES,
    EMPTY_AUDIO_SAMPLE_RATE,
    STREAMABLE_AUDIO,
    AudioEncoder,
    encode_audio,
)
from omni_serve.types import ChatMessage, FinishReason, Modality, StageOutput

if TYPE_CHECKING:
    from starlette.requests import Request

    from omni_serve.api.openai.route import RouteContext
    from omni_serve.graph.request import OmniRequest
    from omni_serve.graph.stage_log import StageLog

SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]

# vLLM-Omni's limit on a speech request's instructions (its serving_speech's _TTS_MAX_INSTRUCTIONS_LENGTH).
MAX_INSTRUCTIONS = 500
MAX_NEW_TOKENS = 4096  # and on max_new_tokens (_TTS_MAX_NEW_TOKENS_MAX)


class SpeechRequest(BaseModel):
    # Strict types, as every JSON body's (messages._Strict says why).
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str = Field(min_length=1, max_length=4096, description="The text to speak.")
    voice: str | None = Field(
        None,
        validation_alias=AliasChoices("voice", "speaker"),  # vLLM-Omni accepts both names
        description="Voice name or alias (see GET /v1/audio/voices); None: the model's default voice.",
    )
    response_format: SpeechFormat = "mp3"
    # typing's Literal takes no floats; pydantic accepts 1 and 1.0 here and refuses any other speed.
    speed: Literal[1, 1.0] = Field(  # type: ignore[valid-type]
        1.0, description="Only 1.0: the talker has no speed control."
    )
    stream_format: Literal["audio"] = Field("audio", description="Raw audio bytes as they are produced.")
    stream: bool = Field(
        False,
        description="true: the status line and the first audio as soon as code2wav decodes it, before the talker's "
        "end (X-Finish-Reason only where the end is known by then; a reply cut short later ends in a broken body). "
        "false: the status waits for the talker's end; the body still streams as decoded (vLLM-Omni's field).",
    )
    instructions: str | None = Field(
        None, description=f"Sent to the model as a system message; at most {MAX_INSTRUCTIONS} characters (vLLM-Omni's)."
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same audio (vLLM-Omni's field).")
    # vLLM-Omni's voice-mode fields of a TTS model (Qwen3-TTS): the model's prompt builder validates them (a TTS
    # graph's entry stage); a graph whose entry stage takes a conversation refuses them (the ingress).
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = Field(
        None,
        description="CustomVoice: a named speaker (voice); VoiceDesign: a voice described by instructions; "
        "Base: a clone of ref_audio. None: Base with ref_audio or ref_text, else CustomVoice.",
    )
    language: str | None = Field(None, max_length=64, description="The text's language (the model's list), or Auto.")
    ref_audio: str | None = Field(
        None, description="Base: the reference audio to clone, a data: URL (base64); omni_serve fetches no URL for it."
    )
    ref_text: str | None = Field(None, max_length=4096, description="Base: the reference audio's transcript.")
    x_vector_only_mode: bool | None = Field(
        None, description="Base: clone the speaker embedding only (no ref_text, no in-context reference codes)."
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="The talker's codec frames at most (vLLM-Omni's field and bound; the model's bounds apply too).",
    )
    stage_sampling: dict[str, dict[str, Any]] | None = Field(
        None,
        description="Per-stage sampling overrides keyed by stage name, as chat completions takes them "
        "(e.g. {'talker': {'temperature': 0.0}}); a stage that samples nothing for speech refuses them.",
    )

    @field_validator("input")
    @classmethod
    def _something_to_say(cls, text: str) -> str:
        return not_blank(text)

    @field_validator("instructions")
    @classmethod
    def _instructions_limit(cls, text: str | None) -> str | None:
        if text is not None and len(text) > MAX_INSTRUCTIONS:
            raise ValueError(f"too long: {len(text)} characters, at most {MAX_INSTRUCTIONS}")
        return text

    @field_validator("ref_audio")
    @classmethod
    def _data_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("data:"):
            raise ValueError("a data: URL (base64): omni_serve fetches no URL or file for a reference audio")
        return value

    def speech_fields(self) -> dict[str, Any]:
        """The fields a TTS model's prompt builder reads besides ``input`` and ``voice`` (those set)."""
        names = ("instructions", *TTS_FIELDS)
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


# What only a TTS model's own prompt takes (a speech-to-speech graph speaks in its own voices).
TTS_FIELDS = ("task_type", "language", "ref_audio", "ref_text", "x_vector_only_mode", "max_new_tokens")


@dataclass
class SpeechReply:
    """The audio file of one speech request, written as code2wav decodes (FLAC: whole, at the end)."""

    response_format: SpeechFormat
    stage_log: StageLog | None = None  # what the request's stages did: whether one stopped at its max_tokens
    early: bool = False  # the request's `stream`: the status with the first audio, not after the talker's end
    _cut_at_status: list[str] = field(default_factory=list, init=False)  # what X-Finish-Reason already said

    @property
    def media_type(self) -> str:
        return AUDIO_MEDIA_TYPES[self.response_format]

    def decides_status(self, output: StageOutput) -> bool:
        """Audio (or the end), once no stage before the audio stage can still stop at its max_tokens (``early``:
        the first audio)."""
        return output.audio is not None and (self.early or self._settled(output.stage))

    def _settled(self, audio_stage: str) -> bool:
        return self.stage_log is None or self.stage_log.settled(but=audio_stage)

    async def json(self, outputs: AsyncIterator[StageOutput]) -> dict[str, Any]:
        raise TypeError("speech replies are audio, never JSON")

    async def stream(self, outputs: AsyncIterator[StageOutput]) -> AsyncIterator[bytes]:
        fmt = self.response_format
        encoder: AudioEncoder | None = None
        whole: list[np.ndarray] = []
        rate = EMPTY_AUDIO_SAMPLE_RATE
        async for item in outputs:
            if item.audio is None:
                continue
            if encoder is None and not whole:
                rate = item.sample_rate or rate
                encoder = AudioEncoder(fmt, rate) if fmt in STREAMABLE_AUDIO else None
            if encoder is not None:
                if data := encoder.encode(item.audio):
                    yield data
            else:
                whole.append(item.audio)
        self._check_not_cut()
        if encoder is not None:
            yield encoder.finish()
        elif fmt in STREAMABLE_AUDIO:  # no audio at all: an empty file of the format
            yield AudioEncoder(fmt, rate).finish()
        else:
            yield encode_audio(np.concatenate(whole) if whole else np.zeros(0, np.float32), rate, fmt)

    def _cut(self) -> list[str]:
        return self.stage_log.cut_short() if self.stage_log is not None else []

    def _check_not_cut(self) -> None:
        """Every output is in: a stage that stopped at its max_tokens after the status line said ``stop``
        (the audio stage's own) fails the reply, so the file is never whole."""
        cut = [stage for stage in self._cut() if stage not in self._cut_at_status]
        if cut:
            raise APIError(
                500,
                f"stage '{cut[0]}' stopped at its max_tokens after the reply started: the speech is cut short",
                type="server_error",
                code="output_truncated",
            )

    def headers(self, head: list[StageOutput]) -> dict[str, str]:
        self._cut_at_status = self._cut()
        if head and not self._settled(head[-1].stage):  # early: how it ends is not known yet, so not said
            return {}
        return {FINISH_REASON_HEADER: (FinishReason.LENGTH if self._cut_at_status else FinishReason.STOP).value}

    def in_band_error(self, error: APIError) -> None:
        """The status line is sent: cut the body short, which a client sees as a broken transfer, not a file."""
        return None


async def speech_request(body: SpeechRequest, http: Request, route: RouteContext) -> tuple[OmniRequest, SpeechReply]:
    """The speech body as the graph's request (the text to speak as the entry stage's reply) and its reply.

    A speech-to-speech graph (its entry stage takes a conversation) speaks in its own voices: TTS voice-mode
    fields are refused there, and so is sampling for its entry stage, which teacher-forces the text.
    """
    speech = body.speech_fields()
    if route.entry_prompt == "chat":
        for name in TTS_FIELDS:
            if name in speech:
                raise bad_request(f"{name}: this graph's model speaks in its own voices (not a TTS model)", name)
        if route.entry_stage in (body.stage_sampling or {}):
            param = f"stage_sampling.{route.entry_stage}"
            raise bad_request(f"{param}: speech teacher-forces this stage's reply (input); it samples nothing", param)
    voice = await route.voice(body.voice, "voice")
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    messages.append(ChatMessage(role="user", content=body.input))
    omni = route.request(
        http,
        modalities={Modality.AUDIO},
        sampling=route.sampling(SamplingRequest(seed=body.seed, stage_sampling=body.stage_sampling)),
        messages=messages,
        voice=voice,
        text_to_speak=body.input,
        speech=speech,
    )
    return omni, SpeechReply(body.response_format, omni.stage_log, early=body.stream)
