"""Audio and image encoding for API responses (soundfile and Pillow do the work)."""

from __future__ import annotations

import base64
import io
from typing import Literal

import numpy as np
import soundfile as sf

AudioFormat = Literal["wav", "pcm", "flac"]

AUDIO_MEDIA_TYPES: dict[str, str] = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
    """Mono float samples in [-1, 1] -> file bytes; ``pcm`` is raw 16-bit little-endian."""
    samples = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    if fmt == "pcm":
        return (samples * 32767.0).astype("<i2").tobytes()
    buffer = io.BytesIO()
    sf.write(buffer, samples, sample_rate, format=fmt.upper(), subtype="PCM_16")
    return buffer.getvalue()


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """WAV/FLAC bytes -> (float32 samples, sample rate)."""
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def encode_png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{b64(data)}"
