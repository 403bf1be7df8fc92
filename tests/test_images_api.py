"""Image generation end to end: `serve run graphs/tiny_image*.yaml`, real HTTP, the official client."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.conftest import graph_variant
from tests.invalid_params import IMAGE_GENERATION_CASES, Case, cases, check
from tests.playground_browser import browser as browser
from tests.playground_browser import driver as driver
from tests.playground_browser import page as page

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen-image"
BASE = {"prompt": "a red fox in the snow", "size": "64x48", "num_inference_steps": 2, "seed": 5}


@pytest.fixture(scope="module")
def tiny_image(graphs) -> Iterator:
    graphs.deploy("tiny_image.yaml")
    graphs.wait_healthy()
    yield graphs
    graphs.delete()


def generate(graphs, **body) -> httpx.Response:
    return httpx.post(f"{graphs.base_url}/v1/images/generations", json={**BASE, **body}, timeout=120)


def pngs(reply: httpx.Response) -> list[bytes]:
    assert reply.status_code == 200, reply.text
    return [base64.b64decode(item["b64_json"]) for item in reply.json()["data"]]


def pixels(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def test_png_of_requested_size_and_same_seed_same_bytes(tiny_image) -> None:
    first = generate(tiny_image)
    assert first.json()["created"] > 0 and first.headers["x-request-id"]
    [png] = pngs(first)
    assert pixels(png).shape == (48, 64, 3)
    assert pngs(generate(tiny_image)) == [png]
    assert pngs(generate(tiny_image, seed=6)) != [png]


def test_n_images_differ(tiny_image) -> None:
    images = pngs(generate(tiny_image, n=2, size="32x32"))
    assert len(images) == 2 and images[0] != images[1]
    assert [pixels(p).shape for p in images] == [(32, 32, 3)] * 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"size": "big"}, "size"),
        ({"size": "50x48"}, "size"),  # not a multiple of 16: checked by the diffusion stage
        ({"size": "1024x1024"}, "size"),  # over the graph's max_pixels
        ({"n": 5}, "n"),
        ({"n": 0}, "n"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"response_format": "url"}, "response_format"),
        ({"prompt": ""}, "prompt"),
        ({"style": "vivid"}, "style"),
    ],
)
def test_bad_inputs_get_400_naming_the_field(tiny_image, body: dict, field: str) -> None:
    reply = generate(tiny_image, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and error["message"].startswith(f"{field}: "), error


@cases(*IMAGE_GENERATION_CASES)
def test_vllm_omnis_invalid_image_generation_requests(tiny_image, case: Case) -> None:
    """vLLM-Omni's own suite for this route (tests/test_vllm_omni_invalid_params.py has the cases)."""
    check(tiny_image.base_url, "/v1/images/generations", case)


def test_unknown_model_is_404(tiny_image) -> None:
    assert generate(tiny_image, model="dall-e-3").status_code == 404


def test_openai_client_images_generate(tiny_image) -> None:
    client = openai.OpenAI(base_url=f"{tiny_image.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.images.generate(
        model=MODEL,
        prompt=BASE["prompt"],
        n=1,
        size="64x48",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 5},
    )
    png = base64.b64decode(reply.data[0].b64_json)
    assert png == pngs(generate(tiny_image))[0]


def test_chat_completion_returns_image_url_part(tiny_image) -> None:
    client = openai.OpenAI(base_url=f"{tiny_image.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a red fox"}], modalities=["image"], seed=5
    )
    [part] = reply.choices[0].message.content
    url = part["image_url"]["url"]
    assert part["type"] == "image_url" and url.startswith("data:image/png;base64,")
    assert pixels(base64.b64decode(url.split(",", 1)[1])).shape == (64, 64, 3)  # the graph's default size


