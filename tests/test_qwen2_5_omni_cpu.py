"""Qwen2.5-Omni served for real: graphs/tiny_qwen2_5_omni_vllm_omni.yaml (generated from vLLM-Omni's qwen2_5_omni
pipeline, made for a CPU) on vLLM-Omni stage engines, on the tiny checkpoint (``tiny-qwen2.5-omni``): thinker ->
talker -> code2wav, through chat (whole and streamed), ``/v1/audio/speech``, ``/v1/audio/transcriptions`` and
``/v1/realtime``, with image and audio input.

Qwen2.5-Omni's handoffs go whole (vLLM-Omni declares no async chunk for it): the talker starts from the thinker's
finished reply, code2wav from the talker's codec ids (one a step, 480 samples each at 24 kHz).

The oracle is native vLLM-Omni on the same checkpoint and the graph's own configuration
(``native_omni.graph_deploy_config``), started beside the graph's deploy and stopped after its replies. For a
seed, the thinker's text is native's token for token, for text, an image and an audio clip. The talker samples
from the seed on both servers, so the speech is as long as native's, sample for sample. Its samples are not
native's: vLLM-Omni's token2wav draws its DiT's noise from the process's global generator
(``qwen2_5_omni_token2wav.py``), so two native replies to one request differ too
(tests/test_tiny_qwen2_5_omni.py shows it).
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
import yaml

from tests.conftest import HTTP_PORT
from tests.deps import require

# 900 s: the first test pays for three EngineCores and native's three starting on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.checkpoints import ensure  # noqa: E402
from omni_serve.cli.launch import load_graph_file  # noqa: E402
from tests import audio, graph_properties, native_omni, native_vllm_omni  # noqa: E402
from tests.families import BY_NAME  # noqa: E402
from tests.media import audio_part, described, image_part, wav  # noqa: E402

FAMILY = BY_NAME["vllm_omni.qwen2_5_omni"]
MODEL = "tiny-qwen2.5-omni"
RATE = 24000
SAMPLES_PER_CODE = 480  # two mel frames of 240 samples a codec id
NATIVE_PORT = HTTP_PORT + 29  # native vLLM-Omni, beside the session cluster (base, base + 1) and the others
SEED = 7
HELLO = [{"role": "user", "content": "Say hello."}]
SPOKEN = {"modalities": ["text", "audio"], "audio": {"voice": "chelsie", "format": "wav"}}
TRANSCRIBE = "Transcribe the audio into text. The speech is in the language with code 'en'."
ORACLE_CHATS = {  # what native answers beside the graph: the graph's defaults, one seed
    "text": {"messages": HELLO, "modalities": ["text"], "seed": SEED},
    "sampled": {"messages": HELLO, "modalities": ["text"], "temperature": 1.0, "seed": 11},
    "image": {"messages": [{"role": "user", "content": described(image_part())}], "modalities": ["text"], "seed": SEED},
    "audio": {"messages": [{"role": "user", "content": described(audio_part())}], "modalities": ["text"], "seed": SEED},
    "spoken": {"messages": HELLO, **SPOKEN, "seed": SEED},
    # The thinker's turn /v1/audio/transcriptions asks for (api/openai/transcriptions.py), greedy by default.
    "transcribed": {
        "messages": [{"role": "user", "content": [audio_part(), {"type": "text", "text": TRANSCRIBE}]}],
        "modalities": ["text"],
    },
}


def chat_json(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def native_replies(out: Path) -> dict[str, Any]:
    """Native's replies to :data:`ORACLE_CHATS`, its server stopped. Native applies a request's sampling to the
    thinker only, the other stages their deploy defaults, while omni_serve sends the request's seed to every stage:
    native's talker is given :data:`SEED` as its default, so both talkers sample from one seed."""
    stages = load_graph_file(FAMILY.graph)["applications"][0]["args"]["stages"]
    config = native_omni.graph_deploy_config(stages, async_chunk=False)
    for stage, entry in zip(stages, config["stages"], strict=True):
        if stage["name"] == "talker":
            entry["default_sampling_params"]["seed"] = SEED
    deploy = out / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(config, sort_keys=False))
    flags = ("--deploy-config", str(deploy), "--served-model-name", MODEL)
    with native_vllm_omni.native_server(ensure(MODEL), NATIVE_PORT, *flags, log=out / "native.log") as url:
        replies = {name: chat_json(url, body) for name, body in ORACLE_CHATS.items()}
    (out / "replies.json").write_text(json.dumps(replies, indent=2))
    return replies


@pytest.fixture(scope="module")
def deployed(graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("native-qwen2.5-omni")
    with graphs.own_beside(FAMILY.graph, lambda: native_replies(out)) as pair:
        yield pair


def speech(data: str | bytes) -> np.ndarray:
    """24 kHz WAV samples (an independent decoder), whole codec ids of them, finite and not silent."""
    samples, rate = audio.decode("wav", base64.b64decode(data) if isinstance(data, str) else data, RATE)
    assert rate == RATE and samples.size and samples.size % SAMPLES_PER_CODE == 0, samples.size
    assert np.isfinite(samples).all() and np.abs(samples).max() > 1e-3, "silent audio"
    return samples


def test_models_says_it_speaks_one_voice(graph: Any) -> None:
    (card,) = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["modalities"]) == (MODEL, ["audio", "text"])
    assert card["stages"] == ["thinker", "talker", "code2wav"]
    assert {"/v1/chat/completions", "/v1/audio/speech", "/v1/realtime", "/v1/audio/transcriptions"} <= set(
        card["routes"]
    )
    assert {"text", "image", "audio", "video"} <= set(card["input_modalities"])
    assert card["voices"] == ["chelsie"] and set(card["voice_aliases"].values()) == {"chelsie"}


