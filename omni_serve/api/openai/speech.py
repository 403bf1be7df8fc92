"""`POST /v1/audio/speech`: the request model.

With an omni model, speech is the assistant turn spoken: the thinker teacher-forces
``input`` as its reply (no sampling), the talker and code2wav turn it into audio. The
body streams as code2wav decodes: ``mp3`` (the default, as OpenAI's), ``opus`` (Ogg),
``aac`` (ADTS), ``wav`` (open-ended sizes) and raw 16-bit ``pcm`` are one continuous
file written as chunks arrive; ``flac`` needs the total length in its header and comes
whole at the end (:mod:`omni_serve.media.encode`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str = Field(min_length=1, max_length=4096, description="The text to speak.")
    voice: str | None = Field(
        None,
        validation_alias=AliasChoices("voice", "speaker"),  # vLLM-Omni accepts both names
        description="Voice name or alias (see GET /v1/audio/voices); None: the model's default voice.",
    )
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: Literal[1, 1.0] = Field(1.0, description="Only 1.0: the talker has no speed control.")
    stream_format: Literal["audio"] = Field("audio", description="Raw audio bytes as they are produced.")
    instructions: str | None = Field(None, max_length=4096, description="Sent to the model as a system message.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same audio (vLLM-Omni's field).")
