"""`POST /v1/audio/speech`: the request model and the audio reply.

With an omni model, speech is the assistant turn spoken: the thinker teacher-forces
``input`` as its reply (no sampling), the talker and code2wav turn it into audio. The
body streams as code2wav decodes: ``mp3`` (the default, as OpenAI's), ``opus`` (Ogg),
``aac`` (ADTS), ``wav`` (open-ended sizes) and raw 16-bit ``pcm`` are one continuous
file written as chunks arrive; ``flac`` needs the total length in its header and comes
whole at the end (:mod:`omni_serve.media.encode`).

Speech cut short is a failure, never a file: when a stage stopped at its ``max_tokens`` (the
talker's codec frames ran out before the text was spoken), the reply ends as any failure after
the status line does, its body cut short before the file's end (a broken transfer, no final
encoder bytes). The status line goes out with the first audio chunk, long before the talker's end
is known, so no header can carry it; OpenAI's speech API has no field for it either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from omni_serve.api.openai.errors import APIError
from omni_serve.media.encode import (
    AUDIO_MEDIA_TYPES,
    EMPTY_AUDIO_SAMPLE_RATE,
    STREAMABLE_AUDIO,
    AudioEncoder,
    encode_audio,
)
from omni_serve.types import StageOutput

if TYPE_CHECKING:
    from omni_serve.graph.stage_log import StageLog

SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
    instructions: str | None = Field(None, max_length=4096, description="Sent to the model as a system message.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same audio (vLLM-Omni's field).")


@dataclass
class SpeechReply:
    """The audio file of one speech request, written as code2wav decodes (FLAC: whole, at the end)."""

    response_format: SpeechFormat
    stage_log: StageLog | None = None  # what the request's stages did: whether one stopped at its max_tokens

    @property
    def media_type(self) -> str:
        return AUDIO_MEDIA_TYPES[self.response_format]

    def decides_status(self, output: StageOutput) -> bool:
        return output.audio is not None  # the first audio chunk (or the end) decides the status code

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

    def _check_not_cut(self) -> None:
        """Refuse to answer with a whole file when a stage stopped at its max_tokens (its speech is cut)."""
        cut = self.stage_log.cut_short() if self.stage_log is not None else []
        if cut:
            raise APIError(
                500,
                f"stage '{cut[0]}' stopped at its max_tokens: the speech is cut short (the graph's "
                f"default_sampling.max_tokens of '{cut[0]}' bounds it)",
                type="server_error",
                code="output_truncated",
            )

    def headers(self, head: list[StageOutput]) -> dict[str, str]:
        self._check_not_cut()  # a stage already stopped at its max_tokens: a real error status instead of a file
        return {}

    def in_band_error(self, error: APIError) -> None:
        """The status line is sent: cut the body short, which a client sees as a broken transfer, not a file."""
        return None
