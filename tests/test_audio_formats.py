"""Every audio format of the API, decoded by a decoder independent of the encoder (see tests/audio.py).

Unit: the encoder alone, whole and chunk by chunk. Integration: the official ``openai`` client
against the tiny graph: chat audio in each of OpenAI's six formats, streamed and not, and speech
in each of its six formats (the SDK default included), all at the graph's 24 kHz.
"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from omni_serve.media.encode import AudioEncoder, encode_audio
from omni_serve.models.qwen3_omni import SAMPLE_RATE
from tests.audio import CHAT_FORMATS, SPEECH_FORMATS, decode

LOSSLESS = {"wav", "flac", "pcm", "pcm16"}


def tone(rate: int, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def container(fmt: str) -> str:
    return "pcm" if fmt == "pcm16" else fmt


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
@pytest.mark.parametrize("rate", [24000, 16000])
def test_whole_file_decodes_at_its_rate(fmt: str, rate: int) -> None:
    signal = tone(rate)
    samples, decoded_rate = decode(fmt, encode_audio(signal, rate, container(fmt)), raw_rate=rate)
    assert decoded_rate == rate
    if fmt in LOSSLESS:
        np.testing.assert_allclose(samples, signal, atol=1e-4)
    else:  # lossy codecs add priming/padding; the tone's energy survives
        assert abs(len(samples) - len(signal)) <= rate // 10
        assert abs(np.sqrt(np.mean(samples**2)) - np.sqrt(np.mean(signal**2))) < 0.05


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus", "aac", "pcm"])
def test_chunked_encoding_is_one_valid_file(fmt: str) -> None:
    signal = tone(SAMPLE_RATE, 1.0)
    encoder = AudioEncoder(fmt, SAMPLE_RATE)
    parts = [encoder.encode(signal[i : i + 1000]) for i in range(0, len(signal), 1000)]
    data = b"".join(parts) + encoder.finish()
    assert sum(map(len, parts)) > 0, "bytes come out before the end (the stream is incremental)"
    samples, rate = decode(fmt, data, raw_rate=SAMPLE_RATE)
    assert rate == SAMPLE_RATE and abs(len(samples) - len(signal)) <= SAMPLE_RATE // 10


def test_a_file_at_another_rate_is_the_same_signal_resampled_in_chunks() -> None:
    """44.1 kHz samples (Ming-flash-omni's AudioVAE) as the Realtime API's 24 kHz PCM, fed in chunks: one
    continuous signal of the same length in time and the same tone (its last samples come at ``finish``)."""
    signal = tone(44100, 1.0)
    encoder = AudioEncoder("pcm", 44100, rate=24000)
    data = b"".join(encoder.encode(signal[i : i + 882]) for i in range(0, len(signal), 882)) + encoder.finish()
    samples, rate = decode("pcm", data, raw_rate=24000)
    assert rate == 24000 and abs(len(samples) - 24000) <= 64, len(samples)
    spectrum = np.abs(np.fft.rfft(samples[1000:-1000]))
    assert abs(np.argmax(spectrum) * 24000 / (len(samples) - 2000) - 440) < 2  # the same tone, not 44.1/24 of it
    steady = samples[1000:-1000]  # no clicks at the chunk edges: a sine's neighbouring samples stay close
    assert np.abs(np.diff(steady)).max() < 2 * np.pi * 440 / 24000 * 0.5 * 1.05


# ---- over HTTP with the official client -----------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_omni) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_omni.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


CHAT = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Say something."}],
    "modalities": ["text", "audio"],
    "max_tokens": 6,
    "seed": 3,
    # 10 codec frames (0.8 s): the first chunk (1 frame) and a second, more than the half second checked.
    "extra_body": {"stage_sampling": {"talker": {"max_tokens": 10}}},
}


@pytest.mark.integration
@pytest.mark.parametrize("fmt", CHAT_FORMATS)
def test_chat_audio_in_every_format(client: openai.OpenAI, fmt: str) -> None:
    reply = client.chat.completions.create(**CHAT, audio={"voice": "ethan", "format": fmt})
    audio = reply.choices[0].message.audio
    samples, rate = decode(fmt, base64.b64decode(audio.data), raw_rate=SAMPLE_RATE)
    assert rate == SAMPLE_RATE and samples.size > SAMPLE_RATE // 2 and np.isfinite(samples).all()
    assert audio.transcript == reply.choices[0].message.content


@pytest.mark.integration
@pytest.mark.parametrize("fmt", CHAT_FORMATS)
def test_streamed_chat_audio_in_every_format(client: openai.OpenAI, fmt: str) -> None:
    stream = client.chat.completions.create(**CHAT, audio={"voice": "ethan", "format": fmt}, stream=True)
    chunks = [c for c in stream if c.choices and getattr(c.choices[0].delta, "audio", None)]
    assert len(chunks) >= 2, "10 frames arrive as two codec chunks (1 + 9)"
    total = 0
    for chunk in chunks:  # every chunk is a self-contained file (raw PCM for pcm16)
        samples, rate = decode(fmt, base64.b64decode(chunk.choices[0].delta.audio.data), raw_rate=SAMPLE_RATE)
        assert rate == SAMPLE_RATE and samples.size > 0
        total += samples.size
    assert total > SAMPLE_RATE // 2


@pytest.mark.integration
@pytest.mark.parametrize("fmt", [None, *SPEECH_FORMATS])
def test_speech_in_every_format(client: openai.OpenAI, fmt: str | None) -> None:
    kwargs = {} if fmt is None else {"response_format": fmt}  # None: the SDK sends none, the server's mp3 applies
    with client.audio.speech.with_streaming_response.create(
        model="tiny-qwen3-omni",
        input="Hello there, how are you today?",
        voice="ethan",
        extra_body={"seed": 4, "stage_sampling": {"talker": {"max_tokens": 10}}},
        **kwargs,
    ) as response:
        assert response.headers["content-type"].startswith("audio/")
        data = response.read()
    samples, rate = decode(fmt or "mp3", data, raw_rate=SAMPLE_RATE)
    assert rate == SAMPLE_RATE and samples.size > 0 and np.isfinite(samples).all()
