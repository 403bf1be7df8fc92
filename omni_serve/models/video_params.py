"""Video request parameters as diffusion engines check them: the rules of :mod:`.image_params`, plus frames.

A video DiT's VAE compresses time by a factor (Wan 2.2: 4) and space by another times the transformer's
patch (Wan 2.2 TI2V: 16 x 2), so only some frame counts and sizes exist; vLLM-Omni rounds others down
silently (``pipeline_wan2_2.py``), here they are refused naming the field and the values that work. The
stage states its rules (:class:`~omni_serve.types.VideoRules`), so the ingress checks a job's request
before it creates the job, and the stage checks it again before its engine runs.
"""

from __future__ import annotations

import secrets
from typing import Protocol

from omni_serve.exceptions import InvalidStageInput
from omni_serve.models.image_params import SEED_MOD
from omni_serve.types import StageRequest, VideoParams, VideoRules

MAX_FPS = 120.0


class VideoLimits(Protocol):
    """The engine-args fields a video engine family declares."""

    default_width: int
    default_height: int
    default_num_frames: int
    default_fps: float
    default_num_inference_steps: int
    default_guidance_scale: float
    max_pixels: int
    max_frames: int
    max_inference_steps: int


def rules(limits: VideoLimits, size_multiple: int, frame_multiple: int, takes_image: bool = False) -> VideoRules:
    """A stage's rules: its engine args' defaults and maxima, the checkpoint's multiples, whether it animates an
    image."""
    defaults = VideoParams(
        width=limits.default_width,
        height=limits.default_height,
        num_frames=limits.default_num_frames,
        fps=limits.default_fps,
        num_inference_steps=limits.default_num_inference_steps,
        guidance_scale=limits.default_guidance_scale,
    )
    return VideoRules(
        defaults=defaults,
        size_multiple=size_multiple,
        frame_multiple=frame_multiple,
        max_pixels=limits.max_pixels,
        max_frames=limits.max_frames,
        max_inference_steps=limits.max_inference_steps,
        takes_image=takes_image,
    )


def check(params: VideoParams, rules: VideoRules) -> None:
    """Raise :class:`InvalidStageInput` (its message starting with the field) unless the stage can make ``params``."""
    m, f = rules.size_multiple, rules.frame_multiple
    size = f"{params.width}x{params.height}"
    if params.width < m or params.height < m or params.width % m or params.height % m:
        raise InvalidStageInput(f"size: width and height must be positive multiples of {m} (got {size})")
    if params.width * params.height > rules.max_pixels:
        raise InvalidStageInput(f"size: at most {rules.max_pixels} pixels a frame (got {size})")
    if not 1 <= params.num_frames <= rules.max_frames or (params.num_frames - 1) % f:
        raise InvalidStageInput(
            f"num_frames: must be {f} x k + 1 and at most {rules.max_frames} (1, {f + 1}, {2 * f + 1}, ...; "
            f"seconds x fps + 1 when only seconds is given; got {params.num_frames})"
        )
    if not 0 < params.fps <= MAX_FPS:
        raise InvalidStageInput(f"fps: must be in (0, {MAX_FPS:g}] (got {params.fps:g})")
    if not 1 <= params.num_inference_steps <= rules.max_inference_steps:
        raise InvalidStageInput(
            f"num_inference_steps: must be in [1, {rules.max_inference_steps}] (got {params.num_inference_steps})"
        )
    if params.guidance_scale < 0:
        raise InvalidStageInput(f"guidance_scale: must be >= 0 (got {params.guidance_scale})")


def resolve_video_params(request: StageRequest, rules: VideoRules) -> VideoParams:
    """The request's video parameters (or the stage defaults), checked; the seed always set."""
    params = request.video or rules.defaults
    check(params, rules)
    if params.seed is None:
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbelow(SEED_MOD)
        params = params.model_copy(update={"seed": seed})
    return params
