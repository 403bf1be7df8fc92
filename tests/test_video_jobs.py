"""The video jobs' bookkeeping (omni_serve.api.video_jobs) over a stand-in stage transport, in process.

What only the bookkeeping decides, checked without a cluster: the bounds (jobs and bytes, failed jobs and
jobs in flight), the jobs' own queue and deadline, expiry, owners, progress, failures, paging, run-time
settings and a delete that cancels the running call. The real path (Serve, the Wan stage, the actor, HTTP
and the official client, a key rotated, a dead actor replaced) is tests/test_videos.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import pytest
from ray.serve.exceptions import BackPressureError

from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.videos import VideoCreateRequest, VideoJob, input_reference, job_error
from omni_serve.api.video_jobs import (
    VideoJobs,
    actor_key_in,
    actor_key_of,
    actor_name,
    mp4_bound,
    new_job_id,
    owner_of,
    unpack,
)
from omni_serve.exceptions import InvalidStageInput
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.transport import StageTransport
from omni_serve.types import FinishReason, Modality, SamplingParams, StageOutput, StageRequest, VideoParams, VideoRules

KEY = "ab" * 16
PARAMS = VideoParams(width=64, height=64, num_frames=9, fps=8, num_inference_steps=2, guidance_scale=4.0)
BOUND = mp4_bound(PARAMS)  # what a job in flight counts against max_bytes
RULES = VideoRules(
    defaults=PARAMS, size_multiple=32, frame_multiple=4, max_pixels=65536, max_frames=33, max_inference_steps=200
)
GRAPH: dict[str, Any] = {
    "served_model_name": "v",
    "videos": {"max_jobs": 3, "max_bytes": 3 * BOUND, "ttl_s": 1.0},
    "stages": [
        {"name": "video", "engine": "vllm_omni_diffusion", "engine_args": {"model": "m"}, "final_output": "video"}
    ],
}


class Stand_in(StageTransport):
    """The video stage: progress 0, then the video (``size`` bytes) when released; or a failure."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: list[str] = []
        self.cancelled: list[str] = []
        self.size = 1000
        self.fail: Exception | None = None
        self.refuse = 0  # calls refused as overloaded (Serve's queue full) before any is taken
        self.silent_s = 0.0  # how long the stage says nothing after its progress 0 (a Wan forward)

    async def voices(self, stage: str) -> list[str]:
        return []

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
        if self.refuse > 0:
            self.refuse -= 1
            raise BackPressureError(16, 16, retry_after_s=0)
        self.calls.append(request.request_id)
        try:
            yield StageOutput(stage=stage, progress=0.0)
            await self.release.wait()
            await asyncio.sleep(self.silent_s)
            if self.fail is not None:
                raise self.fail
            yield StageOutput(stage=stage, progress=0.5)
            video = np.zeros(self.size, dtype=np.uint8)
            yield StageOutput(stage=stage, video=video, progress=1.0, finished=True, finish_reason=FinishReason.STOP)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


def job(owner: str = "me", n: int = 0) -> tuple[VideoJob, OmniRequest]:
    request = OmniRequest(
        request_id=f"r{n}", modalities={Modality.VIDEO}, sampling={"video": SamplingParams()}, video=PARAMS
    )
    video = VideoJob(id=new_job_id(KEY), owner=owner, model="v", prompt="p", params=PARAMS, created_at=int(time.time()))
    return video, request


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def run(test: Any = None, **videos: Any) -> Any:
    """A test of a VideoJobs over a stand-in stage, the graph's ``videos`` limits updated by ``videos``."""

    def decorate(test: Any) -> Any:
        def wrapper() -> None:
            stage = Stand_in()
            graph = {**GRAPH, "videos": {**GRAPH["videos"], **videos}}
            asyncio.run(test(VideoJobs(graph, stage), stage))

        wrapper.__name__ = test.__name__
        return wrapper

    return decorate(test) if test is not None else decorate


@run
async def test_a_job_is_queued_then_in_progress_then_completed_by_reference(jobs: VideoJobs, stage: Stand_in) -> None:
    video, request = job()
    created = unpack(await jobs.create(video, request))["job"]
    assert (created["status"], created["progress"], created["completed_at"]) == ("queued", 0, None)
    assert created["size"] == "64x64" and created["seconds"] == "1" and created["object"] == "video"
    await settle()
    assert unpack(jobs.get(video.id, "me"))["job"]["status"] == "in_progress"
    with pytest.raises(APIError, match="in progress") as refused:
        unpack(jobs.content(video.id, "me"))
    assert refused.value.status == 409
    stage.release.set()
    await settle()
    done = unpack(jobs.get(video.id, "me"))["job"]
    assert (done["status"], done["progress"]) == ("completed", 100)
    assert done["completed_at"] < done["expires_at"] <= done["completed_at"] + 2  # ttl 1 s, whole seconds
    [result] = unpack(jobs.content(video.id, "me"))["result"]
    assert result.nbytes == 1000 and jobs.stats()["bytes"] == 1000