@pytest.mark.parametrize("name", list(ORACLE_CHATS))
def test_text_for_a_seed_is_natives(graph: Any, oracle: dict[str, Any], name: str) -> None:
    """Token for token native's reply: its text, finish reason and token counts (the prompt's too: the image's and
    the audio's tokens came out of the same processor), audio asked or not."""
    ours, native = chat_json(graph.base_url, ORACLE_CHATS[name]), oracle[name]
    assert ours["choices"][0]["message"]["content"] == native["choices"][0]["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == native["choices"][0]["finish_reason"]
    for count in ("prompt_tokens", "completion_tokens"):
        assert ours["usage"][count] == native["usage"][count], count
    if name in ("sampled", "image", "audio"):  # the request's sampling or its media moved the reply off greedy text's
        assert ours["choices"][0]["message"]["content"] != oracle["text"]["choices"][0]["message"]["content"]


def test_speech_is_as_long_as_natives_for_the_seed(graph: Any, oracle: dict[str, Any]) -> None:
    """The talker's codec ids for the seed come from the same sampler on both servers: as many samples as native's
    (not the same samples: the module docstring), spoken for the reply's text."""
    ours, native = chat_json(graph.base_url, ORACLE_CHATS["spoken"]), oracle["spoken"]
    mine, theirs = (speech(reply["choices"][0]["message"]["audio"]["data"]) for reply in (ours, native))
    assert mine.size == theirs.size, (mine.size, theirs.size)
    assert ours["choices"][0]["message"]["audio"]["transcript"] == native["choices"][0]["message"]["content"]


def test_streamed_reply_is_the_text_then_its_speech(graph: Any, oracle: dict[str, Any]) -> None:
    body = {"model": MODEL, **ORACLE_CHATS["spoken"], "stream": True}
    with httpx.stream("POST", f"{graph.base_url}/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == oracle["spoken"]["choices"][0]["message"]["content"]
    spoken = [i for i, d in enumerate(deltas) if (d.get("audio") or {}).get("data")]
    # Whole handoffs: the talker starts from the thinker's finished reply, so its speech follows the last text.
    assert spoken and min(spoken) > max(i for i, d in enumerate(deltas) if d.get("content"))
    samples = sum(speech(deltas[i]["audio"]["data"]).size for i in spoken)
    assert samples == speech(oracle["spoken"]["choices"][0]["message"]["audio"]["data"]).size


def test_an_openai_voice_is_chelsie_and_the_checkpoints_other_speaker_is_refused(graph: Any) -> None:
    """vLLM-Omni's Qwen2.5-Omni speaks Chelsie whatever is asked (omni_serve/models/vllm_omni/qwen_omni.py): an
    OpenAI voice is its alias, and Ethan, whom the checkpoint has but vLLM-Omni's talker never speaks, is a 400
    rather than Chelsie's voice under his name."""
    body = {"messages": HELLO, "modalities": ["text", "audio"], "max_tokens": 4, "seed": SEED}
    alloy = chat_json(graph.base_url, {**body, "audio": {"voice": "alloy", "format": "wav"}})
    speech(alloy["choices"][0]["message"]["audio"]["data"])
    refused = httpx.post(
        f"{graph.base_url}/v1/chat/completions",
        json={"model": MODEL, **body, "audio": {"voice": "ethan", "format": "wav"}},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "audio.voice", refused.text


def test_transcription_is_natives_thinker_reply_to_its_turn(graph: Any, oracle: dict[str, Any]) -> None:
    """The official client uploads the clip of the ``audio`` chat; the transcript, whole and streamed, is native's
    thinker's reply to the turn the route asks (the talker and code2wav see no call: tests/test_transcriptions.py)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    file = ("tone.wav", wav(1.0), "audio/wav")
    native = oracle["transcribed"]
    plain = client.audio.transcriptions.create(model=MODEL, file=file, language="en")
    assert plain.text == native["choices"][0]["message"]["content"]
    assert plain.usage is not None and plain.usage.input_tokens == native["usage"]["prompt_tokens"]
    events = list(client.audio.transcriptions.create(model=MODEL, file=file, language="en", stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == plain.text


def test_speech_route_reads_the_input_aloud(graph: Any) -> None:
    body = {"model": MODEL, "input": "Hello from the tiny talker.", "voice": "chelsie", "response_format": "wav"}
    reply = httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=300)
    assert reply.status_code == 200, reply.text[:500]
    assert speech(reply.content).size >= 4 * SAMPLES_PER_CODE


def test_realtime_text_turn_answered_in_speech(graph: Any) -> None:
    """The official client: a typed user turn, answered with its transcript and 24 kHz PCM."""
    from openai import AsyncOpenAI

    async def talk() -> list[dict[str, Any]]:
        client = AsyncOpenAI(base_url=f"{graph.base_url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}
            )
            await conn.response.create(response={"output_modalities": ["audio"]})
            events: list[dict[str, Any]] = []
            async with asyncio.timeout(300):
                while not events or events[-1]["type"] != "response.done":
                    events.append(json.loads(await conn.recv_bytes()))
            return events

    events = asyncio.run(talk())
    pcm = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    samples, rate = audio.decode("pcm", pcm, RATE)
    assert rate == RATE and samples.size and samples.size % SAMPLES_PER_CODE == 0, samples.size
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    done = events[-1]["response"]
    assert transcript and done["output"][0]["content"][0]["transcript"] == transcript, done


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph: Any, check: Any) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, FAMILY)
