"""OpenAI's video API (``/v1/videos``): the create form, the ``Video`` job object, the delete reply.

Pure models and builders (importable without Ray); the job runs in :mod:`omni_serve.api.video_jobs`.
The form is OpenAI's (``prompt``, ``model``, ``seconds``, ``size``; the official client sends it as
multipart) plus the generation fields vLLM-Omni's ``/v1/videos`` takes under the same names
(``num_frames``, ``fps``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``seed``).
``input_reference`` (OpenAI's image-to-video upload) is the image a stage that animates one takes (vLLM-Omni's
``/v1/videos`` passes it to the pipeline the same way), a chat image part by another name, required there and
refused elsewhere. The frame count
is ``num_frames``, or ``seconds`` x ``fps`` + 1 (the frames spanning that many seconds); the stage
checks it against what the model can make (Wan 2.2: 4k + 1) and refuses the rest naming the field.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from omni_serve.api.openai.errors import APIError, bad_request
from omni_serve.api.openai.messages import FORM, _Strict, not_blank
from omni_serve.models import video_params
from omni_serve.types import ChatMessage, MediaPart, Modality, TextPart, VideoParams, VideoRules

if TYPE_CHECKING:
    from starlette.requests import Request

    from omni_serve.api.openai.route import RouteContext
    from omni_serve.graph.request import OmniRequest

_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_SIDE = 4096
MAX_SECONDS = 600.0
JobStatus = Literal["queued", "in_progress", "completed", "failed"]


class VideoCreateRequest(_Strict):
    """The create form's fields (values arrive as strings; pydantic converts them)."""

    model_config = FORM
    prompt: str = Field(min_length=1, description="What to film.")
    model: str | None = None
    seconds: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="Clip length; frames = seconds x fps + 1 unless num_frames is given."
    )
    size: str | None = Field(None, description="'WIDTHxHEIGHT' in pixels (default: the stage's).")
    num_frames: int | None = Field(None, ge=1, description="Frames to generate (wins over seconds).")
    fps: float | None = Field(None, gt=0, le=120, description="Frames per second of the MP4 (default: the stage's).")
    num_inference_steps: int | None = Field(None, ge=1, le=200, description="Denoising steps.")
    guidance_scale: float | None = Field(None, ge=0.0, le=20.0, description="Classifier-free guidance scale.")
    negative_prompt: str | None = Field(None, description="What to steer away from (with guidance_scale > 1).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same video.")
    user: str | None = None  # accepted for client compatibility; not used

    @field_validator("prompt")
    @classmethod
    def _something_to_film(cls, prompt: str) -> str:
        return not_blank(prompt)

    @field_validator("size")
    @classmethod
    def _size(cls, size: str | None) -> str | None:
        if size is None:
            return None
        match = _SIZE.match(size)
        if not match:
            raise ValueError("must be 'WIDTHxHEIGHT', e.g. '1280x704'")
        if not all(1 <= int(side) <= MAX_SIDE for side in match.groups()):
            raise ValueError(f"width and height must be in [1, {MAX_SIDE}]")
        return size

    def messages(self, image: MediaPart | None) -> list[ChatMessage]:
        if image is None:
            return [ChatMessage(role="user", content=self.prompt)]
        return [ChatMessage(role="user", content=[image, TextPart(text=self.prompt)])]

    def video_params(self, defaults: VideoParams) -> VideoParams:
        """What the stage is asked for: the request's values over the stage's defaults."""
        width, height = (int(side) for side in self.size.split("x")) if self.size else (defaults.width, defaults.height)
        fps = self.fps or defaults.fps
        if self.num_frames is not None:
            frames = self.num_frames
        elif self.seconds is not None:
            frames = round(self.seconds * fps) + 1
        else:
            frames = defaults.num_frames
        return VideoParams(
            width=width,
            height=height,
            num_frames=frames,
            fps=fps,
            num_inference_steps=self.num_inference_steps or defaults.num_inference_steps,
            guidance_scale=defaults.guidance_scale if self.guidance_scale is None else self.guidance_scale,
            negative_prompt=self.negative_prompt,
            seed=self.seed,
        )


