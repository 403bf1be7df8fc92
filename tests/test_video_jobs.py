"""The video jobs' bookkeeping (omni_serve.api.video_jobs) over a stand-in stage transport, in process.

What only the bookkeeping decides, checked without a cluster: the bounds (jobs and bytes), expiry, owners,
progress, failures and a delete that cancels the running call. The real path (Serve, the Wan stage, the
actor, HTTP and the official client) is tests/test_videos.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import pytest

from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.videos import VideoCreateRequest, VideoJob, job_error, refuse_files
from omni_serve.api.video_jobs import VideoJobs, actor_key_of, new_job_id, owner_of, unpack
from omni_serve.graph.orchestrator import OmniRequest
from omni_serve.graph.transport import StageTransport
from omni_serve.types import (
    FinishReason,
    InvalidStageInput,
    Modality,
    SamplingParams,
    StageOutput,
    StageRequest,
    VideoParams,
)

KEY = "ab" * 16
PARAMS = VideoParams(width=64, height=64, num_frames=9, fps=8, num_inference_steps=2, guidance_scale=4.0)
GRAPH = {
    "served_model_name": "v",
    "videos": {"max_jobs": 3, "max_bytes": 2500, "ttl_s": 1.0},
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

    async def voices(self, stage: str) -> list[str]:
        return []

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncGenerator[StageOutput, None]:
        self.calls.append(request.request_id)
        try:
            yield StageOutput(stage=stage, progress=0.0)
            await self.release.wait()
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


def run(test: Any) -> Any:
    def wrapper() -> None:
        stage = Stand_in()
        asyncio.run(test(VideoJobs(GRAPH, stage), stage))

    wrapper.__name__ = test.__name__
    return wrapper


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
async def test_another_key_sees_no_job(jobs: VideoJobs, stage: Stand_in) -> None:
    video, request = job(owner=owner_of("Bearer alice"))
    unpack(await jobs.create(video, request))
    for call in (jobs.get(video.id, owner_of("Bearer bob")), jobs.content(video.id, owner_of("Bearer bob"))):
        with pytest.raises(APIError) as refused:
            unpack(call)
        assert (refused.value.status, refused.value.code) == (404, "video_not_found")
    with pytest.raises(APIError, match="no video"):
        unpack(await jobs.delete(video.id, owner_of("Bearer bob")))
    assert unpack(jobs.get(video.id, owner_of("Bearer alice")))["job"]["id"] == video.id
    assert stage.cancelled == []  # bob's delete touched nothing


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


@run
async def test_max_bytes_fails_the_job_that_would_pass_it_and_refuses_creates(jobs: VideoJobs, stage: Stand_in) -> None:
    first, second = job(n=1), job(n=2)
    stage.size = 1500
    unpack(await jobs.create(*first))
    unpack(await jobs.create(*second))
    stage.release.set()
    await settle()
    statuses = sorted(unpack(jobs.get(v.id, "me"))["job"]["status"] for v, _ in (first, second))
    assert statuses == ["completed", "failed"]  # 1500 + 1500 > 2500
    failed = next(unpack(jobs.get(v.id, "me"))["job"] for v, _ in (first, second) if v.id not in jobs.results)
    assert failed["error"]["code"] == "video_jobs_full" and "videos.max_bytes" in failed["error"]["message"]
    unpack(await jobs.delete(failed["id"], "me"))
    stage.size = 1000
    unpack(await jobs.create(*job(n=3)))  # 1500 held < 2500: accepted
    await settle()
    with pytest.raises(APIError, match="videos.max_bytes"):
        unpack(await jobs.create(*job(n=4)))  # 2500 held: refused


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
    with pytest.raises(APIError, match="input_reference"):
        refuse_files({"input_reference": b"png"})
    assert job_error(APIError(400, "size: no", type="invalid_request_error", param="size"))["param"] == "size"
