"""The real graphs/qwen3_omni.yaml on vLLM-Omni stage engines, random (dummy) weights, over HTTP.

Needs 2 CUDA GPUs with >= 80 GB each (the shipped placement: thinker on one GPU at
gpu_memory_utilization 0.9; talker 0.6 + code2wav 0.1 sharing the other), vllm==0.30.*
+ vllm-omni==0.30.0 (``pip install -e '.[vllm,test]'``), and the Qwen3-Omni config and
tokenizer files (``load_format: dummy`` skips the weights; set OMNI_SERVE_QWEN3_OMNI to a
local copy of the checkpoint directory if the nodes have no Hugging Face access):

    OMNI_SERVE_QWEN3_OMNI=/models/Qwen3-Omni-30B-A3B-Instruct \\
        python -m pytest -m gpu tests/test_vllm_omni_gpu.py -x -v

Dummy weights produce garbage tokens, so the checks are on shapes and protocol: a text
reply with usage, and a 24 kHz mono WAV whose length is a whole number of codec frames less
the vocoder lag the code2wav engine measured at start (see tests/vocoder.py).
"""

from __future__ import annotations

import base64
import io
import os
import wave

import pytest
import torch

from tests.deps import require
from tests.vocoder import served_lag, whole_frames

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
]

MODEL = os.environ.get("OMNI_SERVE_QWEN3_OMNI", "Qwen/Qwen3-Omni-30B-A3B-Instruct")


def _dummy_weights(config: dict) -> None:
    app = config["applications"][0]
    app["args"]["served_model_name"] = "qwen3-omni"
    for stage in app["args"]["stages"]:
        stage["engine_args"]["model"] = MODEL
        stage["engine_args"]["engine"]["load_format"] = "dummy"
        stage["default_sampling"]["max_tokens"] = min(stage["default_sampling"].get("max_tokens", 256), 64)


@pytest.fixture(scope="module")
def qwen3_omni(graphs):
    require("vllm_omni", "pip install -e '.[vllm,test]'")
    if torch.cuda.device_count() < 2:
        pytest.skip("graphs/qwen3_omni.yaml places the stages on 2 GPUs")
    graphs.deploy("qwen3_omni.yaml", mutate=_dummy_weights)
    graphs.wait_healthy(timeout_s=1800)
    yield graphs
    graphs.delete()


def test_text_and_audio_chat_completion(qwen3_omni):
    from openai import OpenAI

    client = OpenAI(base_url=f"{qwen3_omni.base_url}/v1", api_key="unused", timeout=600)
    reply = client.chat.completions.create(
        model="qwen3-omni",
        messages=[{"role": "user", "content": "Say hello."}],
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
        max_tokens=16,
    )
    choice = reply.choices[0]
    assert reply.usage.completion_tokens > 0
    with wave.open(io.BytesIO(base64.b64decode(choice.message.audio.data))) as wav:
        assert wav.getframerate() == 24000 and wav.getnchannels() == 1
        assert wav.getnframes() > 0 and whole_frames(wav.getnframes(), served_lag(qwen3_omni)) > 0


def test_text_only_chat_completion(qwen3_omni):
    from openai import OpenAI

    client = OpenAI(base_url=f"{qwen3_omni.base_url}/v1", api_key="unused", timeout=600)
    before = {n: qwen3_omni.handle(n).stats.remote().result()["calls"] for n in ("talker", "code2wav")}
    reply = client.chat.completions.create(
        model="qwen3-omni", messages=[{"role": "user", "content": "Hi"}], modalities=["text"], max_tokens=8
    )
    assert reply.choices[0].message.audio is None
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
    after = {n: qwen3_omni.handle(n).stats.remote().result()["calls"] for n in ("talker", "code2wav")}
    assert after == before  # text-only requests never reach the audio stages