@run
async def test_another_client_sees_no_job(jobs: VideoJobs, stage: Stand_in) -> None:
    alice, bob = owner_of("alice", "Bearer a-key"), owner_of("bob", "Bearer b-key")
    video, request = job(owner=alice)
    unpack(await jobs.create(video, request))
    for call in (jobs.get(video.id, bob), jobs.content(video.id, bob)):
        with pytest.raises(APIError) as refused:
            unpack(call)
        assert (refused.value.status, refused.value.code) == (404, "video_not_found")
    with pytest.raises(APIError, match="no video"):
        unpack(await jobs.delete(video.id, bob))
    # The client is its name, not its key: alice with her rotated key sees her job.
    assert unpack(jobs.get(video.id, owner_of("alice", "Bearer a-new-key")))["job"]["id"] == video.id
    assert stage.cancelled == []  # bob's delete touched nothing


def test_keyless_graphs_keep_jobs_apart_by_token_and_keyed_ones_by_client() -> None:
    assert owner_of("", "Bearer x") == owner_of("", "bearer  x") != owner_of("", "Bearer y")
    assert owner_of("alice", "Bearer x") == owner_of("alice", "Bearer y") != owner_of("", "Bearer x")


@run
async def test_max_jobs_refuses_with_429_and_delete_cancels_the_running_call(jobs: VideoJobs, stage: Stand_in) -> None:
    made = [job(n=n) for n in range(3)]
    for video, request in made:
        unpack(await jobs.create(video, request))
    await settle()
    with pytest.raises(APIError, match="videos.max_jobs") as refused:
        unpack(await jobs.create(*job(n=9)))
    assert (refused.value.status, refused.value.code, refused.value.retry_after_s) == (429, "video_jobs_full", 5)
    answer = unpack(await jobs.delete(made[0][0].id, "me"))["job"]
    assert answer == {"id": made[0][0].id, "object": "video.deleted", "deleted": True}
    assert stage.cancelled == ["r0/video"]  # its stage call was cancelled (the stage aborts its engine request)
    unpack(await jobs.create(*job(n=3)))  # room again
    assert jobs.stats()["jobs"] == 3


@run(max_jobs=10, max_bytes=2 * BOUND)
async def test_max_bytes_counts_jobs_in_flight_and_an_admitted_job_never_fails_for_it(
    jobs: VideoJobs, stage: Stand_in
) -> None:
    first, second = job(n=1), job(n=2)
    unpack(await jobs.create(*first))
    unpack(await jobs.create(*second))
    assert jobs.stats()["bytes"] == 2 * BOUND  # nothing made yet: both reserved at their bound
    with pytest.raises(APIError, match="videos.max_bytes") as refused:
        unpack(await jobs.create(*job(n=3)))  # refused now, not failed after its whole run
    assert (refused.value.status, refused.value.code) == (429, "video_jobs_full")
    stage.size = BOUND  # as big as its bound: it fits where it was reserved
    stage.release.set()
    await settle()
    assert [unpack(jobs.get(v.id, "me"))["job"]["status"] for v, _ in (first, second)] == ["completed"] * 2
    assert jobs.stats()["bytes"] == 2 * BOUND
    unpack(await jobs.delete(first[0].id, "me"))
    unpack(await jobs.create(*job(n=4)))  # room again


@run
async def test_finished_jobs_expire_and_free_their_video(jobs: VideoJobs, stage: Stand_in) -> None:
    video, request = job()
    stage.release.set()
    unpack(await jobs.create(video, request))
    await settle()
    assert unpack(jobs.get(video.id, "me"))["job"]["status"] == "completed" and video.id in jobs.results
    assert video.ended is not None
    await asyncio.sleep(video.ended + 1.0 - time.time() + 0.05)  # past its ttl_s
    with pytest.raises(APIError, match="expired"):
        unpack(jobs.get(video.id, "me"))
    assert video.id not in jobs.results and jobs.stats()["jobs"] == 0


