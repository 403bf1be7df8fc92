"""`POST /v1/audio/transcriptions` with the official client: the thinker alone transcribes real speech.

espeak-ng speaks; the official ``openai`` client uploads the WAV in each response format and streamed.
The tiny random thinker's transcript is not English, but it is greedy (top_k 1 in the graph's
defaults), so every format must carry the same text; the talker and code2wav must see no call.
"""

from __future__ import annotations

import io
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.audio import spoken
from tests.in_flight import stats

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3-omni"


@pytest.fixture(scope="module")
def speech_wav() -> bytes:
    samples = np.frombuffer(spoken("The quick brown fox jumps over the lazy dog."), "<i2")
    out = io.BytesIO()
    sf.write(out, samples, 24000, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_transcriptions_with_the_openai_client(tiny_omni, speech_wav: bytes) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{tiny_omni.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = stats(tiny_omni)
    file = ("speech.wav", speech_wav, "audio/wav")
    plain = client.audio.transcriptions.create(model=MODEL, file=file, language="en", prompt="A pangram.")
    assert plain.text
    assert plain.usage is not None and plain.usage.input_tokens > 20 and plain.usage.output_tokens > 0
    text = client.audio.transcriptions.create(model=MODEL, file=file, language="en", prompt="A pangram.",
                                              response_format="text")  # fmt: skip
    assert text == plain.text
    verbose = client.audio.transcriptions.create(
        model=MODEL, file=file, language="en", prompt="A pangram.", response_format="verbose_json"
    )
    seconds = len(sf.read(io.BytesIO(speech_wav))[0]) / 24000
    assert verbose.text == plain.text and abs(verbose.duration - seconds) < 0.05
    assert verbose.segments and verbose.segments[0].end == verbose.duration
    stream = client.audio.transcriptions.create(model=MODEL, file=file, language="en", prompt="A pangram.", stream=True)
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1 and events[-1].type == "transcript.text.done"
    assert "".join(deltas) == events[-1].text == plain.text
    after = stats(tiny_omni)
    assert after["thinker"]["requests_total"] == before["thinker"]["requests_total"] + 4
    assert after["talker"]["requests_total"] == before["talker"]["requests_total"], "a transcription ran the talker"
    assert after["code2wav"]["requests_total"] == before["code2wav"]["requests_total"]


@pytest.mark.parametrize(
    ("files", "data", "status", "param"),
    [
        ({"upload": ("x.wav", b"RIFF", "audio/wav")}, {"model": MODEL}, 400, "file"),
        ({}, {"model": MODEL}, 415, None),
        ({"file": ("x.png", b"\x89PNG\r\n\x1a\n" + bytes(64), "image/png")}, {}, 400, "file"),
        ({"file": ("x.wav", b"RIFF", "audio/wav")}, {"response_format": "srt"}, 400, "response_format"),
        ({"file": ("x.wav", b"RIFF", "audio/wav")}, {"model": "other"}, 404, "model"),
        ({"file": ("x.wav", b"RIFF", "audio/wav")}, {"language": "english!"}, 400, "language"),
    ],
    ids=["no-file", "not-multipart", "not-audio", "srt", "unknown-model", "bad-language"],
)
def test_bad_transcription_requests(
    tiny_omni, files: dict[str, Any], data: dict[str, str], status: int, param: str | None
) -> None:
    # httpx sends a form without files url-encoded: the route wants multipart (415).
    reply = httpx.post(f"{tiny_omni.base_url}/v1/audio/transcriptions", files=files or None, data=data, timeout=60)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
