"""Video request parameters as diffusion engines check them: the rules of :mod:`.image_params`, plus frames.

A video DiT's VAE compresses time by a factor (Wan 2.2: 4) and space by another times the transformer's
patch (Wan 2.2 TI2V: 16 x 2), so only some frame counts and sizes exist; vLLM-Omni rounds others down
silently (``pipeline_wan2_2.py``), here they are refused naming the field and the values that work.
"""

from __future__ import annotations

import secrets
from typing import Protocol

from omni_serve.models.image_params import SEED_MOD
from omni_serve.types import InvalidStageInput, StageRequest, VideoParams

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


def resolve_video_params(
    request: StageRequest, limits: VideoLimits, size_multiple: int, frame_multiple: int
) -> VideoParams:
    """The request's video parameters (or the stage defaults), checked; the seed always set.

    Messages start with the field name, which the videos route turns into the error's ``param``.
    """
    params = request.video or VideoParams(
        width=limits.default_width,
        height=limits.default_height,
        num_frames=limits.default_num_frames,
        fps=limits.default_fps,
        num_inference_steps=limits.default_num_inference_steps,
        guidance_scale=limits.default_guidance_scale,
    )
    m = size_multiple
    size = f"{params.width}x{params.height}"
    if params.width < m or params.height < m or params.width % m or params.height % m:
        raise InvalidStageInput(f"size: width and height must be positive multiples of {m} (got {size})")
    if params.width * params.height > limits.max_pixels:
        raise InvalidStageInput(f"size: at most {limits.max_pixels} pixels a frame (got {size})")
    if not 1 <= params.num_frames <= limits.max_frames or (params.num_frames - 1) % frame_multiple:
        raise InvalidStageInput(
            f"num_frames: must be {frame_multiple} x k + 1 and at most {limits.max_frames} "
            f"(1, {frame_multiple + 1}, {2 * frame_multiple + 1}, ...; got {params.num_frames})"
        )
    if not 0 < params.fps <= MAX_FPS:
        raise InvalidStageInput(f"fps: must be in (0, {MAX_FPS:g}] (got {params.fps:g})")
    if not 1 <= params.num_inference_steps <= limits.max_inference_steps:
        raise InvalidStageInput(
            f"num_inference_steps: must be in [1, {limits.max_inference_steps}] (got {params.num_inference_steps})"
        )
    if params.guidance_scale < 0:
        raise InvalidStageInput(f"guidance_scale: must be >= 0 (got {params.guidance_scale})")
    if params.seed is None:
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbelow(SEED_MOD)
        params = params.model_copy(update={"seed": seed})
    return params