@run
async def test_a_failed_stage_fails_the_job_with_the_api_error(jobs: VideoJobs, stage: Stand_in) -> None:
    stage.fail = InvalidStageInput("num_frames: must be 4 x k + 1")
    video, request = job()
    unpack(await jobs.create(video, request))
    stage.release.set()
    await settle()
    failed = unpack(jobs.get(video.id, "me"))["job"]
    assert failed["status"] == "failed" and failed["error"]["param"] == "num_frames"
    assert failed["error"]["code"] == "invalid_request_error" and failed["completed_at"] is not None


def test_job_ids_name_their_actor_and_nothing_else_parses() -> None:
    video_id = new_job_id(KEY)
    assert actor_key_of(video_id) == KEY and new_job_id(KEY) != video_id
    for other in ("video_x", f"video_{KEY}", "../etc", f"vid_{KEY}{'0' * 24}"):
        assert actor_key_of(other) is None


def test_form_fields_map_to_video_params() -> None:
    defaults = PARAMS.model_copy(update={"width": 32, "height": 32, "fps": 16, "num_frames": 17})
    assert VideoCreateRequest(prompt="p").video_params(defaults) == defaults
    from_seconds = VideoCreateRequest.model_validate({"prompt": "p", "seconds": "2", "size": "96x64"})
    params = from_seconds.video_params(defaults)
    assert (params.width, params.height, params.num_frames, params.fps) == (96, 64, 33, 16)  # 2 s x 16 fps + 1
    explicit = VideoCreateRequest.model_validate({"prompt": "p", "seconds": "2", "num_frames": "9", "fps": "8"})
    assert (explicit.video_params(defaults).num_frames, explicit.video_params(defaults).fps) == (9, 8)
    text_to_video, image_to_video = RULES, RULES.model_copy(update={"takes_image": True})
    assert input_reference({}, text_to_video) is None and input_reference({"input_reference": b"png"}, image_to_video)
    for files, rules in (({"input_reference": b"png"}, text_to_video), ({}, image_to_video)):
        with pytest.raises(APIError, match="input_reference") as refused:
            input_reference(files, rules)
        assert refused.value.param == "input_reference"
    with pytest.raises(APIError, match="mask: unknown field"):
        input_reference({"mask": b"png"}, image_to_video)
    assert job_error(APIError(400, "size: no", type="invalid_request_error", param="size"))["param"] == "size"


@run
async def test_failed_jobs_hold_no_slot_and_the_oldest_go_past_max_jobs(jobs: VideoJobs, stage: Stand_in) -> None:
    stage.fail = InvalidStageInput("num_frames: must be 4 x k + 1")
    stage.release.set()
    failed = [job(n=n) for n in range(5)]
    for video, request in failed:  # max_jobs is 3: each create after a failure still gets in
        unpack(await jobs.create(video, request))
        await settle()
    assert jobs.stats()["failed"] == 3  # the three newest failures kept to be read, the oldest dropped
    with pytest.raises(APIError, match="no video"):
        unpack(jobs.get(failed[0][0].id, "me"))
    assert unpack(jobs.get(failed[4][0].id, "me"))["job"]["status"] == "failed"
    stage.fail = None
    for n in range(5, 8):  # three jobs that hold slots, beside the three failed ones
        unpack(await jobs.create(*job(n=n)))
    with pytest.raises(APIError, match="videos.max_jobs"):
        unpack(await jobs.create(*job(n=9)))


@run(max_running=1, max_jobs=5, max_bytes=5 * BOUND)
async def test_jobs_past_max_running_wait_in_the_actors_queue(jobs: VideoJobs, stage: Stand_in) -> None:
    made = [job(n=n) for n in range(3)]
    for video, request in made:
        unpack(await jobs.create(video, request))
    await settle()
    assert stage.calls == ["r0/video"] and jobs.stats()["waiting"] == 2  # one at the stage, two queued here
    assert [unpack(jobs.get(v.id, "me"))["job"]["status"] for v, _ in made] == ["in_progress", "queued", "queued"]
    unpack(await jobs.delete(made[1][0].id, "me"))  # deleted while queued here: it never reaches the stage
    stage.release.set()
    await settle()
    assert stage.calls == ["r0/video", "r2/video"]
    assert unpack(jobs.get(made[2][0].id, "me"))["job"]["status"] == "completed" and jobs.stats()["running"] == 0


