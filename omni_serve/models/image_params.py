"""Image request parameters as diffusion engines check them: one rule set for every image family."""

from __future__ import annotations

import math
import secrets
from typing import Protocol

from omni_serve.exceptions import InvalidStageInput
from omni_serve.types import ImageParams, StageRequest, TextPart

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


class ResolvedImageParams(ImageParams):
    """Image parameters as a stage draws with them: every value set."""

    num_inference_steps: int
    guidance_scale: float
    seed: int


def resolve_image_params(request: StageRequest, limits: ImageLimits, size_multiple: int) -> ResolvedImageParams:
    """The request's image parameters (the stage defaults for chat, and for steps and guidance a request leaves
    out), checked; the seed always set.

    Messages start with the field name, which the images route turns into the error's ``param``.
    """
    given = request.image or ImageParams(width=limits.default_width, height=limits.default_height)
    steps = given.num_inference_steps if given.num_inference_steps is not None else limits.default_num_inference_steps
    guidance = given.guidance_scale if given.guidance_scale is not None else limits.default_guidance_scale
    m = size_multiple
    size = f"{given.width}x{given.height}"
    if given.width < m or given.height < m or given.width % m or given.height % m:
        raise InvalidStageInput(f"size: width and height must be positive multiples of {m} (got {size})")
    if given.width * given.height > limits.max_pixels:
        raise InvalidStageInput(f"size: at most {limits.max_pixels} pixels (got {size})")
    if not 1 <= steps <= limits.max_inference_steps:
        raise InvalidStageInput(f"num_inference_steps: must be in [1, {limits.max_inference_steps}] (got {steps})")
    if not 1 <= given.n <= limits.max_images:
        raise InvalidStageInput(f"n: must be in [1, {limits.max_images}] (got {given.n})")
    if guidance < 0:
        raise InvalidStageInput(f"guidance_scale: must be >= 0 (got {guidance})")
    seed = given.seed
    if seed is None:
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbelow(SEED_MOD)
    return ResolvedImageParams(
        **{**given.model_dump(), "num_inference_steps": steps, "guidance_scale": guidance, "seed": seed}
    )


def fitted_size(width: int, height: int, multiple: int, max_pixels: int) -> tuple[int, int]:
    """The size nearest ``width`` x ``height`` that a model making sides in multiples of ``multiple`` and at most
    ``max_pixels`` pixels can make: scaled down (the aspect kept) to fit, each side rounded to a multiple.

    An edit's size ``auto``: the source image's size as the model can make it (OpenAI and vLLM-Omni take a
    photo of any size), never a 400 on a size the client did not send.
    """
    scale = min(1.0, math.sqrt(max_pixels / max(1, width * height)))
    fitted = [max(multiple, round(side * scale / multiple) * multiple) for side in (width, height)]
    while fitted[0] * fitted[1] > max_pixels and max(fitted) > multiple:  # rounding up passed the bound
        larger = 0 if fitted[0] >= fitted[1] else 1
        fitted[larger] -= multiple
    return fitted[0], fitted[1]


def prompt_of(request: StageRequest) -> str:
    """The prompt: the text of the last user message."""
    for message in reversed(request.messages or []):
        if message.role == "user":  # image graphs take text only: a string, or text parts
            content = message.content
            return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, TextPart))
    raise InvalidStageInput("messages: an image request needs a user message with the prompt")