def streamed_chat(graphs) -> list[dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a red fox"}], "modalities": ["image"], "seed": 5}
    with httpx.stream("POST", f"{graphs.base_url}/v1/chat/completions", json={**body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    [image] = [c for c in chunks if c.get("modality") == "image"]
    [part] = image["choices"][0]["delta"]["content"]
    assert part["image_url"]["url"].startswith("data:image/png;base64,")
    # A graph without a text stage still ends its stream with an OpenAI finish reason.
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]
    return chunks


def test_streamed_chat_carries_the_image(tiny_image) -> None:
    streamed_chat(tiny_image)


def test_images_are_counted(tiny_image) -> None:
    from tests.metrics import caught_up, settled, total

    before = total(settled(), "ray_omni_stage_images_total")
    assert len(pngs(generate(tiny_image, n=3, size="32x32"))) == 3
    caught_up(
        lambda m: total(m, "ray_omni_stage_images_total") - before == 3 or total(m, "ray_omni_stage_images_total")
    )


def test_three_stage_graph_gives_the_same_image(tiny_image) -> None:
    """It replaces the one-stage graph with encode -> denoise -> decode (the keyed tests below run on it)."""
    request = {"negative_prompt": "blurry", "guidance_scale": 3.0, "n": 2}
    expected = pngs(generate(tiny_image, **request))
    tiny_image.delete()
    tiny_image.deploy("tiny_image_3stage.yaml")
    tiny_image.wait_healthy()
    assert httpx.get(f"{tiny_image.base_url}/v1/models").json()["data"][0]["stages"] == ["encode", "denoise", "decode"]
    assert pngs(generate(tiny_image, **request)) == expected
    # Handoffs went replica to replica: the ingress never loaded one, the decode stage did.
    assert tiny_image.handle("ingress").payload_loads.remote().result() == {}
    assert tiny_image.handle("decode").stats.remote().result()["payload_loads"] == {"qwen_image.latents": 1}
    assert generate(tiny_image, size="50x48").json()["error"]["param"] == "size"
    streamed_chat(tiny_image)


# ---- the playground on a keyed graph: last, on the three-stage graph the test above left (the key is an ingress
# argument, so Serve restarts only the ingress: the stages keep running) ----------------------------------------

KEY = "sk-playground"


@pytest.fixture(scope="module")
def keyed_image(tiny_image) -> Any:
    tiny_image.deploy("tiny_image_3stage.yaml", graph_variant(args={"api_key": KEY}))
    tiny_image.wait_healthy()
    return tiny_image


def test_image_generation_renders_the_generated_png(keyed_image, page) -> None:  # noqa: F811
    from tests.playground_browser import TIMEOUT_MS, report, shot

    page.goto(f"{keyed_image.base_url}/")
    page.wait_for_selector("#error:not([hidden])")
    assert "API key" in page.inner_text("#error")  # the card needs the key
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#images:not([hidden])")
    page.wait_for_selector('#stages tr[data-stage="denoise"]:not([data-running="0"])', timeout=TIMEOUT_MS)
    assert page.is_hidden("#chat") and page.is_hidden("#speech")

    page.fill("#image-prompt", "a red fox in the snow")
    page.fill("#image-size", "64x48")
    page.fill("#image-steps", "2")
    page.fill("#image-seed", "7")
    with page.expect_response("**/v1/images/generations") as response:
        page.click("#generate")
    assert response.value.request.headers["authorization"] == f"Bearer {KEY}"
    data = report(page, "#image-metrics")
    assert data["images"] == "1" and data["size"] == "64×48"
    png = base64.b64decode(response.value.json()["data"][0]["b64_json"])
    sent = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)
    assert sent.shape == (48, 64, 3)
    shown = shot(page.locator("#gallery img").first)
    assert shown.std() > 5  # not a blank box
    # The page draws the PNG the server made, pixel for pixel (a fractional layout position can add a
    # row or column of background to the element's screenshot).
    assert 0 <= shown.shape[0] - 48 <= 1 and 0 <= shown.shape[1] - 64 <= 1
    offsets = [(dy, dx) for dy in range(shown.shape[0] - 47) for dx in range(shown.shape[1] - 63)]
    assert min(np.abs(shown[dy : dy + 48, dx : dx + 64] - sent).mean() for dy, dx in offsets) < 2


def test_stage_report_needs_the_key(keyed_image) -> None:
    url = f"{keyed_image.base_url}/stages"
    assert httpx.get(url, timeout=30).status_code == 401
    report = httpx.get(url, headers={"authorization": f"Bearer {KEY}"}, timeout=30).json()
    denoise = next(s for s in report["stages"] if s["name"] == "denoise")
    assert report["status"] == "RUNNING" and denoise["status"] == "HEALTHY" and denoise["running"] >= 1
