"""Image request parameters as diffusion engines check them: one rule set for every image family."""

from __future__ import annotations

import secrets
from typing import Protocol

from omni_serve.types import ImageParams, InvalidStageInput, StageRequest

SEED_MOD = 2**63


class ImageLimits(Protocol):
    """The engine-args fields every image engine family declares."""

    default_width: int
    default_height: int
    default_num_inference_steps: int
    default_guidance_scale: float
    max_pixels: int
    max_inference_steps: int
    max_images: int


def resolve_image_params(request: StageRequest, limits: ImageLimits, size_multiple: int) -> ImageParams:
    """The request's image parameters (or the stage defaults for chat), checked; the seed always set.

    Messages start with the field name, which the images route turns into the error's ``param``.
    """
    params = request.image or ImageParams(
        width=limits.default_width,
        height=limits.default_height,
        num_inference_steps=limits.default_num_inference_steps,
        guidance_scale=limits.default_guidance_scale,
    )
    m = size_multiple
    size = f"{params.width}x{params.height}"
    if params.width < m or params.height < m or params.width % m or params.height % m:
        raise InvalidStageInput(f"size: width and height must be positive multiples of {m} (got {size})")
    if params.width * params.height > limits.max_pixels:
        raise InvalidStageInput(f"size: at most {limits.max_pixels} pixels (got {size})")
    if not 1 <= params.num_inference_steps <= limits.max_inference_steps:
        raise InvalidStageInput(
            f"num_inference_steps: must be in [1, {limits.max_inference_steps}] (got {params.num_inference_steps})"
        )
    if not 1 <= params.n <= limits.max_images:
        raise InvalidStageInput(f"n: must be in [1, {limits.max_images}] (got {params.n})")
    if params.guidance_scale < 0:
        raise InvalidStageInput(f"guidance_scale: must be >= 0 (got {params.guidance_scale})")
    if params.seed is None:
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbelow(SEED_MOD)
        params = params.model_copy(update={"seed": seed})
    return params
