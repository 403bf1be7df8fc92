"""graphs/qwen_image.yaml as shipped (diffusers family, encode -> denoise -> decode) on CUDA GPUs, over HTTP.

The one production GPU graph that needs neither vLLM nor a model hub: its stages are the diffusers
engine family, here loaded with the tiny random-weight Qwen-Image checkpoint (real diffusers and
transformers classes, built locally) instead of Qwen/Qwen-Image. What it checks that the CPU
tests cannot: Ray gives each stage replica a GPU (or a share of one), the engine puts its weights
there in bfloat16 ('auto'), and the CUDA handoffs (prompt embeddings, latents) cross the object
store between stage replicas and come out as a decodable PNG. One CUDA GPU of any size:

    python -m pytest -m gpu tests/test_diffusers_gpu.py -x -v

The shipped placement asks for 2 GPUs (encode 0.5 + denoise 1 + decode 0.5); with one visible
GPU the test scales the three shares down to fit it, and says so in its module fixture.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import graph_variant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODEL = "Qwen/Qwen-Image"  # the shipped graph's served name
STAGES = ("encode", "denoise", "decode")
BODY = {"model": MODEL, "prompt": "a red fox in the snow", "size": "64x48", "num_inference_steps": 4, "seed": 5}


def _shares() -> dict[str, float]:
    """The shipped GPU shares where 2 GPUs are visible; on one GPU, the same proportions in a quarter each."""
    if torch.cuda.device_count() >= 2:
        return {"encode": 0.5, "denoise": 1, "decode": 0.5}
    return {"encode": 0.25, "denoise": 0.5, "decode": 0.25}


@pytest.fixture(scope="module")
def qwen_image(graphs) -> Iterator:
    shares = _shares()
    mutate = graph_variant(
        fixed_replicas=1,
        # The session cluster has 4 CPUs; the shipped graph's 9 are for real Qwen-Image's data loading.
        deployments={"ingress": {"ray_actor_options": {"num_cpus": 0.1}}}
        | {name: {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": shares[name]}} for name in STAGES},
        engine_args={"*": {"model": "tiny"}},
    )
    graphs.deploy("qwen_image.yaml", mutate=mutate)
    graphs.wait_healthy(timeout_s=600)
    yield graphs
    graphs.delete()


def _png(reply: httpx.Response) -> bytes:
    assert reply.status_code == 200, reply.text
    [item] = reply.json()["data"]
    return base64.b64decode(item["b64_json"])


def test_every_stage_holds_its_weights_on_cuda(qwen_image) -> None:
    for name in STAGES:
        stats = qwen_image.handle(name).stats.remote().result()
        assert stats["device"] == "cuda", (name, stats)


def test_png_through_three_gpu_stages_same_seed_same_image(qwen_image) -> None:
    url = f"{qwen_image.base_url}/v1/images/generations"
    before = {n: qwen_image.handle(n).stats.remote().result()["calls"] for n in STAGES}
    png = _png(httpx.post(url, json=BODY, timeout=300))
    image = Image.open(io.BytesIO(png))  # Pillow decodes what the server's encoder wrote
    assert image.format == "PNG" and image.size == (64, 48) and image.mode == "RGB"
    assert np.asarray(image).std() > 0  # not a blank frame
    after = {n: qwen_image.handle(n).stats.remote().result()["calls"] for n in STAGES}
    assert all(after[n] > before[n] for n in STAGES), (before, after)  # every stage served it
    # bf16 CUDA kernels of one replica set are deterministic for one seed and size.
    assert _png(httpx.post(url, json=BODY, timeout=300)) == png
    assert _png(httpx.post(url, json={**BODY, "seed": 6}, timeout=300)) != png