@run
async def test_a_job_the_stage_refuses_as_overloaded_stays_queued_and_runs_later(
    jobs: VideoJobs, stage: Stand_in
) -> None:
    stage.refuse = 1  # Serve's queue of the stage is full once (its max_queued_requests)
    stage.release.set()
    video, request = job()
    unpack(await jobs.create(video, request))
    await settle()
    assert unpack(jobs.get(video.id, "me"))["job"]["status"] == "queued" and stage.calls == []
    await asyncio.sleep(1.2)  # the stage's Retry-After, at least a second
    await settle()
    assert unpack(jobs.get(video.id, "me"))["job"]["status"] == "completed" and stage.calls == ["r0/video"]


def test_a_job_may_stay_silent_past_stage_timeout_s_within_job_timeout_s() -> None:
    """A Wan forward says nothing between admitting the job and its MP4: the graph's stage_timeout_s (a silence limit
    for replies to HTTP requests) is not a job's; videos.job_timeout_s is."""

    async def scenario() -> None:
        stage = Stand_in()
        graph = {**GRAPH, "stage_timeout_s": 0.1, "videos": {**GRAPH["videos"], "job_timeout_s": 5.0}}
        jobs = VideoJobs(graph, stage)
        stage.release.set()
        stage.silent_s = 0.4
        video, request = job()
        unpack(await jobs.create(video, request))
        await asyncio.sleep(0.7)
        assert unpack(jobs.get(video.id, "me"))["job"]["status"] == "completed"

    asyncio.run(scenario())


def test_a_job_past_job_timeout_s_fails_with_504_naming_it() -> None:
    async def scenario() -> None:
        stage = Stand_in()
        graph = {**GRAPH, "stage_timeout_s": 100, "videos": {**GRAPH["videos"], "job_timeout_s": 0.2}}
        jobs = VideoJobs(graph, stage)
        stage.release.set()
        stage.silent_s = 2.0
        video, request = job()
        unpack(await jobs.create(video, request))
        await asyncio.sleep(0.5)
        failed = unpack(jobs.get(video.id, "me"))["job"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "timeout"
        assert "videos.job_timeout_s (0.2 s)" in failed["error"]["message"]

    asyncio.run(scenario())


@run(max_running=1, max_jobs=5, max_bytes=5 * BOUND)
async def test_reconfigure_takes_the_new_limits(jobs: VideoJobs, stage: Stand_in) -> None:
    made = [job(n=n) for n in range(2)]
    for video, request in made:
        unpack(await jobs.create(video, request))
    await settle()
    assert len(stage.calls) == 1
    videos = {**GRAPH["videos"], "max_running": 2, "max_jobs": 5, "max_bytes": 5 * BOUND, "job_timeout_s": 42}
    jobs.reconfigure({**GRAPH, "videos": videos})
    await settle()
    assert len(stage.calls) == 2  # the queued one went as soon as there was room
    assert jobs.limits.job_timeout_s == 42 and jobs.serving.orchestrator.stage_timeout_s == 42


@run(max_jobs=10, max_bytes=10 * BOUND)
async def test_a_list_page_is_positions_past_the_cursor_then_those_jobs_alone(jobs: VideoJobs, stage: Stand_in) -> None:
    made = []
    for n in range(5):
        video, request = job(n=n)
        video.created_at += n  # one a second
        made.append(video)
        unpack(await jobs.create(video, request))
    unpack(await jobs.create(*job(owner="other", n=9)))
    newest = jobs.page("me", 2, descending=True)
    assert newest == [[made[4].created_at, made[4].id], [made[3].created_at, made[3].id]]
    after = jobs.position(made[3].id, "me")
    assert jobs.page("me", 10, descending=True, after=after) == [[v.created_at, v.id] for v in made[2::-1]]
    assert jobs.page("me", 2, descending=False, after=after) == [[made[4].created_at, made[4].id]]
    assert jobs.position(made[3].id, "other") is None
    listed = jobs.listed([made[4].id, made[0].id], "me")
    assert [v["id"] for v in listed] == [made[4].id, made[0].id] and jobs.listed([made[4].id], "other") == []


def test_actor_names_are_scoped_to_their_serve_application() -> None:
    name = actor_name("omni", KEY)
    assert actor_key_in(name, "omni") == KEY
    for app in ("other", "omn", "omni:x"):
        assert actor_key_in(name, app) is None
    assert actor_key_in(actor_name("omni:x", KEY), "omni") is None  # a longer app name is another app
    assert actor_key_in(f"{actor_name('omni', KEY)}0", "omni") is None and actor_key_in(None, "omni") is None
