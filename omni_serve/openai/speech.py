"""`POST /v1/audio/speech`: the request model and the streamed byte formats.

With an omni model, speech is the assistant turn spoken: the thinker teacher-forces
``input`` as its reply (no sampling), the talker and code2wav turn it into audio.
``wav`` and ``pcm`` stream as chunks are decoded (WAV with an open-ended header, as
streaming TTS servers send it); ``flac`` needs the whole signal and comes at the end.
"""

from __future__ import annotations

import struct
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omni_serve.media import encode_audio


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str = Field(min_length=1, max_length=4096, description="The text to speak.")
    voice: str | None = Field(None, description="Speaker name; None uses the model's default voice.")
    response_format: Literal["wav", "pcm", "flac"] = "wav"
    speed: Literal[1, 1.0] = Field(1.0, description="Only 1.0: the talker has no speed control.")
    stream_format: Literal["audio"] = Field("audio", description="Raw audio bytes as they are produced.")
    instructions: str | None = Field(None, max_length=4096, description="Sent to the model as a system message.")


MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}


def wav_stream_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF), so data can follow as it comes."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", unknown)
    )


def pcm16(samples: np.ndarray) -> bytes:
    return encode_audio(samples, 0, "pcm")
