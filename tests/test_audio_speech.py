"""`POST /v1/audio/speech` on the tiny graph: wav/pcm stream as produced; bad requests name the field.

Every format decoding with an independent decoder: tests/test_audio_formats.py."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
import soundfile as sf

from omni_serve.models.qwen3_omni import SAMPLE_RATE

pytestmark = pytest.mark.integration

TEXT = "Hello from the tiny talker."
SEED = 2


def speech(base_url: str, **body) -> httpx.Response:
    # Seeded: the random-weight talker samples, and unseeded it may draw codec EOS first (no audio).
    payload = {"model": "tiny-qwen3-omni", "input": TEXT, "voice": "chelsie", "seed": SEED, **body}
    return httpx.post(f"{base_url}/v1/audio/speech", json=payload, timeout=120)


def test_pcm_is_raw_16_bit_and_matches_wav(tiny_omni) -> None:
    pcm = speech(tiny_omni.base_url, response_format="pcm")
    wav = speech(tiny_omni.base_url, response_format="wav")
    assert pcm.status_code == 200 and pcm.headers["content-type"] == "audio/pcm"
    assert len(pcm.content) % 2 == 0 and len(pcm.content) > 0
    # Same seed, same speech: the WAV is the PCM behind a 44-byte header.
    assert wav.content[:4] == b"RIFF" and wav.content[36:40] == b"data" and wav.content[44:] == pcm.content


def test_streamed_wav_arrives_in_several_chunks_and_decodes(tiny_omni) -> None:
    body = {"model": "tiny-qwen3-omni", "input": TEXT, "response_format": "wav", "seed": SEED}
    with httpx.stream("POST", f"{tiny_omni.base_url}/v1/audio/speech", json=body, timeout=120) as response:
        assert response.status_code == 200
        parts = [part for part in response.iter_bytes() if part]
    data = b"".join(parts)
    assert len(parts) > 1  # header + codec chunks as code2wav decodes them
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == SAMPLE_RATE and samples.size == (len(data) - 44) // 2


def test_openai_client(tiny_omni) -> None:
    client = openai.OpenAI(base_url=f"{tiny_omni.base_url}/v1", api_key="unused", max_retries=0)
    audio = client.audio.speech.create(
        model="tiny-qwen3-omni", input=TEXT, voice="ethan", response_format="wav", extra_body={"seed": SEED}
    )
    samples, rate = sf.read(io.BytesIO(audio.content), dtype="float32")
    assert rate == SAMPLE_RATE and samples.size > 0


@pytest.mark.parametrize(
    "body, field",
    [
        ({"response_format": "ogg"}, "response_format"),
        ({"input": ""}, "input"),
        ({"speed": 2.0}, "speed"),
        ({"voice": "nobody"}, "voice"),
        ({"stream_format": "sse"}, "stream_format"),
    ],
)
def test_bad_speech_requests(tiny_omni, body: dict, field: str) -> None:
    response = speech(tiny_omni.base_url, **body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
