"""Image generation and editing: the ``/v1/images/generations`` and ``/v1/images/edits`` request models and the image
parts of replies.

Pure functions and models; the ingress route only wires them to the orchestrator.
The body follows OpenAI's images API plus the diffusion fields vLLM-Omni accepts
(``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``seed``). Limits
that depend on the model (size multiples, most pixels) are checked by the diffusion
stage, which answers 400 naming the field.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_serve.api.openai.errors import APIError, bad_request
from omni_serve.api.openai.messages import FORM, not_blank
from omni_serve.media.encode import b64, data_url, encode_png
from omni_serve.types import ChatMessage, ImageParams, MediaPart, Modality, StageOutput, TextPart

if TYPE_CHECKING:
    from starlette.requests import Request

    from omni_serve.api.openai.route import RouteContext
    from omni_serve.graph.request import OmniRequest

_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_SIDE = 4096


def checked_size(size: str) -> str:
    """``size`` if it is 'WIDTHxHEIGHT' with sides in [1, MAX_SIDE]; ValueError (pydantic's 400) otherwise."""
    match = _SIZE.match(size)
    if not match:
        raise ValueError("must be 'WIDTHxHEIGHT', e.g. '1024x1024'")
    if not all(1 <= int(side) <= MAX_SIDE for side in match.groups()):
        raise ValueError(f"width and height must be in [1, {MAX_SIDE}]")
    return size


class ImageGenerationRequest(BaseModel):
    # Strict types, as every JSON body's (messages._Strict says why).
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, description="What to draw.")
    model: str | None = None
    n: int = Field(1, ge=1, le=4, description="Number of images; each uses seed + i.")
    size: str = Field("1024x1024", description="'WIDTHxHEIGHT' in pixels.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Only b64_json: images are not stored.")
    output_format: Literal["png"] = Field("png", description="Image file format; PNG only.")
    negative_prompt: str | None = Field(None, description="Used with guidance_scale > 1 (true CFG).")
    num_inference_steps: int | None = Field(
        None,
        ge=1,
        le=200,
        description="Denoising steps; default: the model's (the stage's default_num_inference_steps).",
    )
    guidance_scale: float | None = Field(
        None,
        ge=0.0,
        le=20.0,
        description="Guidance scale (Qwen-Image: its true_cfg_scale); default: the model's (default_guidance_scale).",
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same image.")
    user: str | None = None  # accepted for client compatibility; ignored

    @field_validator("prompt")
    @classmethod
    def _something_to_draw(cls, prompt: str) -> str:
        return not_blank(prompt)

    @field_validator("response_format", mode="before")
    @classmethod
    def _no_urls(cls, value: Any) -> Any:
        if value == "url":
            raise ValueError("'url' is not supported (images are not stored); use 'b64_json'")
        return value

    @field_validator("size")
    @classmethod
    def _size(cls, size: str) -> str:
        return checked_size(size)

    def width_height(self) -> tuple[int, int]:
        width, height = self.size.split("x")
        return int(width), int(height)

    def messages(self) -> list[ChatMessage]:
        return [ChatMessage(role="user", content=self.prompt)]

    def image_params(self) -> ImageParams:
        width, height = self.width_height()
        return ImageParams(
            width=width,
            height=height,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
            seed=self.seed,
            n=self.n,
        )


class ImageEditRequest(ImageGenerationRequest):
    """``/v1/images/edits``' form fields but the files (OpenAI's multipart: ``image``, and ``mask``, refused here).

    The generation fields with their meaning; ``size`` defaults to OpenAI's ``auto``: the source image's size
    (which the stage checks like any size). The source image travels to the entry stage as a chat image part
    does: by reference, checked here by its bytes (format, size) and decoded only by the stage.
    """

    model_config = FORM
    size: str = Field("auto", description="'WIDTHxHEIGHT', or 'auto' (the source image's size).")

    @field_validator("size")
    @classmethod
    def _size(cls, size: str) -> str:
        return size if size == "auto" else checked_size(size)

    def width_height(self) -> tuple[int, int]:
        return (0, 0) if self.size == "auto" else super().width_height()


def generation_response(created: int, images: list[np.ndarray]) -> dict[str, Any]:
    """The OpenAI ``ImagesResponse`` body: PNGs as base64."""
    return {"created": created, "data": [{"b64_json": b64(encode_png(image))} for image in images]}


def content_parts(images: list[np.ndarray]) -> list[dict[str, Any]]:
    """Chat ``message.content`` parts carrying each image as a PNG data URL."""
    return [{"type": "image_url", "image_url": {"url": data_url(encode_png(image), "image/png")}} for image in images]


@dataclass
class ImagesReply:
    """The ``ImagesResponse`` of one generation request (never streamed).

    PNG encoding is CPU work (up to 4 x 2048^2 images: seconds): it runs in a worker thread, so the ingress
    event loop every other request shares keeps answering meanwhile.
    """

    media_type = "application/json"

    def decides_status(self, output: StageOutput) -> bool:
        return True

    async def json(self, outputs: AsyncIterator[StageOutput]) -> dict[str, Any]:
        generated: list[np.ndarray] = []
        async for output in outputs:
            generated.extend(output.images)
        return await asyncio.to_thread(generation_response, int(time.time()), generated)

    def stream(self, outputs: AsyncIterator[StageOutput]) -> AsyncIterator[bytes]:
        raise TypeError("image replies are JSON, never streamed")

    def headers(self, head: list[StageOutput]) -> dict[str, str]:
        return {}

    def in_band_error(self, error: APIError) -> None:
        return None


def image_generation_request(body: ImageGenerationRequest, http: Request, route: RouteContext) -> OmniRequest:
    """The generation body as the graph's request (its reply: :class:`ImagesReply`)."""
    return route.request(
        http,
        modalities={Modality.IMAGE},
        sampling=route.sampling_defaults(body.seed),
        messages=body.messages(),
        image=body.image_params(),
    )


def edit_image(files: dict[str, bytes]) -> bytes | None:
    """The edit's one source image among the upload's files. A ``mask`` (OpenAI's inpainting area) is refused:
    the served edit pipelines edit by instruction, whole."""
    for name in files:
        if name not in ("image", "image[]"):
            if name == "mask":
                raise bad_request("mask: not supported (this model edits the whole image by the instruction)", name)
            raise bad_request(f"{name}: unknown field", name)
    if "image" in files and "image[]" in files:
        raise bad_request("image: this model edits one image per request", "image")
    return files.get("image", files.get("image[]"))


def image_edit_request(body: ImageEditRequest, image: MediaPart, http: Request, route: RouteContext) -> OmniRequest:
    """The edit as the graph's request: its source image (the checked upload) is a chat image part by another
    name, the same formats, byte limit and path (by reference to the entry stage, which decodes it)."""
    return route.request(
        http,
        modalities={Modality.IMAGE},
        sampling=route.sampling_defaults(body.seed),
        messages=[ChatMessage(role="user", content=[image, TextPart(text=body.prompt)])],
        image=body.image_params(),
    )