def input_reference(files: dict[str, bytes], rules: VideoRules) -> bytes | None:
    """The create form's one file: the image an image-to-video stage animates, required by it and refused by a
    text-to-video one (which would ignore it); any other file is an unknown field."""
    for name in files:
        if name != "input_reference":
            raise bad_request(f"{name}: unknown field", name)
    image = files.get("input_reference")
    if image is not None and not rules.takes_image:
        raise bad_request("input_reference: not supported (this graph generates video from text)", "input_reference")
    if image is None and rules.takes_image:
        raise bad_request(
            "input_reference: this graph animates an image: send it as the multipart file 'input_reference'",
            "input_reference",
        )
    return image


@dataclass
class VideoJob:
    """One job's state as the API reports it (the result itself is an ObjectRef the jobs actor holds)."""

    id: str
    owner: str  # the client that created it (omni_serve.api.video_jobs.owner_of): another sees no such job
    model: str
    prompt: str
    params: VideoParams
    created_at: int
    status: JobStatus = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, Any] | None = None
    result_bytes: int = 0
    ended: float | None = None  # time.time() when it completed or failed; it expires ttl_s later

    def seconds(self) -> str:
        """The clip's length as OpenAI reports it: (frames - 1) / fps, the time its frames span."""
        return f"{(self.params.num_frames - 1) / self.params.fps:g}"

    def json(self) -> dict[str, Any]:
        """OpenAI's ``Video`` object."""
        return {
            "id": self.id,
            "object": "video",
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "model": self.model,
            "prompt": self.prompt,
            "progress": self.progress,
            "seconds": self.seconds(),
            "size": f"{self.params.width}x{self.params.height}",
            "status": self.status,
            "error": self.error,
            "remixed_from_video_id": None,
        }


def job_error(error: APIError) -> dict[str, Any]:
    """A failed job's ``error`` (OpenAI's ``VideoCreateError``): the API error it would have been as a reply."""
    return {"code": error.code or error.type, "message": error.message, "param": error.param, "type": error.type}


def deleted(video_id: str) -> dict[str, Any]:
    return {"id": video_id, "object": "video.deleted", "deleted": True}


def not_found(video_id: str) -> APIError:
    """The one answer for a job that does not exist, expired, was deleted, is another client's, or was lost."""
    return APIError(
        404,
        f"no video '{video_id:.80}' (it expired, was deleted, or was lost with the ingress replica or jobs actor "
        "that ran it)",
        type="invalid_request_error",
        param="video_id",
        code="video_not_found",
    )


def list_query(query: Mapping[str, str]) -> tuple[int, bool, str | None]:
    """The list's ``limit`` (1-100, 20), whether ``order`` is ``desc`` (the default; or ``asc``) and ``after``
    (a job id), read by the route after the key is checked: a bad one is a 400 naming it."""
    raw = query.get("limit", "20")
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 100:
        raise bad_request(f"limit: an integer in [1, 100] (got '{raw:.20}')", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order: 'asc' or 'desc' (got '{order:.20}')", "order")
    return int(raw), order == "desc", query.get("after")


def video_list(page: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list of ``Video`` objects."""
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": has_more,
    }


def video_request(
    body: VideoCreateRequest,
    image: MediaPart | None,
    rules: VideoRules,
    owner: str,
    http: Request,
    route: RouteContext,
) -> tuple[OmniRequest, VideoJob]:
    """The create body (and the image it animates, the checked upload) as the graph's request and the job that will
    run it: the request's values over the video stage's defaults, checked against its rules (a 400 naming the
    field, before any job exists); the image travels by reference to the stage, which decodes it."""
    params = body.video_params(rules.defaults)
    video_params.check(params, rules)
    omni = route.request(
        http,
        modalities={Modality.VIDEO},
        sampling=route.sampling_defaults(body.seed),
        messages=body.messages(image),
        video=params,
    )
    omni.deadline = None  # a job is not bound by this HTTP request's time limit: its own (videos.job_timeout_s)
    job = VideoJob(
        id="", owner=owner, model=route.model, prompt=body.prompt, params=params, created_at=int(time.time())
    )
    return omni, job
